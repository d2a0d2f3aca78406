"""The sbatch scripts on a real (local, two-node) Slurm cluster, used as on a production cluster.

Starts ``../shared/tools/local-slurm``, the local two-node Slurm tool that CI provides
next to the repository (root only), and switches off its
``DependencyParameters=kill_invalid_depend`` (Slurm's default is off), then runs
one campaign of concurrent jobs on tiny configs, all submitted from a run
directory outside the repository with the scripts' absolute paths and with a
stray ``MASTER_ADDR`` / ``MASTER_PORT`` / ``RANK`` / ``WORLD_SIZE`` /
``LOCAL_RANK`` in the submitting environment:

* the whole pipeline of ``slurm/submit_pipeline.sh`` as the FineWeb recipe runs it: two parquet
  files in FineWeb's ``sample-10BT`` layout and schema as INPUT, the tokenizer by Hub name
  (``EleutherAI/gpt-neox-20b``, a small tokenizer in a prepared Hub cache; the Hub itself
  unreachable), resolved on the submitting host, every job offline (``HF_HUB_OFFLINE=1``, set
  by the script); preprocess as a job array over 2 shards, merge, pretrain on 2 nodes x 1
  process (torchrun, gloo, growing depth), context extension (one task per process) from the
  pretraining checkpoint;
* two pretraining drills preempted by SIGUSR1 -- to the job steps while the
  trainer is still starting (under torchrun, whose workers start with SIGUSR1
  ignored: the launcher's stop request is read after the first step, as it is
  mid-run; ``test_checkpointing.py`` signals a run mid-run), and to the batch shell
  by its time limit (``--signal=B:USR1@T``, one task per process; ``scancel
  --batch -s USR1`` signals the same shell, whose trap is what is checked) --
  each must save, requeue, resume and end with exactly the pipeline's losses;
* failures: a config typo in a save directory holding an earlier job's
  ``REQUEUE_REQUESTED`` (must fail with status 2 and its one-line error, no
  requeue), a preprocess that fails (its dependents must be cancelled, not left pending),
  ``submit_pipeline.sh`` with a typo, without a tokenizer or with a parquet file
  without ``text`` (one line, status 2, nothing submitted) and held submissions
  that show the CPUs each launch style asks for;
* ``profile.sbatch`` on 2 nodes that share one hostname: a JSON report with a
  row per node.

The campaign runs once (module fixture); each test checks one behaviour. Its time is
python start-up (about 9 CPU seconds per training process, against 0.13 per tiny step), on
a machine of 2 cores: the pipeline is submitted first and the submission checks run while
its jobs do, the drills skip the per-job layout check that the pipeline's job makes, and
nothing is launched twice that one launch can check. One test
runs its own job outside the campaign: a node's task killed with ``kill -9`` in a
2-node job (a runtime failure under the srun launcher: its status is the job's, no
requeue), the reason recorded by the scripts, and the same submission resuming from
the last complete checkpoint.
"""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from suite_support import machine_lock, scheduling_slack

REPO = Path(__file__).resolve().parents[1]
LOCAL_SLURM = REPO.parent / "shared" / "tools" / "local-slurm"  # provided by CI, outside the repository
SLURM_CONF = Path("/etc/slurm/slurm.conf")
HUB_TOKENIZER = "EleutherAI/gpt-neox-20b"  # the paper configs' tokenizer, by Hub name
EOD = "<|endoftext|>"
PRETRAIN_ITERS = 16
CONTEXT_ITERS = 6
TIMEOUT = 900  # the whole campaign; a hang (a job pending forever) fails here
STRAY_ENV = {"MASTER_ADDR": "10.255.255.1", "MASTER_PORT": "1", "RANK": "3", "WORLD_SIZE": "7", "LOCAL_RANK": "5"}
ACTIVE = {
    "PENDING",
    "RUNNING",
    "CONFIGURING",
    "COMPLETING",
    "REQUEUED",
    "REQUEUE_FED",
    "REQUEUE_HOLD",
    "RESIZING",
    "SUSPENDED",
    "STAGE_OUT",
    "SIGNALING",
    "RESV_DEL_HOLD",
    "SPECIAL_EXIT",
    "STOPPED",
}

pytestmark = [pytest.mark.slow, pytest.mark.multiprocess]  # Slurm jobs use the whole machine


def _run(*cmd, env=None, cwd=REPO, timeout=120):
    return subprocess.run(list(map(str, cmd)), cwd=str(cwd), env=env, capture_output=True, text=True, timeout=timeout)


def _sh(*cmd, env=None, cwd=REPO, timeout=120, check=True) -> str:
    res = _run(*cmd, env=env, cwd=cwd, timeout=timeout)
    if check and res.returncode:
        raise AssertionError(f"{cmd} failed ({res.returncode}):\n{res.stdout}\n{res.stderr}")
    return res.stdout


