"""A HuggingFace Hub name as ``data.tokenizer_model`` (the FineWeb configs' ``EleutherAI/gpt-neox-20b``):
read from the local Hub cache without network, told apart from a missing local path, recorded in a
checkpoint as the cached ``tokenizer.json`` it was read from, and a one-line error when the Hub cannot
provide it. The Hub cache is a temporary one holding a small trained tokenizer under that name, and the
checks run in a fresh process so that huggingface_hub reads ``HF_HUB_CACHE`` / ``HF_HUB_OFFLINE``."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from corpus_fixtures import hub_cache, train_bytelevel_bpe

REPO = Path(__file__).resolve().parents[1]
NAME = "EleutherAI/gpt-neox-20b"

CHECK = r"""
import json, os, sys
from types import SimpleNamespace
from megatron_lol.config import config_from_dict
from megatron_lol.data.tokenizers import TokenizerError, build_tokenizer, is_hub_name
from megatron_lol.training.checkpointing.state import _recorded_tokenizer_model

name, snapshot = sys.argv[1], sys.argv[2]
tok = build_tokenizer("HuggingFaceTokenizer", name)
out = {"vocab": tok.vocab_size, "eod": tok.eod, "file": tok.files[0], "ids": tok.tokenize("the cat sat")}
data = config_from_dict({"data": {"paths": ["x"], "tokenizer_type": "HuggingFaceTokenizer",
                                  "tokenizer_model": name}}).data
out["on_hub"] = data.tokenizer_on_hub()
out["recorded"] = _recorded_tokenizer_model(data, tok)
out["local_missing_is_hub"] = is_hub_name("data/missing/tokenizer.json")
sentencepiece = config_from_dict({"data": {"paths": ["x"], "tokenizer_model": name}}).data
out["sentencepiece_on_hub"] = sentencepiece.tokenizer_on_hub()
try:
    build_tokenizer("HuggingFaceTokenizer", "nobody/no-such-tokenizer")
except TokenizerError as err:
    out["error"] = str(err)
print("RESULT " + json.dumps(out))
"""


def test_hub_name_from_the_local_cache(tmp_path):
    files = train_bytelevel_bpe(
        ["the cat sat on the mat"] * 40 + ["a quick brown fox"] * 40, str(tmp_path / "bpe"), vocab_size=300
    )
    snapshot = hub_cache(
        tmp_path / "hub",
        NAME,
        files["tokenizer_json"],
        {"tokenizer_config.json": json.dumps({"eos_token": "<|endoftext|>"})},
    )
    env = dict(os.environ, HF_HUB_CACHE=str(tmp_path / "hub"), HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1")
    proc = subprocess.run(
        [sys.executable, "-c", CHECK, NAME, str(snapshot)],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
        cwd=str(tmp_path),
    )
    lines = [l for l in proc.stdout.splitlines() if l.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, proc.stderr[-2000:]
    out = json.loads(lines[-1][len("RESULT ") :])
    from megatron_lol.data.tokenizers import build_tokenizer

    local = build_tokenizer("HuggingFaceTokenizer", files["tokenizer_json"])
    assert out["vocab"] == local.vocab_size and out["eod"] == local.eod == local.tok.token_to_id("<|endoftext|>")
    assert out["ids"] == local.tokenize("the cat sat")
    assert Path(out["file"]) == snapshot / "tokenizer.json" and out["recorded"] == out["file"]
    assert out["on_hub"] and not out["local_missing_is_hub"] and not out["sentencepiece_on_hub"]
    error = out["error"]
    assert "\n" not in error and error.startswith("HuggingFace tokenizer nobody/no-such-tokenizer: not a local")
    assert "hf download nobody/no-such-tokenizer tokenizer.json" in error
