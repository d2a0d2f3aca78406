"""examples/replication/replicate.py end to end at its smoke size: every study's arms train
(two iterations, a tiny shape), the results, verdict and plot are written. The findings
themselves come from ``--size full`` (docs/replication.md), not from this test."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "examples" / "replication" / "replicate.py"
sys.path.insert(0, str(SCRIPT.parent))

import replicate  # noqa: E402
from suite_support import machine_lock  # noqa: E402

pytestmark = pytest.mark.multiprocess  # the studies run two training processes at once (--jobs 2)


@pytest.fixture(scope="module")
def corpus_ready():
    """The bundled corpus the studies train on (README's prepare step; CI runs it before the tests)."""
    with machine_lock("quickstart-corpus"):  # test_quickstart.py prepares the same folder
        if not (REPO / "data" / "quickstart" / "quickstart_text_document.idx").exists():
            subprocess.run(
                [sys.executable, "-m", "megatron_lol", "prepare-quickstart", "--output-dir", "data/quickstart"],
                cwd=REPO,
                check=True,
                timeout=900,
            )


@pytest.mark.timeout(900)
@pytest.mark.parametrize("study", sorted(replicate.STUDIES))
def test_study_runs_end_to_end_at_smoke_size(study, tmp_path, corpus_ready):
    out = tmp_path / study
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), study, "--size", "smoke", "--out", str(out), "--jobs", "2"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=850,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    report = json.loads((out / "results.json").read_text())
    spec = replicate.STUDIES[study]
    assert report["criterion"] == spec.criterion and report["size"] == "smoke"
    assert set(report["results"]) == {arm.name for arm in spec.arms}
    for runs in report["results"].values():
        for run in runs:
            assert run["iterations"] >= 1 and math.isfinite(run["eval_loss"])
    assert isinstance(report["verdict"]["holds"], bool) and report["verdict"]["checks"]
    assert "criterion" in proc.stdout and (out / f"{study}.png").stat().st_size > 0


def test_arms_share_one_flop_budget_and_differ_in_iterations(capsys):
    """Matched compute: every arm gets the reference arm's FLOPs; the trainer turns them into its
    own iterations, so a dearer arm (dense at full depth from step 0) trains fewer of them."""
    from megatron_lol.cli import main

    study = replicate.STUDIES["lol-vs-dense"]
    budget = replicate.flop_budget(study, smoke=False, config=replicate.BASE_CONFIG)
    iterations = {}
    for arm in study.arms:
        sets = replicate.argv_sets({**arm.sets, "training.train_flops": budget, "training.train_iters": "null"})
        assert main(["params", "--config", str(replicate.BASE_CONFIG), *sets, "--json"]) == 0
        training = json.loads(capsys.readouterr().out)["training"]
        iterations[arm.name] = training["train_iters"]
        assert abs(training["training_flops"] - budget) / budget < 0.01, (arm.name, training)
    assert iterations["lol"] == study.full_iters and iterations["dense"] < iterations["lol"]