@pytest.fixture(scope="module")
def cluster():
    """The local cluster, configured like a default Slurm: no kill_invalid_depend."""
    if os.geteuid() != 0:
        pytest.skip("local-slurm needs root")
    if not (LOCAL_SLURM / "start.sh").exists():
        pytest.skip(f"{LOCAL_SLURM} not present")
    # one suite at a time on the machine's one cluster: the campaign reads every job the controller knows
    # and rewrites slurm.conf (a second suite run beside this one, as the loaded-machine check does, waits)
    with machine_lock("local-slurm"):
        # 8 CPUs per node declared: the campaign's jobs run side by side (they mostly wait)
        _sh("bash", LOCAL_SLURM / "start.sh", env=dict(os.environ, LOCAL_SLURM_CPUS="8"), timeout=600)
        original = SLURM_CONF.read_text()
        SLURM_CONF.write_text(
            "".join(line for line in original.splitlines(keepends=True) if not line.startswith("DependencyParameters="))
        )
        try:
            _sh("scontrol", "reconfigure")
            assert "kill_invalid_depend" not in _sh("scontrol", "show", "config")
            yield LOCAL_SLURM
        finally:
            SLURM_CONF.write_text(original)
            _sh("scontrol", "reconfigure", check=False)


# ------------------------------------------------------------------ helpers
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


def _read(path: Path) -> str:
    return path.read_text(errors="replace") if path.exists() else ""


def _field(line: str, key: str) -> str:
    m = re.search(rf"(?:^| ){key}=(\S*)", line)
    return m.group(1) if m else ""


def _all_jobs() -> dict:
    """JobId -> the one-line ``scontrol show job`` record, for every job the controller knows."""
    out = _sh("scontrol", "-o", "show", "job", check=False)
    return {_field(line, "JobId"): line for line in out.splitlines() if "JobId=" in line}


def _jobs_since(before: set) -> set:
    """Jobs the controller knows now and did not know in ``before``, leaving out the tasks of a job
    array known before: a running array task gets a JobId of its own (``ArrayJobId`` names the array)."""
    return {j for j, line in _all_jobs().items() if j not in before and _field(line, "ArrayJobId") not in before}


class Campaign:
    def __init__(self, root: Path):
        self.root = root
        self.run_dir = root / "run"  # submissions happen here, outside the repository
        self.logs = self.run_dir / "logs"
        self.logs.mkdir(parents=True)
        self.jobs: dict = {}  # name -> job id
        self.final: dict = {}  # name -> scontrol line at the end
        self.done: dict = {}  # one-shot actions taken -> what they saw
        self.submit_checks: dict = {}

    def log(self, name: str, logs: Path = None) -> str:
        return "\n".join(_read(p) for p in sorted((logs or self.logs).glob(f"{name}-*.out")))

    def sbatch(self, name: str, script: str, *flags, env: dict, after: str = None) -> str:
        cmd = ["sbatch", "--parsable", f"--output={self.logs}/{name}-%j.out", *flags]
        if after:
            cmd += [f"--dependency=afterok:{after}", "--kill-on-invalid-dep=yes"]
        job = _sh(*cmd, REPO / "slurm" / script, env=env, cwd=self.run_dir).strip().split(";")[0]
        self.jobs[name] = job
        return job

    def state(self, name: str) -> str:
        return _field(self.final.get(name, ""), "JobState")

    def report(self) -> str:
        parts = [f"{n}: {self.final.get(n, '(not finished)')[:400]}" for n in self.jobs]
        for f in sorted(self.logs.glob("*.out")) + sorted(self.run_dir.glob("*/logs/*.out")):
            body = "\n".join(l for l in _read(f).splitlines() if "warn" not in l.lower())
            parts.append(f"==== {f.name}\n{body[-3000:]}")
        return "\n".join(parts)


