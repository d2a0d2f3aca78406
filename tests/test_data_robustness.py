"""Bad input stops with file:line (or is skipped and counted); no complete-looking output is left."""

from __future__ import annotations

import gzip
import json
import os
import signal
import subprocess
import sys
import time

import corpus_fixtures as T
import pytest

from megatron_lol.cli import main


@pytest.fixture(scope="session")
def tok_files(tmp_path_factory):
    return T.build_all(str(tmp_path_factory.getbasetemp() / "data_tokenizers"))


GOOD = [
    json.dumps({"text": f"Document number {i}: the quick brown fox jumps over the lazy dog."}).encode()
    for i in range(12)
]
BAD = {
    "malformed": (b'{"text": "unterminated', "malformed JSON"),
    "missing_key": (json.dumps({"body": "no text key here"}).encode(), "missing key 'text'"),
    "invalid_utf8": (b'{"text": "caf\xe9 latin-1 byte"}', "invalid UTF-8"),
    "not_a_string": (json.dumps({"text": ["a", "list"]}).encode(), "expected a string"),
    "lone_surrogate": (b'{"text": "bad \\ud800 surrogate"}', "lone surrogate U+D800"),
}


def write_lines(path, lines, compress=False):
    payload = b"\n".join(lines) + b"\n"
    with open(path, "wb") as f:
        f.write(gzip.compress(payload) if compress else payload)


def run_cli(argv, capsys):
    rc = main(["preprocess", "--no-progress", *argv])
    return rc, capsys.readouterr()


def assert_no_output(directory, keep=()):
    left = sorted(set(os.listdir(directory)) - set(keep))
    assert left == [], f"left behind: {left}"


@pytest.mark.parametrize("workers", [1, 2])
@pytest.mark.parametrize("case", sorted(BAD))
@pytest.mark.multiprocess
def test_bad_line_stops_with_file_and_line(tmp_path, tok_files, capsys, case, workers):
    bad, msg = BAD[case]
    inp = tmp_path / "in" / "corpus.jsonl"
    inp.parent.mkdir()
    write_lines(inp, GOOD[:6] + [bad] + GOOD[6:])  # bad line is line 7
    out = tmp_path / "out"
    out.mkdir()
    rc, cap = run_cli(
        [
            "--input",
            str(inp),
            "--output-prefix",
            str(out / "ds"),
            "--append-eod",
            "--workers",
            str(workers),
            *T.tokenizer_argv("sentencepiece", tok_files),
        ],
        capsys,
    )
    assert rc == 2
    err = cap.err.strip()
    assert len(err.splitlines()) == 1
    assert f"{inp}:7: " in err and msg in err and "--skip-bad-lines" in err
    assert_no_output(out)


def test_skip_bad_lines_counts_them(tmp_path, tok_files):
    inp = tmp_path / "corpus.jsonl"
    lines = list(GOOD)
    for i, case in enumerate(sorted(BAD)):
        lines.insert(2 * i + 1, BAD[case][0])
    lines.insert(3, json.dumps({"text": ""}).encode())
    write_lines(inp, lines)
    s = T.run_preprocess(
        [
            "--input",
            str(inp),
            "--output-prefix",
            str(tmp_path / "o"),
            "--append-eod",
            "--skip-bad-lines",
            *T.tokenizer_argv("sentencepiece", tok_files),
        ]
    )
    assert s["bad_lines_skipped"] == len(BAD)
    assert s["empty_documents"]["text"] == 1
    assert s["outputs"]["text"]["documents"] == len(GOOD)
    assert any(f"{inp}:2: " in e for e in s["bad_line_examples"])
    from megatron_lol.data.preprocess import format_summary

    text = format_summary(s)
    assert f"bad lines skipped: {len(BAD)}" in text and "empty documents skipped: 1" in text


