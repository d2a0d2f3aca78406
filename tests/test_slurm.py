"""The sbatch scripts on a real (local, two-node) Slurm cluster.

Starts ``../shared/tools/local-slurm`` (root only), then runs the whole pipeline
of ``slurm/submit_pipeline.sh`` on a tiny config -- preprocess as a job array
over 2 shards, merge, pretrain on 2 nodes x 1 process (torchrun, gloo, growing
depth), context extension (one task per process) from the pretraining
checkpoint -- and, next to it, a pretraining job that receives its preemption
signal (SIGUSR1 to the job steps, as ``--signal=USR1@T`` sends it), saves,
requeues itself, resumes and must end with exactly the pipeline's losses.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
LOCAL_SLURM = REPO.parent / "shared" / "tools" / "local-slurm"
PRETRAIN_ITERS = 16
CONTEXT_ITERS = 6
TIMEOUT = 420

pytestmark = pytest.mark.slow


def _sh(*cmd, env=None, timeout=120, check=True) -> str:
    res = subprocess.run(list(map(str, cmd)), cwd=str(REPO), env=env, capture_output=True, text=True,
                         timeout=timeout)
    if check and res.returncode:
        raise AssertionError(f"{cmd} failed ({res.returncode}):\n{res.stdout}\n{res.stderr}")
    return res.stdout


@pytest.fixture(scope="module")
def cluster():
    if os.geteuid() != 0:
        pytest.skip("local-slurm needs root")
    if not (LOCAL_SLURM / "start.sh").exists():
        pytest.skip(f"{LOCAL_SLURM} not present")
    _sh("bash", LOCAL_SLURM / "start.sh", timeout=600)
    return LOCAL_SLURM


def _metrics(save: Path) -> dict:
    out = {}
    path = save / "metrics.jsonl"
    if path.exists():
        for line in path.read_text().splitlines():
            try:
                rec = json.loads(line)
            except json.JSONDecodeError:
                continue
            out[rec["step"]] = rec
    return out


def _logs(work: Path) -> str:
    text = []
    for f in sorted((work / "logs").glob("*")):
        body = "\n".join(l for l in f.read_text(errors="replace").splitlines() if "warn" not in l.lower())
        text.append(f"==== {f.name}\n{body[-4000:]}")
    return "\n".join(text)


def _job_state(job: str) -> str:
    out = _sh("scontrol", "-o", "show", "job", job, check=False)
    for part in out.split():
        if part.startswith("JobState="):
            return part.split("=", 1)[1]
    return "?"


def test_pipeline_and_preemption_requeue(cluster, tmp_path):
    from corpus_fixtures import stdlib_documents, train_sentencepiece

    work = tmp_path / "work"
    raw = tmp_path / "raw"
    raw.mkdir()
    docs = stdlib_documents(max_bytes=300_000, max_doc=8000)
    tokenizer = train_sentencepiece(docs, str(raw / "sp"), vocab_size=512)
    for i in range(2):
        with open(raw / f"part{i}.jsonl", "w") as f:
            for d in docs[i::2]:
                f.write(json.dumps({"text": d}) + "\n")

    env = dict(os.environ)
    env.update(MEGATRON_LOL_PYTHON=sys.executable, PYTHONWARNINGS="ignore", OMP_NUM_THREADS="1",
               GPUS_PER_NODE="0", TOKENIZER_MODEL=tokenizer)
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(k, None)
    pipe_env = dict(env, INPUT=str(raw / "*.jsonl"), NUM_SHARDS="2", PREPROCESS_CPUS="1", WORK_DIR=str(work),
                    NODES="2", CONTEXT_LAUNCHER="srun")
    t0 = time.time()
    print(_sh("bash", "slurm/submit_pipeline.sh", env=pipe_env))
    jobs = dict(line.split("=", 1) for line in (work / "jobs.env").read_text().split())

    # the preemption drill: the same pretraining, next to the pipeline's
    preempt = work / "preempt"
    preempt_job = _sh(
        "sbatch", "--parsable", f"--chdir={REPO}", "--nodes=2", "--ntasks-per-node=1",
        f"--dependency=afterok:{jobs['MERGE_JOB']}", f"--output={work}/logs/preempt-%j.out",
        "slurm/pretrain.sbatch",
        env=dict(env, SAVE_DIR=str(preempt), DATA_PREFIX=jobs["DATA_PREFIX"], MEGATRON_LOL_ROOT=str(REPO)),
    ).strip().split(";")[0]
    signalled_at = None
    while time.time() - t0 < TIMEOUT:
        done = max(_metrics(preempt), default=0)
        if done >= 3:
            assert done < PRETRAIN_ITERS, "the drill finished before it could be signalled"
            _sh("scancel", "--signal=USR1", preempt_job)  # to the job steps, as --signal=USR1@T does
            signalled_at = done
            break
        if _job_state(preempt_job) in ("FAILED", "CANCELLED", "COMPLETED", "TIMEOUT"):
            break
        time.sleep(0.2)
    assert signalled_at is not None, _logs(work)

    res = subprocess.run(["bash", str(cluster / "wait.sh"), jobs["MERGE_JOB"], jobs["PRETRAIN_JOB"],
                          jobs["CONTEXT_JOB"], preempt_job], cwd=str(REPO), capture_output=True, text=True,
                         env=dict(env, SLURM_WAIT_TIMEOUT=str(TIMEOUT)), timeout=TIMEOUT + 60)
    print(res.stdout, f"pipeline + drill: {time.time() - t0:.0f} s")
    assert res.returncode == 0, res.stdout + res.stderr + _logs(work)

    # preprocess array + merge
    data = Path(jobs["DATA_PREFIX"])
    assert data.with_suffix(".bin").exists() and data.with_suffix(".idx").exists()
    assert len(list(data.parent.glob("*.shard-0000?-of-00002.idx"))) == 2
    # pretrain: 2 nodes x 1 process, growing depth, checkpoints
    pre = _metrics(work / "pretrain")
    assert sorted(pre) == list(range(1, PRETRAIN_ITERS + 1))
    assert pre[1]["depth"] == 1 and pre[PRETRAIN_ITERS]["depth"] == 3
    assert (work / "pretrain" / "latest_checkpointed_iteration.txt").read_text().strip() == str(PRETRAIN_ITERS)
    logs = _logs(work)
    assert "data parallel 2" in logs
    # context extension read the pretraining checkpoint: longer sequences, new RoPE base
    from megatron_lol.training.checkpointing import read_run_config

    ctx = work / "context_ext"
    assert (ctx / "latest_checkpointed_iteration.txt").read_text().strip() == str(CONTEXT_ITERS)
    cfg, info = read_run_config(str(ctx / f"iter_{CONTEXT_ITERS:07d}"))
    assert cfg.training.seq_length == 128 and cfg.model.rotary_base == 40000
    ctx_log = next((work / "logs").glob("lol-context-ext-*.out")).read_text()
    assert f"loaded {work}/pretrain/iter_{PRETRAIN_ITERS:07d}" in ctx_log
    assert "launch: srun" in ctx_log
    ctx_metrics = _metrics(ctx)
    assert ctx_metrics[1]["loss"] < pre[1]["loss"] - 0.2  # starts from trained weights
    # the drill: signalled, saved, requeued by Slurm, resumed, same losses as uninterrupted
    drill_log = next((work / "logs").glob(f"preempt-{preempt_job}.out")).read_text()
    assert "received SIGUSR1" in drill_log and "requeueing job" in drill_log, drill_log[-5000:]
    assert f"restart 1" in drill_log
    got = _metrics(preempt)
    assert sorted(got) == list(range(1, PRETRAIN_ITERS + 1))
    for s in range(1, PRETRAIN_ITERS + 1):
        assert got[s]["loss"] == pre[s]["loss"], (s, got[s], pre[s])
    assert not (preempt / "REQUEUE_REQUESTED").exists()