@pytest.fixture(scope="module")
def campaign(cluster, tmp_path_factory):
    from corpus_fixtures import hub_cache, stdlib_documents, train_bytelevel_bpe, write_fineweb_parquet

    root = tmp_path_factory.mktemp("slurm")
    c = Campaign(root)
    raw = root / "raw"
    raw.mkdir()
    docs = stdlib_documents(max_bytes=300_000, max_doc=8000)
    c.docs = docs
    # the corpus: FineWeb's sample-10BT layout and schema; the tokenizer: a Hub name (the paper configs'),
    # served from a prepared Hub cache, the Hub itself unreachable (HF_ENDPOINT: a closed port)
    write_fineweb_parquet(docs, raw / "fineweb", files=2)
    bpe = train_bytelevel_bpe(docs, str(raw / "bpe"), vocab_size=512)
    c.hub = root / "hub"
    c.snapshot = hub_cache(
        c.hub, HUB_TOKENIZER, bpe["tokenizer_json"], {"tokenizer_config.json": json.dumps({"eos_token": EOD})}
    )
    (raw / "broken.jsonl").write_text("this is not json\n")
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"content": ["a document under another column"]}), raw / "no_text.parquet")

    env = {k: v for k, v in os.environ.items() if k != "MEGATRON_LOL_ROOT" and not k.startswith("HF_")}
    env.update(STRAY_ENV)
    env.update(
        MEGATRON_LOL_PYTHON=sys.executable,
        PYTHONWARNINGS="ignore",
        OMP_NUM_THREADS="1",
        GPUS_PER_NODE="0",
        TOKENIZER_TYPE="HuggingFaceTokenizer",
        TOKENIZER_MODEL=HUB_TOKENIZER,
        HF_HUB_CACHE=str(c.hub),
        HF_ENDPOINT="http://127.0.0.1:9",  # no Hub: the submitting host finds the tokenizer in its cache
    )
    pipe_env = dict(
        env,
        INPUT=str(raw / "fineweb" / "sample" / "10BT" / "*.parquet"),
        NUM_SHARDS="2",
        PREPROCESS_CPUS="1",
        NODES="2",
        CONTEXT_LAUNCHER="srun",
    )
    submit = str(REPO / "slurm" / "submit_pipeline.sh")
    t0 = time.time()
    try:
        # the pipeline first (its jobs start while the checks below run), with a relative WORK_DIR (relative to
        # the run directory); HF_HUB_OFFLINE is not set here: the script sets it for every job
        out = _sh("bash", submit, env=dict(pipe_env, WORK_DIR="work", CPUS_PER_NODE="2"), cwd=c.run_dir)
        print(out)
        c.submit_checks["pipeline"] = out
        ids = dict(line.split("=", 1) for line in (c.run_dir / "work" / "jobs.env").read_text().split())
        c.jobs.update(
            preprocess=ids["PREPROCESS_JOB"],
            merge=ids["MERGE_JOB"],
            pretrain=ids["PRETRAIN_JOB"],
            context=ids["CONTEXT_JOB"],
        )
        c.data_prefix = ids["DATA_PREFIX"]
        # the drills submitted outside the pipeline run offline as its jobs do
        _submit_drills(c, dict(env, HF_HUB_OFFLINE="1"))
        # a pipeline whose preprocess fails, on a cluster without kill_invalid_depend (its configs are the
        # pipeline's, validated above: VALIDATE=0 saves the second validation)
        _sh(
            "bash",
            submit,
            env=dict(pipe_env, INPUT=str(raw / "broken.jsonl"), NUM_SHARDS="1", WORK_DIR="broken", VALIDATE="0"),
            cwd=c.run_dir,
        )
        ids = dict(line.split("=", 1) for line in (c.run_dir / "broken" / "jobs.env").read_text().split())
        c.jobs.update(
            broken_pre=ids["PREPROCESS_JOB"],
            broken_merge=ids["MERGE_JOB"],
            broken_pretrain=ids["PRETRAIN_JOB"],
            broken_context=ids["CONTEXT_JOB"],
        )
        _submission_checks(c, submit, pipe_env, raw)
        _drive(c, t0)
    finally:
        left = [j for n, j in c.jobs.items() if n not in c.final]
        if left:
            _sh("scancel", *left, check=False)
    print(f"slurm campaign: {time.time() - t0:.0f} s")
    for name, line in c.final.items():  # where the time goes (the last launch of a requeued job)
        print(f"  {name}: {_field(line, 'SubmitTime')} start {_field(line, 'StartTime')} end {_field(line, 'EndTime')}")
    return c


