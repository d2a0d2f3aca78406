"""Byte-identity with what Megatron-LM's tools/preprocess_data.py writes.

Megatron-LM builds its tokenizer with megatron-core's ``MegatronTokenizer``
(``megatron.core.tokenizers``, installed here) and writes each document with
``IndexedDatasetBuilder.add_document(tokenize(text) [+ eod])`` in the dtype
``DType.optimal_dtype(tokenizer.vocab_size)``. This reproduces that loop with
megatron-core's own classes and compares the files.
"""

from __future__ import annotations

import filecmp
import json
import os

import corpus_fixtures as T
import pytest


@pytest.fixture(scope="session")
def tok_files(tmp_path_factory):
    return T.build_all(str(tmp_path_factory.getbasetemp() / "data_tokenizers"))


def megatron_lm_preprocess(tokenizer, docs, prefix, append_eod=True):
    """The encode + write loop of Megatron-LM's preprocess_data.py (no sentence splitting)."""
    import torch
    from megatron.core.datasets import indexed_dataset

    builder = indexed_dataset.IndexedDatasetBuilder(
        prefix + ".bin", dtype=indexed_dataset.DType.optimal_dtype(tokenizer.vocab_size)
    )
    for text in docs:
        ids = tokenizer.tokenize(text)
        lens = [len(ids)] if ids else []
        if ids and append_eod:
            ids = list(ids) + [tokenizer.eod]
            lens[-1] += 1
        builder.add_document(torch.tensor(ids, dtype=torch.int64), lens)
    builder.finalize(prefix + ".idx")


def megatron_tokenizer(kind, files, tmp_path):
    from megatron.core.tokenizers import MegatronTokenizer

    from megatron_lol.data.tokenizers import load_tiktoken_ranks

    if kind == "sentencepiece":
        return MegatronTokenizer.from_pretrained(
            tokenizer_path=files["sentencepiece"], metadata_path={"library": "sentencepiece"}
        )
    if kind == "tiktoken":
        n = len(load_tiktoken_ranks(files["json"]))
        return MegatronTokenizer.from_pretrained(
            tokenizer_path=files["json"],
            metadata_path={"library": "tiktoken"},
            vocab_size=n + 1000,
            num_special_tokens=1000,
        )
    pytest.importorskip("transformers")
    from transformers import AutoTokenizer

    if kind == "huggingface":
        d = tmp_path / "hf"
        d.mkdir()
        (d / "tokenizer.json").write_bytes(open(files["tokenizer_json"], "rb").read())
        (d / "tokenizer_config.json").write_text(
            json.dumps({"eos_token": "<|endoftext|>", "tokenizer_class": "PreTrainedTokenizerFast"})
        )
        return MegatronTokenizer.from_pretrained(tokenizer_path=str(d), metadata_path={"library": "huggingface"})
    if kind == "gpt2bpe":
        # Megatron-LM's GPT2BPETokenizer is transformers' GPT-2 tokenizer over --vocab-file/--merge-file
        # (it fetches the "gpt2" config from the hub first; offline we load the same files locally).
        d = tmp_path / "gpt2"
        d.mkdir()
        for name, key in (("vocab.json", "vocab"), ("merges.txt", "merges")):
            (d / name).write_bytes(open(files[key], "rb").read())
        (d / "config.json").write_text(json.dumps({"model_type": "gpt2"}))
        hf = AutoTokenizer.from_pretrained(str(d))

        class _GPT2:
            vocab_size = len(hf)
            eod = hf.eos_token_id

            @staticmethod
            def tokenize(text):
                return hf(text).input_ids

        return _GPT2()
    raise KeyError(kind)


@pytest.mark.parametrize("kind", ["sentencepiece", "tiktoken", "huggingface", "gpt2bpe"])
def test_bin_byte_identical_to_megatron_lm(tmp_path, tok_files, kind):
    docs = [d for d in T.sample_documents() if d.strip()]  # empty docs: see below
    ref = str(tmp_path / "ref")
    megatron_lm_preprocess(megatron_tokenizer(kind, tok_files, tmp_path), docs, ref)
    inp = T.write_inputs(docs, "jsonl", str(tmp_path / "in"))
    argv = T.tokenizer_argv(kind, tok_files)
    if kind == "tiktoken":
        argv = ["--tokenizer-type", "TikTokenizer", "--tokenizer-model", tok_files["json"]]
    T.run_preprocess(["--input", inp, "--output-prefix", str(tmp_path / "ours"), "--append-eod", *argv])
    ours = str(tmp_path / "ours_text_document")
    assert os.path.getsize(ref + ".bin") > 1000
    assert filecmp.cmp(ref + ".bin", ours + ".bin", shallow=False)
    # without empty documents the index is identical too
    assert filecmp.cmp(ref + ".idx", ours + ".idx", shallow=False)


def test_empty_documents_bin_identical(tmp_path, tok_files):
    """Megatron-LM records an empty document as a zero-sequence document in the .idx; we skip
    and count it. The .bin (what training reads) is the same either way."""
    docs = T.sample_documents()
    ref = str(tmp_path / "ref")
    megatron_lm_preprocess(megatron_tokenizer("sentencepiece", tok_files, tmp_path), docs, ref)
    inp = T.write_inputs(docs, "jsonl", str(tmp_path / "in"))
    T.run_preprocess(
        [
            "--input",
            inp,
            "--output-prefix",
            str(tmp_path / "o"),
            "--append-eod",
            *T.tokenizer_argv("sentencepiece", tok_files),
        ]
    )
    assert filecmp.cmp(ref + ".bin", str(tmp_path / "o_text_document.bin"), shallow=False)


@pytest.mark.parametrize("kind", ["sentencepiece", "tiktoken"])
def test_tokenizer_wrapper_matches_megatron(tmp_path, tok_files, kind):
    from megatron_lol.data.tokenizers import build_tokenizer

    meg = megatron_tokenizer(kind, tok_files, tmp_path)
    kw = T.tokenizer_kwargs(kind, tok_files)
    ours = build_tokenizer(**kw)
    assert (ours.vocab_size, ours.eod) == (meg.vocab_size, meg.eod)
    for d in T.sample_documents():
        assert ours.tokenize(d) == list(meg.tokenize(d))
    if kind == "tiktoken":  # both file formats give the same ids
        other = build_tokenizer("TikTokenizer", tok_files["json"])
        assert all(other.tokenize(d) == ours.tokenize(d) for d in T.sample_documents())
