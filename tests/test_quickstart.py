"""The README quickstart end to end: bundled corpus, real tokenizer, tiny LoL model on CPU.

Runs the README's main job as written but for its length: 50 of its 800 steps
(``--train-iters 50``; the 800-step figures are README's measured ones). Asserts
what the bundled default must show: validation loss falls at least 1.5 nats below the
first evaluation (9.03 -> about 6.4 after 50 steps) and the growing depth reaches the
full core. (Its wall time is reported, not asserted: speed belongs to benchmarks.)
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest
from suite_support import machine_lock

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.slow
def test_quickstart_validation_loss_falls(tmp_path):
    data = os.path.join(REPO, "data", "quickstart")
    run = tmp_path / "run"
    t0 = time.time()
    with machine_lock("quickstart-corpus"):  # test_replication.py prepares the same folder
        subprocess.run(
            [sys.executable, "-m", "megatron_lol", "prepare-quickstart", "--output-dir", data],
            check=True,
            cwd=REPO,
            timeout=600,
        )
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "megatron_lol",
            "train",
            "--config",
            "examples/configs/tiny-cpu.yaml",
            "--save",
            str(run),
            "--train-iters",
            "50",
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=1800,
    )
    elapsed = time.time() - t0
    assert proc.returncode == 0, proc.stderr[-3000:]
    records = [json.loads(line) for line in open(run / "metrics.jsonl")]
    evals = [r["eval_loss"] for r in records if "eval_loss" in r]
    print(f"quickstart: {elapsed:.0f} s, eval losses {[round(e, 3) for e in evals]}")
    assert len(evals) >= 2
    assert evals[-1] <= evals[0] - 1.5, evals
    for key in ("step", "loss", "lr", "grad_norm", "tokens_per_s", "depth", "block_utilisation"):
        assert key in records[-1]
    assert records[-1]["depth"] == 4 and records[0]["depth"] < 4  # growing depth reached the full core