def _submission_checks(c: Campaign, submit: str, pipe_env: dict, raw: Path) -> None:
    """submit_pipeline.sh refusals (nothing submitted) and held submissions (CPUs per launch style)."""
    before = set(_all_jobs())
    res = _run(
        "bash", submit, env=dict(pipe_env, WORK_DIR="typo", PRETRAIN_ARGS="--set training.bogus_key=1"), cwd=c.run_dir
    )
    c.submit_checks["typo"] = (
        res.returncode,
        res.stdout,
        res.stderr,
        _jobs_since(before),
        (c.run_dir / "typo" / "jobs.env").exists(),
    )
    res = _run("bash", submit, env=dict(pipe_env, WORK_DIR="ambiguous", CPUS_PER_TASK="4"), cwd=c.run_dir)
    c.submit_checks["cpus_per_task"] = (res.returncode, res.stderr, _jobs_since(before))
    # no tokenizer given: the config's (tiny-slurm.yaml: a SentencePiece model path nobody made)
    no_tok = {k: v for k, v in pipe_env.items() if k not in ("TOKENIZER_TYPE", "TOKENIZER_MODEL")}
    res = _run("bash", submit, env=dict(no_tok, WORK_DIR="no_tokenizer"), cwd=c.run_dir)
    c.submit_checks["no_tokenizer"] = (
        res.returncode,
        res.stderr,
        _jobs_since(before),
        (c.run_dir / "no_tokenizer").exists(),
    )
    res = _run(
        "bash", submit, env=dict(pipe_env, INPUT=str(raw / "no_text.parquet"), WORK_DIR="no_text"), cwd=c.run_dir
    )
    c.submit_checks["no_text"] = (
        res.returncode,
        res.stderr,
        _jobs_since(before),
        (c.run_dir / "no_text").exists(),
    )
    held_env = dict(
        pipe_env,
        WORK_DIR="held",
        SBATCH_EXTRA="--hold",
        PROCS_PER_NODE="2",
        CPUS_PER_NODE="4",
        PRETRAIN_ARGS="--global-batch-size 8",
        CONTEXT_ARGS="--global-batch-size 4",
        VALIDATE="0",  # what is checked here is what sbatch is asked for
    )
    _sh("bash", submit, env=held_env, cwd=c.run_dir)
    ids = dict(line.split("=", 1) for line in (c.run_dir / "held" / "jobs.env").read_text().split())
    jobs = _all_jobs()
    c.submit_checks["held"] = {k: jobs.get(ids[k], "") for k in ("PRETRAIN_JOB", "CONTEXT_JOB")}
    _sh("scancel", *[ids[k] for k in ("PREPROCESS_JOB", "MERGE_JOB", "PRETRAIN_JOB", "CONTEXT_JOB")])


def _fault_entry(fault: str) -> str:
    """The scripts' ``MEGATRON_LOL_ENTRY`` that runs the train verb with ``fault`` injected."""
    return f"{REPO / 'tests' / 'fault_rank_runner.py'} {fault} --"


def _submit_drills(c: Campaign, env: dict) -> None:
    run = c.run_dir
    (run / "stale").mkdir()
    (run / "stale" / "REQUEUE_REQUESTED").write_text("12 received SIGUSR1 job=4242\n")
    two = ["--nodes=2", "--ntasks-per-node=1"]
    # the drills run the pipeline's config on the pipeline's allocation: its pretraining job checks the layout
    # (test_pipeline_finishes_from_another_directory), theirs would only start one more python each
    env = dict(env, CHECK_LAYOUT="0")
    data = dict(env, DATA_PREFIX=c.data_prefix)
    # relative SAVE_DIRs: relative to the run directory the jobs are submitted from
    c.sbatch("stale", "pretrain.sbatch", *two, env=dict(env, SAVE_DIR="stale", TRAIN_ARGS="--set training.bogus_key=1"))
    merge = c.jobs["merge"]
    # the batch-shell drill does not depend on the launch style: one task per process (no torchrun) is cheaper
    # SIGUSR1 to the batch shell 170 s before a 3-minute limit: Slurm sends it up to 30 s early,
    # at its first periodic check, 0-30 s into the run; the save of iteration 4 pauses 30 s,
    # so the run is certainly still going when it arrives
    c.sbatch(
        "time_limit",
        "pretrain.sbatch",
        *two,
        "--time=3",
        "--signal=B:USR1@170",
        env=dict(data, SAVE_DIR="time_limit", LAUNCHER="srun", MEGATRON_LOL_ENTRY=_fault_entry("pause=4:30")),
        after=merge,
    )
    c.sbatch("startup", "pretrain.sbatch", *two, env=dict(data, SAVE_DIR="startup"), after=merge)
    # submitted last (the jobs waiting for the merge fit the 8 CPUs per node the cluster declares). The
    # report's rows are what is checked: no untimed counting / routing steps after the timed ones
    profile_env = {k: v for k, v in data.items() if k != "OMP_NUM_THREADS"}
    c.sbatch(
        "profile",
        "profile.sbatch",
        *two,
        "--cpus-per-task=2",
        env=dict(profile_env, LAUNCHER="srun", PROFILE_ARGS="--steps 2 --warmup 1 --count-steps 0 --routing-steps 0"),
        after=merge,
    )