def test_line_numbers_in_gzip_and_mid_file_shard(tmp_path, tok_files, capsys):
    lines = GOOD * 20
    lines[150] = BAD["malformed"][0]
    gz = tmp_path / "c.jsonl.gz"
    write_lines(gz, lines, compress=True)
    rc, cap = run_cli(
        ["--input", str(gz), "--output-prefix", str(tmp_path / "g"), *T.tokenizer_argv("sentencepiece", tok_files)],
        capsys,
    )
    assert rc == 2 and f"{gz}:151: malformed JSON" in cap.err
    plain = tmp_path / "c.jsonl"
    write_lines(plain, lines)
    rc, cap = run_cli(
        [
            "--input",
            str(plain),
            "--output-prefix",
            str(tmp_path / "p"),
            "--shard",
            "1/2",
            *T.tokenizer_argv("sentencepiece", tok_files),
        ],
        capsys,
    )
    assert rc == 2 and f"{plain}:151: malformed JSON" in cap.err
    assert not any(n.endswith((".idx", ".bin")) for n in os.listdir(tmp_path))


def test_invalid_utf8_txt_and_parquet_null(tmp_path, tok_files, capsys):
    d = tmp_path / "txt"
    d.mkdir()
    (d / "a.txt").write_text("fine\n")
    (d / "b.txt").write_bytes(b"first line\nsecond \xff\xfe line\n")
    rc, cap = run_cli(
        ["--input", str(d), "--output-prefix", str(tmp_path / "t"), *T.tokenizer_argv("sentencepiece", tok_files)],
        capsys,
    )
    assert rc == 2 and f"{d / 'b.txt'}:2: invalid UTF-8" in cap.err

    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"text": ["a", "b", None, "d"]}), tmp_path / "p.parquet", row_group_size=2)
    rc, cap = run_cli(
        [
            "--input",
            str(tmp_path / "p.parquet"),
            "--output-prefix",
            str(tmp_path / "q"),
            *T.tokenizer_argv("sentencepiece", tok_files),
        ],
        capsys,
    )
    assert rc == 2 and f"{tmp_path / 'p.parquet'}:3 (parquet row): null value" in cap.err
    pq.write_table(pa.table({"body": ["a"]}), tmp_path / "nocol.parquet")
    rc, cap = run_cli(
        [
            "--input",
            str(tmp_path / "nocol.parquet"),
            "--output-prefix",
            str(tmp_path / "r"),
            *T.tokenizer_argv("sentencepiece", tok_files),
        ],
        capsys,
    )
    assert rc == 2 and "no column 'text'" in cap.err
    assert not any(n.endswith((".idx", ".bin")) for n in os.listdir(tmp_path))


def test_existing_output_needs_overwrite(tmp_path, tok_files, capsys):
    inp = tmp_path / "c.jsonl"
    write_lines(inp, GOOD)
    argv = ["--input", str(inp), "--output-prefix", str(tmp_path / "o"), *T.tokenizer_argv("sentencepiece", tok_files)]
    assert run_cli(argv, capsys)[0] == 0
    before = (tmp_path / "o_text_document.bin").read_bytes()
    write_lines(inp, GOOD[:3])
    rc, cap = run_cli(argv, capsys)
    assert rc == 2 and "exists (pass --overwrite" in cap.err
    assert (tmp_path / "o_text_document.bin").read_bytes() == before
    assert run_cli(argv + ["--overwrite"], capsys)[0] == 0
    assert len((tmp_path / "o_text_document.bin").read_bytes()) < len(before)


def test_user_errors_are_one_line(tmp_path, tok_files, capsys):
    for argv, msg in [
        (["--input", str(tmp_path / "nope.jsonl")], "no such file"),
        (["--input", str(tmp_path), "--tokenizer-type", "BertWordPieceCase"], "directory has no input"),
    ]:
        rc, cap = run_cli(
            argv + ["--output-prefix", str(tmp_path / "x"), *T.tokenizer_argv("sentencepiece", tok_files)][:None],
            capsys,
        )
        assert rc == 2 and msg in cap.err and len(cap.err.strip().splitlines()) == 1
    (tmp_path / "c.jsonl").write_bytes(GOOD[0] + b"\n")
    rc, cap = run_cli(
        [
            "--input",
            str(tmp_path / "c.jsonl"),
            "--output-prefix",
            str(tmp_path / "x"),
            "--tokenizer-type",
            "BertWordPieceCase",
        ],
        capsys,
    )
    assert rc == 2 and "unsupported --tokenizer-type" in cap.err
    rc, cap = run_cli(
        [
            "--input",
            str(tmp_path / "c.jsonl"),
            "--output-prefix",
            str(tmp_path / "x"),
            "--tokenizer-type",
            "SentencePieceTokenizer",
            "--tokenizer-model",
            str(tmp_path / "m"),
        ],
        capsys,
    )
    assert rc == 2 and "SentencePiece model not found" in cap.err


