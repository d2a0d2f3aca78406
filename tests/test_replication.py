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


class _ForkedSubprocess:
    """What replicate.py uses of :mod:`subprocess`, its python commands forked by
    :func:`cli_processes.forked_run` (each arm's ``megatron-lol train``, the FLOP budget's
    ``megatron-lol params``, a study's evaluation script), so that a study's runs skip the ~6 s of
    imports a new interpreter pays; the script's own command line is parsed by its ``main``."""

    STDOUT = subprocess.STDOUT
    PIPE = subprocess.PIPE

    @staticmethod
    def run(cmd, **kw):
        from cli_processes import forked_run

        return forked_run(list(map(str, cmd)), **kw)


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
def test_study_runs_end_to_end_at_smoke_size(study, tmp_path, corpus_ready, monkeypatch, capsys):
    out = tmp_path / study
    monkeypatch.setattr(replicate, "subprocess", _ForkedSubprocess)
    try:
        status = replicate.main([study, "--size", "smoke", "--out", str(out), "--jobs", "2"])
    except SystemExit as stop:  # a failed arm: the script's one-line reason, and its log beside it
        logs = "\n".join(p.read_text(errors="replace")[-1500:] for p in sorted(out.glob("*.log")))
        raise AssertionError(f"{stop.code}\n{logs}") from None
    stdout = capsys.readouterr().out
    assert status == 0, stdout[-2000:]
    report = json.loads((out / "results.json").read_text())
    spec = replicate.STUDIES[study]
    assert report["criterion"] == spec.criterion and report["size"] == "smoke"
    assert set(report["results"]) == {arm.name for arm in spec.arms}
    for runs in report["results"].values():
        for run in runs:
            assert run["iterations"] >= 1 and math.isfinite(run["eval_loss"])
    assert isinstance(report["verdict"]["holds"], bool) and report["verdict"]["checks"]
    assert "criterion" in stdout and (out / f"{study}.png").stat().st_size > 0


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
