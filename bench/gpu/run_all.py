"""The one-shot GPU proof behind bench/gpu/run_all.sh: GPU tests, BF16 / FP8 throughput, one JSON report.

    python bench/gpu/run_all.py --out DIR [--dry-run] [--steps N] [--warmup K] [--micro-batch-size B]

Parts (each with its own time budget, the report rewritten after each so a killed run leaves what it had):

* ``environment``: Python, torch, CUDA device, Transformer Engine, megatron-core, the wheelhouse;
* ``wheelhouse``: every distribution the profiled runs need (megatron-lol's requirements for Python 3.12,
  the profiled config's optimizer, the test runner, closed over their own requirements) is in
  bench/gpu/wheelhouse.txt or provided by the GPU machine (:data:`GPU_MACHINE_PROVIDES`);
* ``gpu_tests``: ``pytest -m gpu tests/test_gpu.py`` (JUnit XML parsed: passed / failed / skipped);
* ``throughput_bf16`` / ``throughput_fp8``: ``megatron-lol profile --no-breakdown`` of the LoL config
  (whole steps timed with CUDA events, no section timers) and megatron-core's ``GPTModel`` with the same
  layer spec (bench/gpu/gpt_baseline.py) whose executed FLOPs per step (perf/flops.py) are the LoL model's,
  at sequence length 2048; FP8 (current scaling for both) only where Transformer Engine imports; then a
  separate, labelled run of the LoL config with the section breakdown (``lol_*_breakdown``: its module
  timers synchronise the GPU, so its step times are not throughput);
  In BF16 also ``lol_bf16_grouped``: the LoL config with the grouped routed core (local-spec layers);
* ``goals``: the dense model's BF16 MFU against 40% (Megatron-LM's published ~41% for GPT-2B class models)
  and LoL tokens/s (the better of the two LoL runs, named) against 0.9x the dense run.

``--dry-run`` runs the same parts on whatever device there is with a tiny model and one step (CI runs it
on the CPU, where the GPU tests skip), so the script cannot rot.
"""

from __future__ import annotations

import argparse
import json
import platform
import subprocess
import sys
import time
import xml.etree.ElementTree as ET
from pathlib import Path

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
    "model.window_size=16",
    "model.window_shift=8",
    "model.vocab_size=512",
]
BUDGET_S = {"gpu_tests": 270, "profile": 90}
#: the LoL run with the grouped routed core (it runs local-spec layers)
GROUPED = ["model.use_transformer_engine=false", "model.routed_core=grouped"]
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


def run_gpu_tests(out: Path, timeout: int) -> dict:
    xml = out / "gpu_tests.xml"
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
    t0 = time.time()
    try:
        proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return {"ran": True, "error": f"timed out after {timeout} s"}
    (out / "gpu_tests.log").write_text(proc.stdout + proc.stderr)
    result = {
        "ran": True,
        "exit_code": proc.returncode,
        "seconds": round(time.time() - t0, 1),
        "passed": [],
        "failed": [],
        "skipped": {},
    }
    if not xml.exists():
        result["error"] = (proc.stdout + proc.stderr)[-2000:]
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

        dense = dataclasses.replace(dense_equivalent(m), core_layers=layers, film="off")
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