def test_interrupt_leaves_no_complete_looking_output(tmp_path, tok_files, monkeypatch):
    from megatron_lol.data import readers

    inp = tmp_path / "c.jsonl"
    write_lines(inp, GOOD * 50)
    real = readers.iter_tasks

    def interrupted(*a, **k):
        for task in real(*a, **k):
            yield task
            raise KeyboardInterrupt

    monkeypatch.setattr(readers, "BLOCK", 256)
    monkeypatch.setattr(readers, "iter_tasks", interrupted)
    with pytest.raises(KeyboardInterrupt):
        T.run_preprocess(
            ["--input", str(inp), "--output-prefix", str(tmp_path / "o"), *T.tokenizer_argv("sentencepiece", tok_files)]
        )
    assert sorted(os.listdir(tmp_path)) == ["c.jsonl"]


def test_killed_process_leaves_no_idx(tmp_path, tok_files):
    """SIGKILL mid-run: only temporary names exist, never a final .idx."""
    inp = tmp_path / "c.jsonl"
    docs = T.stdlib_documents(3_000_000, 20_000)
    with open(inp, "w") as f:
        for _ in range(4):
            for d in docs:
                f.write(json.dumps({"text": d}) + "\n")
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "megatron_lol",
            "preprocess",
            "--input",
            str(inp),
            "--output-prefix",
            str(tmp_path / "o"),
            "--no-progress",
            "--append-eod",
            *T.tokenizer_argv("sentencepiece", tok_files),
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        deadline = time.time() + 60
        while time.time() < deadline:
            tmp_bins = [n for n in os.listdir(tmp_path) if ".bin.tmp-" in n]
            if tmp_bins and os.path.getsize(tmp_path / tmp_bins[0]) > 0:
                break
            assert proc.poll() is None, "finished before it could be interrupted"
            time.sleep(0.02)
        else:
            pytest.fail("no temporary output appeared")
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    names = os.listdir(tmp_path)
    assert not any(n.endswith((".idx", ".bin")) for n in names), names


def test_parquet_without_the_text_column_stops_every_shard_and_the_dry_run(tmp_path, capsys):
    """FineWeb-schema parquet files, one of them without ``text``: every shard stops before it writes
    anything, also a shard that holds none of that file's rows (the columns are read from every file's
    footer first), and ``--dry-run`` says the same one line; a dry run of good files says what it would
    write and writes nothing (not even the output directory)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    tok = T.write_tiny_tokenizer(tmp_path / "tok")
    good = T.write_fineweb_parquet(["the cat sat on a mat"] * 8, tmp_path / "fw", files=1, row_group_size=2)[0]
    bad = good.parent / "001_00000.parquet"
    pq.write_table(pa.table({"content": ["the cat"]}), bad)
    argv = ["--tokenizer-type", "HuggingFaceTokenizer", "--tokenizer-model", str(tok), "--append-eod"]
    out = tmp_path / "out" / "fineweb"
    rc, cap = run_cli(["--input", str(good), "--output-prefix", str(out), "--dry-run", *argv], capsys)
    assert rc == 0 and cap.out.startswith("preprocess: dry run OK: 1 file(s)"), cap
    assert f"would write {out}_text_document.bin/.idx" in cap.out
    files = str(good.parent / "*.parquet")
    for extra in (["--dry-run"], ["--shard", "0/2"]):  # shard 0 of 2: the good file's row groups only
        rc, cap = run_cli(["--input", files, "--output-prefix", str(out), *extra, *argv], capsys)
        assert rc == 2 and cap.err.count("\n") == 1, cap
        assert f"{bad}: no column 'text' (columns: content)" in cap.err, cap.err
    assert not (tmp_path / "out").exists()
