"""--shard I/N + merge-datasets == one unsharded run, byte for byte."""

from __future__ import annotations

import filecmp
import os

import corpus_fixtures as T
import pytest

from megatron_lol.cli import main


@pytest.fixture(scope="session")
def tok_files(tmp_path_factory):
    return T.build_all(str(tmp_path_factory.getbasetemp() / "data_tokenizers"))


def mixed_inputs(root):
    """Several files of different formats under one directory (sorted order = input order)."""
    docs = T.sample_documents(60, 3000)
    T.write_inputs(docs[:25], "jsonl", os.path.join(root, "a"), files=3)
    T.write_inputs(docs[25:35], "jsonl.gz", os.path.join(root, "b"))
    T.write_inputs(docs[35:50], "parquet", os.path.join(root, "c"), row_group_size=4)
    T.write_inputs(docs[50:55], "txt", os.path.join(root, "d"))
    T.write_inputs(docs[55:], "jsonl.zst", os.path.join(root, "e"))
    return root, len(docs)


@pytest.mark.parametrize("num_shards", [2, 3, 7])
def test_merged_shards_identical_to_unsharded(tmp_path, tok_files, num_shards, capsys):
    inp, n_docs = mixed_inputs(str(tmp_path / "in"))
    tok = T.tokenizer_argv("sentencepiece", tok_files)
    T.run_preprocess(["--input", inp, "--output-prefix", str(tmp_path / "full"), "--append-eod", *tok])
    sh = tmp_path / "shards"
    sh.mkdir()
    total_docs = 0
    for i in range(num_shards):
        s = T.run_preprocess(
            ["--input", inp, "--output-prefix", str(sh / "part"), "--append-eod", "--shard", f"{i}/{num_shards}", *tok]
        )
        total_docs += s["documents"]
    assert total_docs == n_docs
    names = sorted(os.listdir(sh))
    assert names[0] == f"part_text_document.shard-00000-of-{num_shards:05d}.bin"
    rc = main(["merge-datasets", "--input", str(sh), "--output-prefix", str(tmp_path / "merged")])
    assert rc == 0
    for ext in (".bin", ".idx"):
        assert filecmp.cmp(str(tmp_path / "full_text_document") + ext, str(tmp_path / "merged") + ext, shallow=False)


def test_single_file_byte_range_shards(tmp_path, tok_files):
    """One big JSONL file split by byte ranges; lines straddling a boundary go to one shard only."""
    docs = T.sample_documents(40, 2000) * 3
    inp = T.write_inputs(docs, "jsonl", str(tmp_path / "in"))
    tok = T.tokenizer_argv("tiktoken", tok_files)
    T.run_preprocess(["--input", inp, "--output-prefix", str(tmp_path / "full"), *tok])
    prefixes = []
    for i in range(5):
        T.run_preprocess(["--input", inp, "--output-prefix", str(tmp_path / "p"), "--shard", f"{i}/5", *tok])
        prefixes.append(str(tmp_path / f"p_text_document.shard-{i:05d}-of-00005"))
    # explicit prefixes in a scrambled order: shards are re-ordered by index
    rc = main(["merge-datasets", "--input", *reversed(prefixes), "--output-prefix", str(tmp_path / "m")])
    assert rc == 0
    for ext in (".bin", ".idx"):
        assert filecmp.cmp(str(tmp_path / "full_text_document") + ext, str(tmp_path / "m") + ext, shallow=False)


def test_merge_refuses_incomplete_or_mixed(tmp_path, tok_files, capsys):
    inp = T.write_inputs(T.sample_documents(20, 1000), "jsonl", str(tmp_path / "in"))
    tok = T.tokenizer_argv("sentencepiece", tok_files)
    for i in (0, 2):
        T.run_preprocess(["--input", inp, "--output-prefix", str(tmp_path / "p"), "--shard", f"{i}/3", *tok])
    rc = main(
        ["merge-datasets", "--input", str(tmp_path / "p_text_document.shard-*"), "--output-prefix", str(tmp_path / "m")]
    )
    err = capsys.readouterr().err
    assert rc == 2 and "missing shard(s) 1 of 3" in err
    assert not os.path.exists(tmp_path / "m.idx")
    # several datasets in the given order; an existing output is not overwritten
    T.run_preprocess(["--input", inp, "--output-prefix", str(tmp_path / "a"), *tok])
    T.run_preprocess(["--input", inp, "--output-prefix", str(tmp_path / "b"), *tok])
    argv = [
        "merge-datasets",
        "--input",
        str(tmp_path / "a_text_document"),
        str(tmp_path / "b_text_document"),
        "--output-prefix",
        str(tmp_path / "ab"),
    ]
    assert main(argv) == 0
    assert os.path.getsize(tmp_path / "ab.bin") == 2 * os.path.getsize(tmp_path / "a_text_document.bin")
    assert main(argv) == 2 and "exists" in capsys.readouterr().err


def test_megatron_add_index_equivalence(tmp_path, tok_files):
    """merge-datasets == megatron-core IndexedDatasetBuilder.add_index over the same parts."""
    import numpy as np
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

    from megatron_lol.data.indexed import merge_datasets

    inp = T.write_inputs(T.sample_documents(30, 2000), "jsonl", str(tmp_path / "in"))
    tok = T.tokenizer_argv("sentencepiece", tok_files)
    parts = []
    for i in range(3):
        T.run_preprocess(["--input", inp, "--output-prefix", str(tmp_path / "p"), "--shard", f"{i}/3", *tok])
        parts.append(str(tmp_path / f"p_text_document.shard-{i:05d}-of-00003"))
    b = IndexedDatasetBuilder(str(tmp_path / "ref.bin"), dtype=np.uint16)
    for p in parts:
        b.add_index(p)
    b.finalize(str(tmp_path / "ref.idx"))
    merge_datasets(parts, str(tmp_path / "ours"))
    for ext in (".bin", ".idx"):
        assert filecmp.cmp(str(tmp_path / "ref") + ext, str(tmp_path / "ours") + ext, shallow=False)