def _summary(report: Path, t0: float) -> dict:
    r = json.loads(report.read_text())
    return {
        "ran": True,
        "seconds": round(time.time() - t0, 1),
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


def _run_json(name: str, cmd: list, out: Path, report: Path, timeout: int) -> dict:
    t0 = time.time()
    try:
        proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return {"ran": True, "error": f"timed out after {timeout} s"}
    (out / f"{name}.log").write_text(proc.stdout + proc.stderr)
    if proc.returncode != 0 or not report.exists():
        return {"ran": True, "error": (proc.stderr or proc.stdout)[-2000:], "exit_code": proc.returncode}
    return _summary(report, t0)


def profile(
    name: str, sets: list, out: Path, steps: int, warmup: int, timeout: int, fp8: bool, breakdown: bool = False
) -> dict:
    """``megatron-lol profile`` of the LoL config: whole-step CUDA-event times (``--no-breakdown``), or the
    section breakdown (a run of its own: its timers synchronise the GPU at every module)."""
    report = out / f"profile_{name}.json"
    cmd = [
        sys.executable,
        "-m",
        "megatron_lol",
        "profile",
        "--config",
        LOL_CONFIG,
        "--synthetic-data",
        "--steps",
        str(steps),
        "--warmup",
        str(warmup),
        "--json",
        str(report),
    ]
    if not breakdown:
        cmd.append("--no-breakdown")
    for s in sets:
        cmd += ["--set", s]
    if fp8:
        cmd += ["--precision", "fp8"]
    result = _run_json(f"profile_{name}", cmd, out, report, timeout)
    if breakdown and "error" not in result:
        result["breakdown_s"] = json.loads(report.read_text())["breakdown_s"]
    return result


def gpt_baseline(name: str, sets: list, out: Path, steps: int, warmup: int, timeout: int, fp8: bool) -> dict:
    """megatron-core's GPTModel with the LoL layer spec (bench/gpu/gpt_baseline.py)."""
    report = out / f"profile_{name}.json"
    cmd = [
        sys.executable,
        "bench/gpu/gpt_baseline.py",
        "--config",
        LOL_CONFIG,
        "--steps",
        str(steps),
        "--warmup",
        str(warmup),
        "--json",
        str(report),
    ]
    for s in sets:
        cmd += ["--set", s]
    if fp8:
        cmd += ["--precision", "fp8"]
    return _run_json(f"gpt_baseline_{name}", cmd, out, report, timeout)


def throughput(out: Path, args, dense: dict, fp8: bool) -> dict:
    base = [
        f"training.seq_length={args.seq}",
        f"training.micro_batch_size={args.micro_batch_size}",
        f"training.global_batch_size={args.micro_batch_size}",
        "curriculum.initial_depth=null",
        "data.tokenizer_model=null",  # synthetic tokens over model.vocab_size
        "model.params_dtype=bf16" if not args.dry_run or args.cuda else "model.params_dtype=fp32",
    ]
    base += TINY if args.dry_run else []
    dense_sets = [
        f"model.plan={{kind: dense, layers: {dense['core_layers']}}}",
        "model.dense_attention=full",
        "model.film='off'",
    ]
    # current scaling for both: the LoL plan refuses delayed scaling (docs/gpu.md, "FP8")
    precision = ["model.fp8=hybrid", "model.fp8_recipe=tensorwise"] if fp8 else []
    tag = "fp8" if fp8 else "bf16"
    runs = {
        f"lol_{tag}": profile(f"lol_{tag}", base + precision, out, args.steps, args.warmup, BUDGET_S["profile"], fp8),
        f"dense_{tag}": gpt_baseline(
            f"dense_{tag}", base + dense_sets + precision, out, args.steps, args.warmup, BUDGET_S["profile"], fp8
        ),
    }
    if not fp8:
        # the routed depths as one grouped computation each (docs/gpu.md, "The routed depth on a GPU"):
        # local-spec layers (Transformer Engine's run the per-block reference); FP8 has no grouped path
        runs[f"lol_{tag}_grouped"] = profile(
            f"lol_{tag}_grouped", base + GROUPED, out, args.steps, args.warmup, BUDGET_S["profile"], fp8
        )
    dn = runs[f"dense_{tag}"]
    for name in (f"lol_{tag}", f"lol_{tag}_grouped"):
        lol = runs.get(name, {"error": "not run"})
        if "error" not in lol and "error" not in dn:
            ratio_key = "lol_over_dense_tokens_per_s" if name == f"lol_{tag}" else "lol_grouped_over_dense_tokens_per_s"
            runs[ratio_key] = lol["tokens_per_s_per_gpu"] / dn["tokens_per_s_per_gpu"]
    breakdown = profile(
        f"lol_{tag}_breakdown", base + precision, out, args.steps, args.warmup, BUDGET_S["profile"], fp8, breakdown=True
    )
    return {
        "ran": True,
        "dense_of_equal_flops": dense,
        "runs": runs,
        "breakdown": {
            f"lol_{tag}_breakdown": dict(
                breakdown, note="section timers synchronise the GPU at every timed module: not throughput"
            )
        },
    }


def goals(report: dict) -> dict:
    bf16 = report["parts"].get("throughput_bf16", {})
    runs = bf16.get("runs", {})
    dense, lol = runs.get("dense_bf16", {}), runs.get("lol_bf16", {})
    if not report["environment"]["cuda"] or report["dry_run"] or "error" in dense or "error" in lol or not runs:
        why = "dry run" if report["dry_run"] else ("no GPU" if not report["environment"]["cuda"] else "a run failed")
        return {"measured": False, "reason": why}
    ratios = {
        key: runs[key]
        for key in ("lol_over_dense_tokens_per_s", "lol_grouped_over_dense_tokens_per_s")
        if runs.get(key) is not None
    }
    best = max(ratios, key=ratios.get) if ratios else None
    return {
        "measured": True,
        "dense_bf16_mfu": dense["mfu"],
        "dense_mfu_goal": 0.40,
        "dense_mfu_met": dense["mfu"] is not None and dense["mfu"] >= 0.40,
        **ratios,
        "lol_ratio_goal": 0.9,
        "lol_ratio_best": best,
        "lol_ratio_met": best is not None and ratios[best] >= 0.9,
    }


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
    ap.add_argument("--out", required=True)
    ap.add_argument("--dry-run", action="store_true", help="tiny model, one step: checks the script itself")
    ap.add_argument("--steps", type=int, default=None, help="timed steps per profile (default 10; dry run 1)")
    ap.add_argument("--warmup", type=int, default=None, help="untimed steps first (default 3; dry run 0)")
    ap.add_argument("--micro-batch-size", type=int, default=None, help="micro-batch (default 8; dry run 2)")
    ap.add_argument("--skip-tests", action="store_true", help="throughput only")
    args = ap.parse_args(argv)
    import torch

    args.cuda = torch.cuda.is_available()
    args.steps = args.steps or (1 if args.dry_run else 10)
    args.warmup = (0 if args.dry_run else 3) if args.warmup is None else args.warmup
    args.micro_batch_size = args.micro_batch_size or (2 if args.dry_run else 8)
    args.seq = 64 if args.dry_run else SEQ
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.time()
    report = {"dry_run": args.dry_run, "complete": False, "environment": environment(), "parts": {}}
    path = out / "gpu_report.json"

    def save():
        report["elapsed_s"] = round(time.time() - t0, 1)
        path.write_text(json.dumps(report, indent=2, default=str))

    save()
    env = report["environment"]
    parts = report["parts"]
    parts["wheelhouse"] = wheelhouse_check()
    save()
    parts["gpu_tests"] = (
        {"ran": False, "reason": "--skip-tests"} if args.skip_tests else run_gpu_tests(out, BUDGET_S["gpu_tests"])
    )
    save()
    sets = TINY if args.dry_run else []
    dense = dense_equal_flops(sets, args.seq, args.micro_batch_size)
    parts["throughput_bf16"] = throughput(out, args, dense, fp8=False)
    save()
    if env["transformer_engine"] and env.get("capability", [0])[0:2] >= [8, 9]:
        parts["throughput_fp8"] = throughput(out, args, dense, fp8=True)
    else:
        parts["throughput_fp8"] = {"ran": False, "reason": "needs Transformer Engine on a GPU with FP8 (8.9+)"}
    report["goals"] = goals(report)
    report["complete"] = True
    save()
    print(json.dumps({k: report[k] for k in ("environment", "goals", "elapsed_s")}, indent=2, default=str))
    print(f"wrote {path}")
    tests = parts["gpu_tests"]
    failed = bool(tests.get("failed")) or "error" in tests or bool(parts["wheelhouse"]["missing"])
    failed |= any(
        "error" in r
        for p in ("throughput_bf16", "throughput_fp8")
        for key in ("runs", "breakdown")
        for r in parts[p].get(key, {}).values()
        if isinstance(r, dict)
    )
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