def _drive(c: Campaign, t0: float) -> None:
    """Poll the jobs; send the drills' signals at their moments; record every job's final state."""
    run = c.run_dir
    step_seen = None
    while time.time() - t0 < TIMEOUT:
        jobs = _all_jobs()
        for name, job in c.jobs.items():
            line = jobs.get(job)
            if name not in c.final and line and _field(line, "JobState") not in ACTIVE:
                c.final[name] = line
        if all(n in c.final for n in c.jobs):
            return
        if "time_limit" not in c.done and "requeueing job" in c.log("time_limit"):
            # the restarted run gets a longer limit, else its warning would stop it again
            _sh("scontrol", "update", f"JobId={c.jobs['time_limit']}", "TimeLimit=30")
            c.done["time_limit"] = True
        if "startup" not in c.done:
            job = c.jobs["startup"]
            steps = _sh("squeue", "-h", "-s", "-j", job, "-o", "%i", check=False).split()
            if f"{job}.0" in steps and step_seen is None:
                step_seen = time.time()
            if step_seen is not None and time.time() - step_seen >= 1.0:
                # the tasks are up (their launcher traps SIGUSR1); the trainer is still importing
                log = c.log("startup")
                c.done["startup"] = {"training_started": "training:" in log or bool(_metrics(run / "startup"))}
                _sh("scancel", "--signal=USR1", job)
        # quick polls while a drill waits for its moment; then every second (each poll is a scontrol call)
        time.sleep(0.3 if any(k not in c.done for k in ("time_limit", "startup")) else 1.0)
    raise AssertionError(f"campaign not finished after {TIMEOUT} s\n" + c.report())


def _assert_resumed_like_pipeline(c: Campaign, name: str) -> dict:
    assert c.state(name) == "COMPLETED" and _field(c.final[name], "ExitCode") == "0:0", c.report()
    assert _field(c.final[name], "Restarts") == "1", c.final[name]
    log = c.log(name)
    assert "requeueing job" in log and "restart 1" in log, log[-5000:]
    pre, got = _metrics(c.run_dir / "work" / "pretrain"), _metrics(c.run_dir / name)
    assert sorted(got) == list(range(1, PRETRAIN_ITERS + 1))
    for s in range(1, PRETRAIN_ITERS + 1):
        assert got[s]["loss"] == pre[s]["loss"], (name, s, got[s], pre[s])
    save = c.run_dir / name
    assert not (save / "REQUEUE_REQUESTED").exists()
    assert not list(save.glob(".slurm-job-*"))  # the per-launch stop/status files are cleaned up
    return {"log": log}


# ------------------------------------------------------------------ tests
def test_pipeline_finishes_from_another_directory(campaign):
    c = campaign
    work = c.run_dir / "work"
    for name in ("merge", "pretrain", "context"):
        assert c.state(name) == "COMPLETED", c.report()
    data = Path(c.data_prefix)
    assert data.with_suffix(".bin").exists() and data.with_suffix(".idx").exists()
    assert len(list(data.parent.glob("*.shard-0000?-of-00002.idx"))) == 2
    pre = _metrics(work / "pretrain")
    assert sorted(pre) == list(range(1, PRETRAIN_ITERS + 1))
    assert pre[1]["depth"] == 1 and pre[PRETRAIN_ITERS]["depth"] == 3
    assert (work / "pretrain" / "latest_checkpointed_iteration.txt").read_text().strip() == str(PRETRAIN_ITERS)
    pre_log = c.log("lol-pretrain", work / "logs")
    assert "data parallel 2" in pre_log and "threads: 1 per process (OMP_NUM_THREADS)" in pre_log
    assert "layout OK at 2 x 1 = 2 ranks: TP 1 x PP 1 x DP 2" in pre_log, pre_log[-3000:]
    assert "CPUs/Task=2" in c.final["pretrain"]  # CPUS_PER_NODE=2, one torchrun task per node
    from megatron_lol.training.checkpointing import read_run_config

    ctx = work / "context_ext"
    assert (ctx / "latest_checkpointed_iteration.txt").read_text().strip() == str(CONTEXT_ITERS)
    cfg, _ = read_run_config(str(ctx / f"iter_{CONTEXT_ITERS:07d}"))
    assert cfg.training.seq_length == 128 and cfg.model.rotary_base == 40000
    ctx_log = c.log("lol-context-ext", work / "logs")
    assert f"loaded {work}/pretrain/iter_{PRETRAIN_ITERS:07d}" in ctx_log and "launch: srun" in ctx_log
    assert _metrics(ctx)[1]["loss"] < pre[1]["loss"] - 0.2  # starts from trained weights


