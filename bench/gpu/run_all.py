"""The one-shot GPU proof behind bench/gpu/run_all.sh: GPU tests, BF16 / FP8 throughput, one JSON report.

    python bench/gpu/run_all.py --out DIR [--dry-run] [--steps N] [--warmup K] [--micro-batch-size B]
                                [--skip-tests] [--part-timeout NAME=SECONDS ...]
    python bench/gpu/run_all.py --print-budget [...]   # what run_all.sh reads: "<time limit> <install budget>"

The whole proof (run_all.sh: the wheelhouse install, then this script under ``timeout``) has
:data:`TIME_LIMIT_S`. Each part that runs a command has a budget in :data:`BUDGET_S`, the only table of them:
the budgets, the install's (:data:`INSTALL_S`) and a margin for start-up and the last report
(:data:`MARGIN_S`) add up to at most the limit, which :func:`check_budget` enforces before anything runs, and
run_all.sh takes its ``timeout`` from ``--print-budget``. A part runs in a process group of its own; past its
budget the whole group is killed (bench/gpu/part_runner.py), the part is marked ``timed_out`` and the proof
goes on with the next one. SIGTERM (the outer ``timeout``) kills the part in flight the same way and ends the
proof. ``gpu_report.json`` is rewritten (atomically) after every part, so whatever kills the proof leaves
every part finished before it in the report.

Parts, in order:

* ``environment``: Python, torch, CUDA device, Transformer Engine, megatron-core, the wheelhouse;
* ``wheelhouse``: every distribution the profiled runs need (megatron-lol's requirements for Python 3.12,
  the profiled config's optimizer, the test runner, closed over their own requirements) is in
  bench/gpu/wheelhouse.txt or provided by the GPU machine (:data:`GPU_MACHINE_PROVIDES`);
* ``gpu_tests``: ``pytest -m gpu tests/test_gpu.py`` (JUnit XML parsed: passed / failed / skipped);
* ``throughput_bf16`` / ``throughput_fp8``: ``lol_<precision>``, ``megatron-lol profile --no-breakdown`` of
  the LoL config (whole steps timed with CUDA events, no section timers; the routed core is the one
  ``parallel.routed_core: auto`` picks, the grouped core on CUDA where the layers allow it: docs/gpu.md), and
  ``dense_<precision>``, megatron-core's ``GPTModel`` with the same layer spec (bench/gpu/gpt_baseline.py)
  whose executed FLOPs per step (perf/flops.py) are the LoL model's, at sequence length 2048; FP8 (current
  scaling for both) only where Transformer Engine imports on a GPU with FP8; then
  ``lol_<precision>_breakdown``, a separate, labelled run of the LoL config with the section breakdown
  (:data:`BREAKDOWN_STEPS` steps: its module timers synchronise the GPU, so its step times are not throughput);
* ``goals``: the dense model's BF16 MFU against 40% (Megatron-LM's published ~41% for GPT-2B class models)
  and LoL tokens/s against 0.9x the dense run.

``--dry-run`` runs the same parts, budgets (times :data:`DRY_RUN_SLACK`), kills and report on whatever device
there is with a tiny model and one step (CI runs it on the CPU, where the GPU tests skip), so the script cannot
rot. ``--part-timeout
NAME=SECONDS`` shortens one part's budget (repeatable; NAME a key of :data:`BUDGET_S`): CI uses it to see a
part killed.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
import xml.etree.ElementTree as ET
from pathlib import Path

from part_runner import Terminated, install_sigterm, run_part, write_json

REPO = Path(__file__).resolve().parents[2]
LOL_CONFIG = "examples/configs/paper/lol-360m-L4.yaml"
SEQ = 2048
#: the dry run's model: the same plan and options as LOL_CONFIG, tiny
TINY = [
    "model.hidden_size=64",
    "model.num_attention_heads=4",
    "model.ffn_hidden_size=128",
    "model.n_prelude=1",
    "model.n_coda=1",
    "model.plan.num_blocks=2",
    "model.plan.routed_depth=2",
    "model.plan.windows.size=16",
    "model.plan.windows.shift=8",
    "model.vocab_size=512",
]

#: the whole proof on one GPU, run_all.sh's install included (run_all.sh's ``timeout`` comes from here)
TIME_LIMIT_S = 480
#: run_all.sh's wheelhouse install (venv, pip, the torch check), under a ``timeout`` of its own
INSTALL_S = 60
#: start-up (run_all.sh's import check, this script's imports, environment and wheelhouse check), killing the
#: last part (two grace periods of part_runner.GRACE_S) and the last report
MARGIN_S = 40
#: the least margin check_budget accepts
MIN_MARGIN_S = 30
#: each part's budget in seconds (estimates for one H100, not yet measured on one), in the order they run
BUDGET_S = {
    "gpu_tests": 150,
    "lol_bf16": 45,
    "dense_bf16": 40,
    "lol_bf16_breakdown": 30,
    "lol_fp8": 45,
    "dense_fp8": 40,
    "lol_fp8_breakdown": 30,
}
#: seconds kept back at the end for killing the part in flight and writing the report
FINISH_S = 15
#: a part is not started with less time than this left under the limit
MIN_PART_S = 5
#: a dry run gives each part this many times its budget (still within the overall limit): its tiny model on a
#: CPU shared with other work (CI) is not what the budgets were set for, and a dry run checks the script, not
#: its speed; ``--part-timeout`` values are taken as they are
DRY_RUN_SLACK = 3
#: timed steps of the breakdown runs (their proportions, not their speed, are what they report)
BREAKDOWN_STEPS = 3

WHEELHOUSE_LIST = REPO / "bench" / "gpu" / "wheelhouse.txt"
#: what the lent GPU machine has (docs/gpu.md): Python 3.12, CUDA torch and transformers, with their requirements
GPU_MACHINE_PROVIDES = {
    "torch",
    "transformers",
    "numpy",
    "pyyaml",
    "tqdm",
    "typing-extensions",
    "safetensors",
    "tokenizers",
    "huggingface-hub",
    "filelock",
    "fsspec",
    "jinja2",
    "markupsafe",
    "networkx",
    "sympy",
    "mpmath",
    "regex",
    "requests",
    "certifi",
    "charset-normalizer",
    "idna",
    "urllib3",
    "setuptools",
    "triton",
    "hf-xet",
}
#: what the test runner and the profiler add to megatron-lol's requirements on the GPU machine
RUN_NEEDS = ("pytest", "pytest-timeout", "nvidia-ml-py")
#: distributions an optimizer of the config imports (training/optimizer.py, training/muon_compat.py)
OPTIMIZER_NEEDS = {"muon": ("emerging-optimizers", "absl-py")}


def _norm(name: str) -> str:
    import re

    return re.sub(r"[-_.]+", "-", name).lower()


def wheelhouse_list() -> dict:
    """``{distribution: version}`` of bench/gpu/wheelhouse.txt (what build_wheelhouse.sh downloads)."""
    out = {}
    for line in WHEELHOUSE_LIST.read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            name, _, version = line.partition("==")
            out[_norm(name)] = version.strip()
    return out


def _requirements_312(lines) -> list:
    """Names of the requirements (no extras) that apply on CPython 3.12 / Linux."""
    from packaging.requirements import Requirement

    env = {
        "python_version": "3.12",
        "python_full_version": "3.12.0",
        "sys_platform": "linux",
        "platform_system": "Linux",
        "platform_machine": "x86_64",
        "implementation_name": "cpython",
        "platform_python_implementation": "CPython",
        "os_name": "posix",
        "extra": "",
    }
    names = []
    for line in lines or ():
        req = Requirement(line)
        if req.marker is None or req.marker.evaluate(env):
            names.append(_norm(req.name))
    return names


def wheelhouse_check(configs=(LOL_CONFIG,)) -> dict:
    """What the profiled configs need on the GPU machine and which of it the wheelhouse list lacks.

    Needed: megatron-lol's own requirements (pyproject.toml) and each config's optimizer's, the test runner
    and profiler (:data:`RUN_NEEDS`), closed over the requirements of every installed distribution among
    them (this machine's metadata), minus :data:`GPU_MACHINE_PROVIDES`.
    """
    from importlib import metadata

    import tomllib

    from megatron_lol.config import load_config

    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    todo = _requirements_312(project["dependencies"]) + [_norm(n) for n in RUN_NEEDS]
    for path in configs:
        cfg = load_config(REPO / path, check_data=False)
        todo += [_norm(n) for n in OPTIMIZER_NEEDS.get(cfg.optimizer.name, ())]
    needed = set()
    while todo:
        name = todo.pop()
        if name in needed or name in GPU_MACHINE_PROVIDES:
            continue
        needed.add(name)
        try:
            todo += _requirements_312(metadata.requires(name))
        except metadata.PackageNotFoundError:  # not installed here: its own requirements are not known
            pass
    listed = wheelhouse_list()
    return {"configs": list(configs), "needed": sorted(needed), "missing": sorted(needed - set(listed))}


def environment() -> dict:
    import torch

    env = {"python": platform.python_version(), "torch": torch.__version__, "cuda": torch.cuda.is_available()}
    if env["cuda"]:
        env.update(
            device=torch.cuda.get_device_name(),
            device_count=torch.cuda.device_count(),
            capability=list(torch.cuda.get_device_capability()),
            cuda_version=torch.version.cuda,
        )
    from megatron_lol.platform import has_transformer_engine

    env["transformer_engine"] = has_transformer_engine()
    try:
        from importlib.metadata import version

        env["megatron_core"] = version("megatron-core")
    except Exception:  # reported, not fatal: the parts below fail with their own message
        env["megatron_core"] = None
    wheels = REPO / "bench" / "gpu" / "wheelhouse"
    env["wheelhouse_bytes"] = sum(p.stat().st_size for p in wheels.glob("*.whl")) if wheels.is_dir() else None
    return env


def check_budget(budgets: dict | None = None, limit: int = TIME_LIMIT_S) -> dict:
    """The budget arithmetic: install + parts + margin within the limit, else SystemExit(2) with one line."""
    budgets = BUDGET_S if budgets is None else budgets
    total = INSTALL_S + sum(budgets.values()) + MARGIN_S
    if total > limit or MARGIN_S < MIN_MARGIN_S:
        raise SystemExit(
            f"run_all.py: the budgets (install {INSTALL_S} s + parts {sum(budgets.values())} s + margin {MARGIN_S} s"
            f" = {total} s, margin at least {MIN_MARGIN_S} s) do not fit the proof's limit of {limit} s (BUDGET_S)"
        )
    return {
        "time_limit_s": limit,
        "install_s": INSTALL_S,
        "margin_s": MARGIN_S,
        "parts_s": dict(budgets),
        "total_s": total,
    }


def part_timeouts(specs: list) -> dict:
    """``--part-timeout NAME=SECONDS`` values as ``{name: seconds}``; SystemExit(2) with one line for a bad one.
    A part's budget can only be shortened (the arithmetic of :func:`check_budget` must still hold)."""
    out = {}
    for spec in specs:
        name, _, raw = spec.partition("=")
        try:
            seconds = float(raw)
        except ValueError:
            seconds = -1.0
        if name not in BUDGET_S:
            raise SystemExit(f"run_all.py: --part-timeout {spec}: no part {name!r} (parts: {', '.join(BUDGET_S)})")
        if not 0 < seconds <= BUDGET_S[name]:
            raise SystemExit(
                f"run_all.py: --part-timeout {spec}: SECONDS must be a number in (0, {BUDGET_S[name]}] (its budget)"
            )
        out[name] = seconds
    return out


class Proof:
    """The report being written and the parts being run: each part's result goes into the report, which is
    written out, as soon as the part ends."""

    def __init__(self, out: Path, dry_run: bool, budget: dict, seconds_left: float, timeouts: dict):
        self.out, self.timeouts = out, timeouts
        self.slack = DRY_RUN_SLACK if dry_run else 1
        self.report = {
            "dry_run": dry_run,
            "complete": False,
            "budget": dict(budget, seconds_left=seconds_left, part_timeouts=timeouts, slack=self.slack),
            "timed_out_parts": [],
            "parts": {},
        }
        self.t0 = time.monotonic()
        #: when the last part must have ended: the outer ``timeout`` minus what killing a part and the report take
        self.deadline = self.t0 + seconds_left - FINISH_S
        self.path = out / "gpu_report.json"
        self.current = None

    def save(self) -> None:
        self.report["elapsed_s"] = round(time.monotonic() - self.t0, 1)
        write_json(self.path, self.report)

    def run(self, body) -> int:
        """``body()`` with the report written first and last; 124 if SIGTERM (:func:`install_sigterm`) stopped
        it, with the part in flight killed and marked, the report saying so, else 0."""
        try:
            self.save()
            body()
            self.report["complete"] = True
            self.save()
            return 0
        except Terminated:
            self.report["stopped"] = f"SIGTERM (the proof's overall time limit) during {self.current or 'start-up'}"
            self.save()
            print(f"run_all.py: stopped by SIGTERM; the parts that ended are in {self.path}", file=sys.stderr)
            return 124

    def part(self, name: str, cmd: list, into: dict, finish) -> dict:
        """Run part ``name`` (``cmd``, its output in ``<out>/<name>.log``) within its budget, put
        ``finish(run_part's result)`` (or why it did not finish) into ``into[name]`` and write the report."""
        budget = self.timeouts.get(name, BUDGET_S[name] * self.slack)
        left = self.deadline - time.monotonic()
        if left < MIN_PART_S:
            into[name] = {"ran": False, "reason": f"no time left under the proof's limit of {TIME_LIMIT_S} s"}
            self.save()
            return into[name]
        timeout = min(budget, left)
        log = self.out / f"{name}.log"
        self.current = name
        t0 = time.monotonic()
        try:
            run = run_part(cmd, log, timeout, cwd=REPO)
        except Terminated as stop:
            into[name] = {
                "ran": True,
                "timed_out": True,
                "seconds": round(time.monotonic() - t0, 1),
                "budget_s": budget,
                "error": "stopped by SIGTERM (the proof's overall time limit): its process group was killed",
                **stop.killed,
            }
            self.report["timed_out_parts"].append(name)
            raise
        self.current = None
        if run["timed_out"]:
            why = "its budget" if timeout == budget else "the time left under the proof's limit"
            into[name] = {
                "ran": True,
                "error": f"timed out after {timeout:g} s ({why}): its process group was killed",
                **run,
                "budget_s": budget,
                "log_tail": _tail(log),
            }
            self.report["timed_out_parts"].append(name)
        else:
            into[name] = dict(finish(run, log), budget_s=budget)
        self.save()
        return into[name]


def _tail(log: Path, n: int = 2000) -> str:
    return log.read_text(errors="replace")[-n:] if log.exists() else ""


def dense_equal_flops(overrides: list, seq: int, batch: int) -> dict:
    """The dense GPT (same width and fixed layers, full attention) whose executed training FLOPs per step
    are closest to the LoL config's."""
    from megatron_lol.config import load_config
    from megatron_lol.model.lol_model import padded_vocab_size
    from megatron_lol.perf.flops import dense_equivalent, training_flops

    cfg = load_config(
        REPO / LOL_CONFIG, [(k, _yaml(v), "--set") for k, v in (o.split("=", 1) for o in overrides)], check_data=False
    )
    m = cfg.model
    vocab = m.vocab_size or padded_vocab_size(32000, m.make_vocab_size_divisible_by)
    plan = m.execution_plan()
    lol = training_flops(m, vocab, seq, batch, attention_pairs="executed", streams_per_depth=plan.num_stored_blocks)
    best = None
    for layers in range(1, 4 * plan.depth + 1):
        import dataclasses

        dense = dataclasses.replace(dense_equivalent(m), plan={"kind": "dense", "layers": layers})
        f = training_flops(dense, vocab, seq, batch, attention_pairs="executed").total
        if best is None or abs(f - lol.total) < abs(best[1] - lol.total):
            best = (layers, f)
    return {
        "core_layers": best[0],
        "lol_flops_per_step": lol.total,
        "dense_flops_per_step": best[1],
        "flops_ratio": best[1] / lol.total,
    }


def _yaml(raw: str):
    import yaml

    return yaml.safe_load(raw)


def _summary(report: Path, seconds: float) -> dict:
    r = json.loads(report.read_text())
    return {
        "ran": True,
        "seconds": seconds,
        "device": r["device"],
        "precision": r["precision"],
        "timing": r.get("timing"),
        "step_time_s": r["step_time_s"]["median"],
        "tokens_per_s_per_gpu": r["tokens_per_s_per_device"],
        "tflops_per_gpu": r["tflops_per_device"],
        "tflops_per_gpu_executed": r["tflops_per_device_executed"],
        "mfu": r["mfu"],
        "flops_per_step_executed": r["flops_per_step_executed"],
        "peak_memory_bytes": r["peak_memory"]["bytes"],
        "loss": r["loss"],
        "host_syncs": r.get("host_syncs"),  # per step, counted in untimed steps after the timed ones
        **({"model": r["model"], "spec": r["spec"]} if "model" in r else {}),
    }


def gpu_tests(proof: Proof, parts: dict) -> dict:
    """``pytest -m gpu tests/test_gpu.py`` as the part ``gpu_tests`` (its tests start tests/gpu_steps.py
    processes: they are in the part's process group)."""
    xml = proof.out / "gpu_tests.xml"
    cmd = [
        sys.executable,
        "-m",
        "pytest",
        "-q",
        "-p",
        "no:cacheprovider",
        "-m",
        "gpu",
        "tests/test_gpu.py",
        f"--junitxml={xml}",
        "-rs",
    ]

    def finish(run: dict, log: Path) -> dict:
        result = {"ran": True, "exit_code": run["exit_code"], "seconds": run["seconds"]}
        result.update(passed=[], failed=[], skipped={})
        if not xml.exists():
            result["error"] = _tail(log)
            return result
        for case in ET.parse(xml).getroot().iter("testcase"):
            name = case.get("name")
            failure = case.find("failure")
            if failure is None:
                failure = case.find("error")
            skipped = case.find("skipped")
            if failure is not None:
                result["failed"].append({"name": name, "message": (failure.get("message") or "")[:500]})
            elif skipped is not None:
                result["skipped"][name] = skipped.get("message", "")
            else:
                result["passed"].append(name)
        return result

    return proof.part("gpu_tests", cmd, parts, finish)


def _json_part(proof: Proof, name: str, cmd: list, report: Path, into: dict, breakdown: bool = False) -> dict:
    """A part that writes a profile-style JSON ``report``: its summary (or the error it ended with)."""

    def finish(run: dict, log: Path) -> dict:
        if run["exit_code"] != 0 or not report.exists():
            return {"ran": True, "error": _tail(log), "exit_code": run["exit_code"], "seconds": run["seconds"]}
        result = _summary(report, run["seconds"])
        if breakdown:
            result["breakdown_s"] = json.loads(report.read_text())["breakdown_s"]
            result["note"] = "section timers synchronise the GPU at every timed module: not throughput"
        return result

    report.unlink(missing_ok=True)
    return proof.part(name, cmd, into, finish)


def profile(proof: Proof, name: str, sets: list, into: dict, steps: int, warmup: int, fp8: bool, breakdown=False):
    """``megatron-lol profile`` of the LoL config: whole-step CUDA-event times (``--no-breakdown``), or the
    section breakdown (a run of its own: its timers synchronise the GPU at every module)."""
    report = proof.out / f"profile_{name}.json"
    cmd = [sys.executable, "-m", "megatron_lol", "profile", "--config", LOL_CONFIG, "--synthetic-data"]
    cmd += ["--steps", str(steps), "--warmup", str(warmup), "--json", str(report)]
    if not breakdown:
        cmd.append("--no-breakdown")
    for s in sets:
        cmd += ["--set", s]
    if fp8:
        cmd += ["--precision", "fp8"]
    return _json_part(proof, name, cmd, report, into, breakdown)


def gpt_baseline(proof: Proof, name: str, sets: list, into: dict, steps: int, warmup: int, fp8: bool) -> dict:
    """megatron-core's GPTModel with the LoL layer spec (bench/gpu/gpt_baseline.py)."""
    report = proof.out / f"profile_{name}.json"
    cmd = [sys.executable, "bench/gpu/gpt_baseline.py", "--config", LOL_CONFIG]
    cmd += ["--steps", str(steps), "--warmup", str(warmup), "--json", str(report)]
    for s in sets:
        cmd += ["--set", s]
    if fp8:
        cmd += ["--precision", "fp8"]
    return _json_part(proof, name, cmd, report, into)


def throughput(proof: Proof, args, dense: dict, fp8: bool) -> None:
    """``throughput_<tag>``: the LoL run, the dense run of equal executed FLOPs, their ratio, the breakdown run;
    each written into the report as it ends."""
    base = [
        f"training.seq_length={args.seq}",
        f"training.micro_batch_size={args.micro_batch_size}",
        f"training.global_batch_size={args.micro_batch_size}",
        "curriculum.initial_depth=null",
        "data.tokenizer_model=null",  # synthetic tokens over model.vocab_size
        "model.precision.params_dtype=bf16" if not args.dry_run or args.cuda else "model.precision.params_dtype=fp32",
    ]
    base += TINY if args.dry_run else []
    dense_sets = [
        f"model.plan={{kind: dense, layers: {dense['core_layers']}}}",
        "model.plan.attention=full",
        "model.plan.film='off'",
    ]
    # current scaling for both: the LoL plan refuses delayed scaling (docs/gpu.md, "FP8")
    precision = ["model.precision.fp8=hybrid", "model.precision.fp8_recipe=tensorwise"] if fp8 else []
    tag = "fp8" if fp8 else "bf16"
    section = proof.report["parts"][f"throughput_{tag}"] = {
        "ran": True,
        "dense_of_equal_flops": dense,
        "runs": {},
        "breakdown": {},
    }
    runs = section["runs"]
    lol = profile(proof, f"lol_{tag}", base + precision, runs, args.steps, args.warmup, fp8)
    dn = gpt_baseline(proof, f"dense_{tag}", base + dense_sets + precision, runs, args.steps, args.warmup, fp8)
    if "error" not in lol and "error" not in dn and lol.get("ran") and dn.get("ran"):
        runs["lol_over_dense_tokens_per_s"] = lol["tokens_per_s_per_gpu"] / dn["tokens_per_s_per_gpu"]
        proof.save()
    steps = min(args.steps, BREAKDOWN_STEPS)
    profile(proof, f"lol_{tag}_breakdown", base + precision, section["breakdown"], steps, args.warmup, fp8, True)


def goals(report: dict) -> dict:
    runs = report["parts"].get("throughput_bf16", {}).get("runs", {})
    dense, lol = runs.get("dense_bf16", {}), runs.get("lol_bf16", {})
    if report["dry_run"] or not report["environment"]["cuda"] or "lol_over_dense_tokens_per_s" not in runs:
        why = "dry run" if report["dry_run"] else ("no GPU" if not report["environment"]["cuda"] else "a run failed")
        return {"measured": False, "reason": why}
    ratio = runs["lol_over_dense_tokens_per_s"]
    return {
        "measured": True,
        "dense_bf16_mfu": dense["mfu"],
        "dense_mfu_goal": 0.40,
        "dense_mfu_met": dense["mfu"] is not None and dense["mfu"] >= 0.40,
        "lol_over_dense_tokens_per_s": ratio,
        "lol_bf16_mfu": lol["mfu"],
        "lol_ratio_goal": 0.9,
        "lol_ratio_met": ratio >= 0.9,
    }


def _failed(report: dict) -> bool:
    parts = report["parts"]
    tests = parts.get("gpu_tests", {})
    failed = bool(tests.get("failed")) or "error" in tests or bool(parts.get("wheelhouse", {}).get("missing"))
    for p in ("throughput_bf16", "throughput_fp8"):
        for key in ("runs", "breakdown"):
            failed |= any("error" in r for r in parts.get(p, {}).get(key, {}).values() if isinstance(r, dict))
    return failed or bool(report["timed_out_parts"])


def _parts(proof: Proof, args) -> None:
    """The proof's parts in order, each written into the report as it ends."""
    report = proof.report
    report["environment"] = environment()
    proof.save()
    import torch

    args.cuda = torch.cuda.is_available()
    args.steps = args.steps or (1 if args.dry_run else 10)
    args.warmup = (0 if args.dry_run else 3) if args.warmup is None else args.warmup
    args.micro_batch_size = args.micro_batch_size or (2 if args.dry_run else 8)
    args.seq = 64 if args.dry_run else SEQ
    parts = report["parts"]
    parts["wheelhouse"] = wheelhouse_check()
    proof.save()
    if args.skip_tests:
        parts["gpu_tests"] = {"ran": False, "reason": "--skip-tests"}
    else:
        gpu_tests(proof, parts)
    dense = dense_equal_flops(TINY if args.dry_run else [], args.seq, args.micro_batch_size)
    throughput(proof, args, dense, fp8=False)
    env = report["environment"]
    if env["transformer_engine"] and env.get("capability", [0])[0:2] >= [8, 9]:
        throughput(proof, args, dense, fp8=True)
    else:
        parts["throughput_fp8"] = {"ran": False, "reason": "needs Transformer Engine on a GPU with FP8 (8.9+)"}
    report["goals"] = goals(report)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
    ap.add_argument("--out", help="directory of the report and the parts' logs (required unless --print-budget)")
    ap.add_argument("--dry-run", action="store_true", help="tiny model, one step: checks the script itself")
    ap.add_argument("--steps", type=int, default=None, help="timed steps per profile (default 10; dry run 1)")
    ap.add_argument("--warmup", type=int, default=None, help="untimed steps first (default 3; dry run 0)")
    ap.add_argument("--micro-batch-size", type=int, default=None, help="micro-batch (default 8; dry run 2)")
    ap.add_argument("--skip-tests", action="store_true", help="throughput only")
    ap.add_argument(
        "--part-timeout",
        action="append",
        default=[],
        metavar="NAME=SECONDS",
        help=f"shorten a part's budget (repeatable; parts: {', '.join(BUDGET_S)})",
    )
    ap.add_argument("--print-budget", action="store_true", help="check the budgets; print the limit and install's")
    ap.add_argument("--time-limit", type=float, default=None, help="run_all.sh's limit: must be TIME_LIMIT_S")
    ap.add_argument(
        "--started-after", type=float, default=0.0, help="seconds run_all.sh spent before this script (install)"
    )
    args = ap.parse_args(argv)
    try:
        budget = check_budget()
        timeouts = part_timeouts(args.part_timeout)
        if args.time_limit is not None and args.time_limit != TIME_LIMIT_S:
            raise SystemExit(
                f"run_all.py: --time-limit {args.time_limit:g} (run_all.sh's timeout) is not the budget table's"
                f" limit of {TIME_LIMIT_S} s (TIME_LIMIT_S)"
            )
        if not args.print_budget and not args.out:
            raise SystemExit("run_all.py: --out is required (the directory of gpu_report.json)")
    except SystemExit as e:
        print(e.code, file=sys.stderr)
        return 2
    if args.print_budget:
        print(TIME_LIMIT_S, INSTALL_S)
        return 0
    install_sigterm()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    proof = Proof(out, args.dry_run, budget, TIME_LIMIT_S - args.started_after, timeouts)
    if proof.run(lambda: _parts(proof, args)):
        return 124
    report = proof.report
    print(json.dumps({k: report[k] for k in ("environment", "goals", "timed_out_parts", "elapsed_s")}, indent=2))
    print(f"wrote {proof.path}")
    return 1 if _failed(report) else 0


if __name__ == "__main__":
    sys.exit(main())
