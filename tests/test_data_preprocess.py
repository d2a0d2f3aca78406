"""preprocess: every input format x every tokenizer type, read back with megatron-core."""

from __future__ import annotations

import filecmp
import os

import corpus_fixtures as T
import numpy as np
import pytest

from megatron_lol.data.tokenizers import build_tokenizer

KINDS = ("sentencepiece", "huggingface", "tiktoken", "gpt2bpe")


@pytest.fixture(scope="session")
def tok_files(tmp_path_factory):
    return T.build_all(str(tmp_path_factory.getbasetemp() / "data_tokenizers"))


@pytest.fixture(scope="session")
def docs():
    return T.sample_documents()


def expected_stream(tok, docs, append_eod=True):
    out = []
    for d in docs:
        ids = tok.tokenize(d)
        if ids:
            out.append(list(ids) + ([tok.eod] if append_eod else []))
    return out


def read_dataset(prefix):
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    ds = IndexedDataset(prefix)
    return [ds[i].tolist() for i in range(len(ds))], ds


@pytest.mark.parametrize("fmt", T.FORMATS)
@pytest.mark.parametrize("kind", KINDS)
def test_token_stream_equals_direct_encoding(tmp_path, tok_files, docs, kind, fmt):
    inp = T.write_inputs(docs, fmt, str(tmp_path / "in"))
    s = T.run_preprocess(
        ["--input", inp, "--output-prefix", str(tmp_path / "out"), "--append-eod", *T.tokenizer_argv(kind, tok_files)]
    )
    tok = build_tokenizer(**T.tokenizer_kwargs(kind, tok_files))
    want = expected_stream(tok, docs)
    got, ds = read_dataset(str(tmp_path / "out_text_document"))
    assert got == want
    assert ds.index.dtype == (np.uint16 if tok.vocab_size < 65500 else np.int32)
    assert s["documents"] == len(docs)
    n_empty = len(docs) - len(want)
    assert n_empty >= 1  # "" (and whitespace-only for SentencePiece)
    assert s["empty_documents"]["text"] == n_empty
    # no temporary files left behind
    assert sorted(os.listdir(tmp_path)) == ["in", "out_text_document.bin", "out_text_document.idx"]


def test_without_eod_and_two_keys(tmp_path, tok_files, docs):
    import json

    inp = tmp_path / "in.jsonl"
    with open(inp, "w") as f:
        for i, d in enumerate(docs):
            f.write(json.dumps({"text": d, "title": f"document number {i}"}) + "\n")
    T.run_preprocess(
        [
            "--input",
            str(inp),
            "--output-prefix",
            str(tmp_path / "o"),
            "--json-keys",
            "text",
            "title",
            *T.tokenizer_argv("sentencepiece", tok_files),
        ]
    )
    tok = build_tokenizer(**T.tokenizer_kwargs("sentencepiece", tok_files))
    assert read_dataset(str(tmp_path / "o_text_document"))[0] == expected_stream(tok, docs, False)
    titles = [f"document number {i}" for i in range(len(docs))]
    assert read_dataset(str(tmp_path / "o_title_document"))[0] == expected_stream(tok, titles, False)


@pytest.mark.multiprocess
def test_workers_give_identical_output(tmp_path, tok_files, docs):
    inp = T.write_inputs(docs * 3, "jsonl", str(tmp_path / "in"))
    outs = []
    for w in (1, 2):
        pre = str(tmp_path / f"w{w}")
        T.run_preprocess(
            [
                "--input",
                inp,
                "--output-prefix",
                pre,
                "--append-eod",
                "--workers",
                str(w),
                "--max-inflight",
                "3",
                *T.tokenizer_argv("sentencepiece", tok_files),
            ]
        )
        outs.append(pre + "_text_document")
    for ext in (".bin", ".idx"):
        assert filecmp.cmp(outs[0] + ext, outs[1] + ext, shallow=False)


def test_index_is_byte_identical_to_megatron_builder(tmp_path):
    import torch
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

    from megatron_lol.data.indexed import StreamingIndexWriter

    rng = np.random.default_rng(0)
    for dtype, hi in ((np.uint16, 65000), (np.int32, 200_000)):
        docs = [rng.integers(0, hi, rng.integers(1, 300)) for _ in range(500)]
        ref = IndexedDatasetBuilder(str(tmp_path / "ref.bin"), dtype=dtype)
        for d in docs:
            ref.add_document(torch.tensor(d), [len(d)])
        ref.finalize(str(tmp_path / "ref.idx"))
        w = StreamingIndexWriter(str(tmp_path / "ours"), dtype)
        for d in docs[:7]:
            w.add_document(d)
        rest = docs[7:]
        w.add_documents(np.concatenate(rest).astype(dtype).tobytes(), np.array([len(d) for d in rest]))
        w.finalize()
        for ext in (".bin", ".idx"):
            assert filecmp.cmp(str(tmp_path / ("ref" + ext)), str(tmp_path / ("ours" + ext)), shallow=False)


def test_cli_entry_points(tmp_path, tok_files, docs, capsys):
    from megatron_lol.cli import main

    inp = T.write_inputs(docs, "jsonl", str(tmp_path / "in"))
    rc = main(
        [
            "preprocess",
            "--input",
            inp,
            "--output-prefix",
            str(tmp_path / "c"),
            "--append-eod",
            "--workers",
            "1",
            "--no-progress",
            *T.tokenizer_argv("sentencepiece", tok_files),
        ]
    )
    assert rc == 0
    out = capsys.readouterr().out
    assert "documents" in out and "tokens/s" in out and "empty documents skipped: 2" in out