def test_fineweb_parquet_shards_are_tokenized_by_the_array_with_the_hub_tokenizer(campaign):
    """The pipeline's INPUT is FineWeb's sample-10BT layout (two parquet files, FineWeb's columns): each task
    of the 2-shard array tokenizes its row groups' ``text`` with the tokenizer named by Hub name, the merge
    joins them, and the training stages read the result (test_pipeline_finishes_from_another_directory)."""
    import numpy as np

    from megatron_lol.data.indexed import sequence_lengths, validate_dataset
    from megatron_lol.data.tokenizers import build_tokenizer

    c = campaign
    work = c.run_dir / "work"
    shards = [_read(work / "logs" / f"lol-preprocess-{c.jobs['preprocess']}_{i}.out") for i in range(2)]
    for i, log in enumerate(shards):
        assert f"preprocess shard {i}/2 of " in log and "10BT/*.parquet" in log, log[-3000:]
        assert re.search(r"preprocess: [1-9][\d,]* documents", log), log[-3000:]  # each shard has rows
    tok = build_tokenizer("HuggingFaceTokenizer", str(c.snapshot / "tokenizer.json"))
    index = validate_dataset(c.data_prefix)  # the .idx against the .bin, as training checks it
    ends = np.cumsum(sequence_lengths(index))
    tokens = np.fromfile(c.data_prefix + ".bin", dtype=index.dtype)
    assert len(ends) == len(c.docs) and ends[-1] == len(tokens)
    for i in (0, len(c.docs) // 2, len(c.docs) - 1):  # the first, a second-file and the last document
        start = ends[i - 1] if i else 0
        assert tokens[start : ends[i]].tolist() == tok.tokenize(c.docs[i]) + [tok.eod], i
    pre_log = c.log("lol-pretrain", work / "logs")
    assert f"--tokenizer-type HuggingFaceTokenizer --tokenizer-model {HUB_TOKENIZER}" in pre_log, pre_log[-3000:]


def test_hub_tokenizer_is_resolved_before_queueing_and_every_job_runs_offline(campaign):
    """TOKENIZER_MODEL=<Hub name>: found on the submitting host (in the prepared cache; the Hub is
    unreachable and HF_HUB_OFFLINE unset there), and every job of the pipeline -- each array task, the merge,
    pretraining, context extension -- runs with HF_HUB_OFFLINE=1, set by submit_pipeline.sh."""
    c = campaign
    out = c.submit_checks["pipeline"]
    assert f"tokenizer: {HUB_TOKENIZER} from the Hub cache ({c.snapshot / 'tokenizer.json'})" in out, out
    assert "preprocess stage: preprocess: dry run OK: 2 file(s)" in out, out
    logs = sorted((c.run_dir / "work" / "logs").glob("*.out"))
    assert len(logs) == 5, logs  # 2 array tasks, merge, pretrain, context extension
    for log in logs:
        assert f"HF_HUB_OFFLINE=1: Hub files (tokenizers) are read from the local cache only ({c.hub})" in _read(log), (
            log.name,
            _read(log)[-2000:],
        )
    for name in ("merge", "pretrain", "context"):
        assert c.state(name) == "COMPLETED", c.report()


def test_submit_pipeline_without_a_tokenizer_or_a_text_column_queues_nothing(campaign):
    """No TOKENIZER_MODEL and a config whose tokenizer file does not exist; a parquet INPUT without a `text`
    column: each is one line and status 2 on the submitting host, no job queued, no directory made."""
    rc, err, new_jobs, made = campaign.submit_checks["no_tokenizer"]
    config = REPO / "examples" / "configs" / "tiny-slurm.yaml"
    assert rc == 2 and err.count("\n") == 1 and not new_jobs and not made, (rc, err, new_jobs)
    assert err.startswith(
        f"submit_pipeline.sh: TOKENIZER_MODEL={campaign.run_dir}/runs/pipeline/data/tokenizer.model "
        f"(data.tokenizer_model of {config}) does not exist -- nothing submitted"
    ), err
    rc, err, new_jobs, made = campaign.submit_checks["no_text"]
    assert rc == 2 and err.count("\n") == 1 and not new_jobs and not made, (rc, err, new_jobs)
    assert err.startswith("submit_pipeline.sh: preprocess stage: megatron-lol preprocess: error: ") and (
        "no_text.parquet: no column 'text' (columns: content) -- nothing submitted" in err
    ), err


def test_stray_rendezvous_environment_is_ignored(campaign):
    c = campaign
    log = c.log("startup")  # a torchrun launch (and its relaunch after the requeue)
    for key, value in STRAY_ENV.items():
        assert f"ignoring {key}={value} from the submitting environment" in log, log[-3000:]
    assert "rendezvous node1:" in log
    assert c.state("startup") == "COMPLETED", c.report()


def test_batch_signal_before_time_limit_saves_requeues_and_resumes(campaign):
    """SIGUSR1 to the batch shell (Slurm's --signal=B:USR1@T here, as `scancel --batch -s USR1` sends it):
    the shell's trap passes it on, the trainer saves, the job requeues and resumes bit-identically."""
    out = _assert_resumed_like_pipeline(campaign, "time_limit")
    assert "batch shell received SIGUSR1" in out["log"] and "preemption: received SIGUSR1" in out["log"]
    assert campaign.done.get("time_limit") is True


def test_signal_during_startup_is_honoured_after_the_first_step(campaign):
    c = campaign
    assert c.done["startup"] == {"training_started": False}, "the signal went out after training had started"
    out = _assert_resumed_like_pipeline(c, "startup")
    assert "preemption: received SIGUSR1 at iteration 1:" in out["log"], out["log"][-5000:]


def test_stale_marker_never_requeues_and_the_job_carries_the_exit_status(campaign):
    c = campaign
    line, log = c.final["stale"], c.log("stale")
    assert _field(line, "JobState") == "FAILED" and _field(line, "ExitCode") == "2:0", line
    assert _field(line, "Restarts") == "0" and "requeueing" not in log, log[-3000:]
    assert "REQUEUE_REQUESTED left by an earlier run" in log
    assert (
        "training failed with status 2: megatron-lol train: error: --set training.bogus_key=1: "
        "unknown key 'training.bogus_key'" in log
    ), log[-3000:]
    assert "Comment=megatron-lol: status 2: " in line
    assert not (c.run_dir / "stale" / "REQUEUE_REQUESTED").exists()


def test_failed_stage_cancels_its_dependents_without_kill_invalid_depend(campaign):
    c = campaign
    assert c.state("broken_pre") == "FAILED", c.report()
    for name in ("broken_merge", "broken_pretrain", "broken_context"):
        assert c.state(name) == "CANCELLED", (name, c.final.get(name))


def test_submit_pipeline_validates_every_stage_before_submitting(campaign):
    rc, out, err, new_jobs, wrote = campaign.submit_checks["typo"]
    assert rc == 2 and not new_jobs and not wrote, (rc, out, err, new_jobs)
    assert (
        "pretrain stage: megatron-lol train: error: --set training.bogus_key=1: unknown key "
        "'training.bogus_key' -- nothing submitted" in err
    ), err
    rc, err, new_jobs = campaign.submit_checks["cpus_per_task"]
    assert rc == 2 and not new_jobs and "CPUS_PER_TASK=4 is ambiguous" in err, err


def test_launch_styles_ask_for_their_own_cpus(campaign):
    held = campaign.submit_checks["held"]
    # CPUS_PER_NODE=4, 2 processes per node on 2 nodes: torchrun = 1 task x 4 CPUs per node,
    # srun (context extension) = 2 tasks x 2 CPUs per node
    assert "NumTasks=2 " in held["PRETRAIN_JOB"] and "CPUs/Task=4 " in held["PRETRAIN_JOB"], held
    assert "NumTasks=4 " in held["CONTEXT_JOB"] and "CPUs/Task=2 " in held["CONTEXT_JOB"], held


def test_profile_sbatch_writes_a_report_with_a_row_per_node(campaign):
    c = campaign
    assert c.state("profile") == "COMPLETED", c.report()
    report = json.loads((c.run_dir / f"profile-lol-profile-{c.jobs['profile']}.json").read_text())
    nodes = report["nodes"]
    assert [(n["node"], n["host"], n["ranks"]) for n in nodes] == [(0, "node1", [0]), (1, "node2", [1])], nodes
    assert report["device"]["threads"] == 2  # the task's 2 CPUs, one process per task
    assert "node1" in c.log("profile") and "node2" in c.log("profile")


# ------------------------------------------------------------------ one node's task killed (outside the campaign)
def _loaded(seconds: float) -> float:
    """A wait of ``seconds`` on an idle cluster, grown with the machine's load (at most 4x): beside a
    second suite under coverage (load average 40 on 2 cores) the resubmitted job took over 200 s."""
    return min(scheduling_slack(seconds), 4 * seconds)


@pytest.mark.timeout(1800, func_only=True)  # ~45 s on an idle cluster; its waits below grow with the load
@pytest.mark.mostly_waiting  # two tasks, one paused before its commit: 51 % busy while it held both cores
def test_kill9_of_one_nodes_task_ends_the_job_naming_it_and_a_resubmission_resumes_from_the_last_checkpoint(
    cluster, tmp_path
):
    """A 2-node pretrain.sbatch job (one task per process, as the campaign's srun drills) whose task on
    node2 is killed with kill -9 while the save of iteration 4 waits to be committed: the job ends FAILED
    with the trainer's status and is not requeued, the scripts record the reason naming rank 1, its host and
    pid (the job's Comment and log: `sacct` needs slurmdbd, which the local cluster lacks), iteration 2 stays
    the latest checkpoint; the same submission again resumes from iteration 2 and logs the killed run's
    losses bit for bit."""
    import psutil
    from test_checkpointing import make_corpus, tracker, write_config

    prefix, tok = make_corpus(tmp_path / "data")
    config = write_config(tmp_path / "tiny.yaml", prefix, tok, str(tmp_path / "cache"), train_iters=6, save_interval=2)
    save, out = tmp_path / "node_kill", tmp_path / "node_kill.out"
    env = {k: v for k, v in os.environ.items() if k != "MEGATRON_LOL_ROOT"}
    env.update(
        MEGATRON_LOL_PYTHON=sys.executable,
        PYTHONWARNINGS="ignore",
        OMP_NUM_THREADS="1",
        GPUS_PER_NODE="0",
        LAUNCHER="srun",
        CONFIG=str(config),
        SAVE_DIR=str(save),
        MEGATRON_LOL_ENTRY=_fault_entry("pause=4:8"),
        TRAIN_ARGS="--heartbeat-interval 1",
    )
    sbatch = ["sbatch", "--parsable", f"--output={out}", "--nodes=2", "--ntasks-per-node=1"]
    job = _sh(*sbatch, REPO / "slurm" / "pretrain.sbatch", env=env, cwd=tmp_path).strip().split(";")[0]
    jobs = [job]
    t0 = time.time()
    try:
        while "pausing 8.0 s before committing" not in _read(out):
            line = _all_jobs().get(job, "")
            assert time.time() - t0 < _loaded(120) and _field(line, "JobState") in ACTIVE, line + _read(out)[-3000:]
            time.sleep(0.2)
        victims = [
            p
            for p in psutil.process_iter(["cmdline"])
            if "fault_rank_runner.py" in " ".join(p.info["cmdline"] or [])
            and p.environ().get("SLURM_JOB_ID") == job
            and p.environ().get("SLURM_PROCID") == "1"
        ]
        assert len(victims) == 1 and victims[0].environ().get("SLURMD_NODENAME") == "node2", victims
        victim = victims[0].pid
        victims[0].kill()
        t_kill = time.time()
        while _field(_all_jobs().get(job, ""), "JobState") in ACTIVE:
            assert time.time() - t_kill < _loaded(60), _all_jobs().get(job, "") + _read(out)[-3000:]
            time.sleep(0.2)
        line, log = _all_jobs()[job], _read(out)
        print(f"job {job} ended {time.time() - t_kill:.1f} s after the kill")
        # rank 0's commit fails on the closed connection; its heartbeat names rank 1 (one host here: both
        # nodes run on this machine) well before srun's --kill-on-bad-exit would SIGKILL it (KillWait, 30 s)
        assert _field(line, "JobState") == "FAILED" and _field(line, "ExitCode") == "5:0", line
        culprit = f"rank 1 (host {socket.gethostname()}, pid {victim}) stopped answering"
        assert re.search(rf"Comment=megatron-lol: status 5: megatron-lol train: error: {re.escape(culprit)}", line), (
            line
        )
        # a runtime failure under the srun launcher carries its status to the job, without a requeue
        assert f"training failed with status 5: megatron-lol train: error: {culprit}" in log, log[-3000:]
        assert "launch: srun" in log and "requeueing" not in log, log[-3000:]
        assert "srun: error: node2: task 1: Exited with exit code 137" in log, log[-3000:]
        assert tracker(save) == 2 and not (save / "iter_0000004").exists(), list(save.iterdir())
        logged = _metrics(save)
        assert max(logged) == 4, logged
        # the same submission again (a new job, the same SAVE_DIR): it resumes from iteration 2. `scontrol
        # requeue` of the failed job takes the same path, but Slurm 22.05 here then sends SIGTERM to the
        # requeued job's step 0 about 30 s after it starts, at times (the trainer saves and requeues once more)
        again = _sh(*sbatch, REPO / "slurm" / "pretrain.sbatch", env=env, cwd=tmp_path).strip().split(";")[0]
        jobs.append(again)
        t1 = time.time()
        while _field(_all_jobs().get(again, ""), "JobState") in ACTIVE:
            assert time.time() - t1 < _loaded(200), _all_jobs().get(again, "") + _read(out)[-3000:]
            time.sleep(0.3)
        line = _all_jobs()[again]
    finally:
        left = [j for j in jobs if _field(_all_jobs().get(j, ""), "JobState") in ACTIVE]
        if left:
            _sh("scancel", *left, check=False)
    log = _read(out)
    assert _field(line, "JobState") == "COMPLETED" and _field(line, "ExitCode") == "0:0", line + log[-3000:]
    assert _field(line, "Restarts") == "0" and f"loaded {save}/iter_0000002" in log, log[-3000:]
    got = _metrics(save)
    assert sorted(got) == list(range(1, 7)) and tracker(save) == 6
    for s in (3, 4):
        assert got[s]["loss"] == logged[s]["loss"] and got[s]["grad_norm"] == logged[s]["grad_norm"], (s, got, logged)
