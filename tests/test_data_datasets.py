"""Training-side datasets: blends, splits, cache, no position/mask resets, document boundaries."""

from __future__ import annotations

import os

import corpus_fixtures as T
import pytest
import torch

from megatron_lol.data.datasets import build_train_valid_test_datasets, parse_blend
from megatron_lol.data.tokenizers import build_tokenizer
from megatron_lol.model.windows import DocumentLayout


def document_ids(tokens, eod_id):
    doc = DocumentLayout.from_tokens(tokens, eod_id).doc_index
    return doc - doc[:, :1]


def document_positions(tokens, eod_id):
    return DocumentLayout.from_tokens(tokens, eod_id).positions


@pytest.fixture(scope="session")
def tok_files(tmp_path_factory):
    return T.build_all(str(tmp_path_factory.getbasetemp() / "data_tokenizers"))


@pytest.fixture(scope="session")
def two_datasets(tmp_path_factory, tok_files):
    root = tmp_path_factory.mktemp("ds")
    docs = T.stdlib_documents(600_000, 6000)
    prefixes = []
    for name, part in (("a", docs[::2]), ("b", docs[1::2])):
        inp = T.write_inputs(part, "jsonl", str(root / f"in_{name}"))
        T.run_preprocess(
            [
                "--input",
                inp,
                "--output-prefix",
                str(root / name),
                "--append-eod",
                *T.tokenizer_argv("sentencepiece", tok_files),
            ]
        )
        prefixes.append(str(root / f"{name}_text_document"))
    return prefixes


def test_single_and_blended(tmp_path, tok_files, two_datasets):
    tok = build_tokenizer(**T.tokenizer_kwargs("sentencepiece", tok_files))
    a, b = two_datasets
    cache = str(tmp_path / "cache")
    train, valid, test = build_train_valid_test_datasets([a], "90,5,5", 64, 1234, cache, (200, 20, 20), tok)
    assert len(train) >= 200 and len(valid) >= 20 and len(test) >= 20
    s = train[0]
    assert {"tokens", "labels", "loss_mask"} <= set(s)
    assert s["tokens"].shape == (64,) and s["labels"].shape == (64,)
    # no resets: position ids run straight through EODs; loss not masked at EOD
    assert torch.equal(s["position_ids"], torch.arange(64))
    assert "attention_mask" not in s
    eod_rows = [train[i] for i in range(50) if (train[i]["tokens"] == tok.eod).any()]
    assert eod_rows, "expected EOD tokens inside samples"
    assert all(bool((r["loss_mask"] == 1).all()) for r in eod_rows)
    assert os.listdir(cache)  # sample indices cached

    train2, valid2, test2 = build_train_valid_test_datasets(
        ["0.25", a, "0.75", b], "98,2,0", 64, 1234, cache, (400, 40, 0), tok
    )
    from megatron.core.datasets.blended_dataset import BlendedDataset

    assert isinstance(train2, BlendedDataset) and len(train2) == 400
    assert test2 is None
    counts = torch.bincount(torch.as_tensor(train2.dataset_index[:400].astype("int64")), minlength=2)
    assert abs(counts[0].item() / 400 - 0.25) < 0.03
    # deterministic: rebuilt from the cache, same samples
    again = build_train_valid_test_datasets(["0.25", a, "0.75", b], "98,2,0", 64, 1234, cache, (400, 40, 0), tok)[0]
    assert torch.equal(again[17]["tokens"], train2[17]["tokens"])


def test_validation_errors_name_the_path(tmp_path, two_datasets):
    a, _ = two_datasets
    missing = str(tmp_path / "nope_text_document")
    with pytest.raises(ValueError, match="nope_text_document"):
        parse_blend([missing])
    with pytest.raises(ValueError, match="odd-length"):
        parse_blend(["0.5", a, "0.5"])
    with pytest.raises(ValueError, match=r"weight 'heavy' for .*a_text_document"):
        parse_blend(["heavy", a, "1", a])
    with pytest.raises(ValueError, match=r"a_text_document.bin.*give the prefix"):
        parse_blend([a + ".bin"])
    assert parse_blend([a]) == ([a], None)
    assert parse_blend([1, a, 3, a]) == ([a, a], [1.0, 3.0])


def _reference(tokens, eod):
    ids, pos = torch.zeros_like(tokens), torch.zeros_like(tokens)
    for r in range(tokens.shape[0]):
        d = p = 0
        for t in range(tokens.shape[1]):
            ids[r, t], pos[r, t] = d, p
            p += 1
            if tokens[r, t] == eod:
                d, p = d + 1, 0
    return ids, pos


def test_document_ids_and_positions():
    eod = 2
    x = torch.tensor([[5, 2, 7, 8, 2, 2, 9], [2, 1, 1, 1, 1, 1, 2], [3, 3, 3, 3, 3, 3, 3]])
    assert document_ids(x, eod).tolist() == [[0, 0, 1, 1, 1, 2, 3], [0, 1, 1, 1, 1, 1, 1], [0] * 7]
    assert document_positions(x, eod).tolist() == [[0, 1, 0, 1, 2, 0, 0], [0, 0, 1, 2, 3, 4, 5], list(range(7))]
    g = torch.Generator().manual_seed(0)
    for _ in range(5):
        t = torch.randint(0, 6, (4, 33), generator=g)
        ids, pos = _reference(t, eod)
        assert torch.equal(document_ids(t, eod), ids) and torch.equal(document_positions(t, eod), pos)
    assert document_ids(x, eod).dtype == torch.long and document_positions(x, eod).dtype == torch.long
