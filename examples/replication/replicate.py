"""Small replications of the papers' findings on the bundled corpus, one command per study.

    python examples/replication/replicate.py STUDY [--size full|smoke] [--out DIR] [--jobs N]

A study is a set of arms (config overrides of ``examples/configs/tiny-cpu.yaml``) trained
at one FLOP budget (``training.train_flops``: the trainer derives each arm's iterations
from the FLOP model, growth included), over a few seeds, and a criterion written down
before any run (docs/replication.md). Each arm is a plain ``megatron-lol train``
subprocess; the results are read from its ``metrics.jsonl`` (the last validation record)
and written to ``OUT/results.json`` with the verdict, plus ``OUT/STUDY.png``.

``--size smoke`` runs every arm for two iterations at a tiny shape (what CI runs: the
whole pipeline, not the findings); ``--size full`` is the measured run whose tables
are in docs/replication.md.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Optional

import path_forcing

REPO = Path(__file__).resolve().parents[2]
BASE_CONFIG = REPO / "examples" / "configs" / "tiny-cpu.yaml"

# the plan keys of tiny-cpu.yaml that other plans refuse


@dataclass
class Arm:
    """One configuration of a study: ``sets`` are ``--set KEY=VALUE`` overrides of the base config."""

    name: str
    sets: dict = field(default_factory=dict)


@dataclass
class Study:
    name: str
    question: str
    criterion: str  # written before the runs; judged by ``verdict``
    arms: list
    reference: str  # the arm whose FLOPs at ``full_iters`` set the budget of every arm
    full_iters: int
    seeds: tuple
    verdict: Callable[[dict], dict]
    # a study with its own task: ``prepare(out_dir, examples, seed)`` builds the data and returns the
    # config overrides that point at it; ``evaluate`` (a script: SAVE PROMPTS SEED -> JSON) scores a run
    prepare: Optional[Callable[[Path, int, int], dict]] = None
    evaluate: Optional[Path] = None


# ------------------------------------------------------------------ verdicts
def _spread(values: list) -> float:
    return max(values) - min(values) if len(values) > 1 else 0.0


def _summary(results: dict, arm: str, key: str = "eval_loss") -> dict:
    values = [r[key] for r in results[arm]]
    return {"mean": statistics.fmean(values), "spread": _spread(values), "values": values}


def _below(results: dict, better: str, worse: str) -> dict:
    """``better``'s mean loss below ``worse``'s by more than both arms' seed spreads (max - min)."""
    a, b = _summary(results, better), _summary(results, worse)
    margin = b["mean"] - a["mean"]
    return {
        "claim": f"{better} < {worse}",
        "margin": margin,
        "spread": max(a["spread"], b["spread"]),
        "holds": margin > max(a["spread"], b["spread"]),
    }


def lol_verdict(results: dict) -> dict:
    checks = [_below(results, "lol", other) for other in ("dense", "looped", "lol-fixed-route")]
    return {"checks": checks, "holds": all(c["holds"] for c in checks)}


def foil_verdict(results: dict) -> dict:
    deep, flat = _below(results, "foil-untied", "foil-tied"), _below(results, "foil-flat-untied", "foil-flat-tied")
    more = flat["margin"] > deep["margin"]
    return {
        "checks": [deep, flat, {"claim": "the gain is larger at the flatter shape", "holds": more}],
        "holds": deep["holds"] and flat["holds"] and more,
    }


def forcing_verdict(results: dict) -> dict:
    """Forcing a strategy's mode path produces that strategy on most prompts (chance: 1 in 4), in every seed."""
    runs = results["lol-strategy"]
    adherence = [statistics.fmean(r["evaluation"]["forced_adherence"].values()) for r in runs]
    learned = [statistics.fmean(r["evaluation"]["routed_accuracy"].values()) for r in runs]
    return {
        "adherence": adherence,
        "routed_accuracy": learned,
        "checks": [
            {
                "claim": "with the strategy token the model does the task (mean accuracy >= 0.5)",
                "holds": min(learned) >= 0.5,
            },
            {
                "claim": "forcing a strategy's mode path produces that strategy (mean adherence >= 0.5)",
                "holds": min(adherence) >= 0.5,
            },
        ],
        "holds": min(learned) >= 0.5 and min(adherence) >= 0.5,
    }


def accordion_verdict(results: dict) -> dict:
    """Monotone within the seed spread, and saturating: the middle budget recovers >= half the largest's gain."""
    budgets = sorted(results["accordion"][0]["eval_loss_by_budget"], key=int)
    curve = {k: [r["eval_loss_by_budget"][k] for r in results["accordion"]] for k in budgets}
    means = {k: statistics.fmean(v) for k, v in curve.items()}
    spread = max(_spread(v) for v in curve.values())
    monotone = all(means[b] <= means[a] + spread for a, b in zip(budgets, budgets[1:]))
    low, mid, high = budgets[0], budgets[len(budgets) // 2], budgets[-1]
    gain = means[low] - means[high]
    recovered = (means[low] - means[mid]) / gain if gain > 0 else float("nan")
    return {
        "curve": means,
        "spread": spread,
        "checks": [
            {"claim": "loss does not rise with the budget (within the seed spread)", "holds": monotone},
            {"claim": "the largest budget improves on k=0", "holds": gain > spread, "margin": gain},
            {
                "claim": f"budget {mid} recovers >= half of budget {high}'s gain",
                "holds": recovered >= 0.5,
                "fraction": recovered,
            },
        ],
        "holds": monotone and gain > spread and recovered >= 0.5,
    }


# ------------------------------------------------------------------ studies
_MOE = {
    "model.moe.layers": "all",
    "model.moe.num_experts": 4,
    "model.moe.router_topk": 2,
    "model.moe.ffn_hidden_size": 192,
}

STUDIES = {
    "lol-vs-dense": Study(
        name="lol-vs-dense",
        question="Does LoL beat dense and looped models of the same executed layers at matched training FLOPs, "
        "and does its input-dependent route beat the same library on a learned input-independent route?",
        criterion="LoL's mean final validation loss is below each other arm's by more than the larger seed "
        "spread (max - min over the seeds) of the two.",
        arms=[
            Arm("lol"),
            Arm("lol-fixed-route", {"model.plan.routing.router_input": "depth"}),
            Arm("dense", {"model.plan": "{kind: dense, layers: 4}"}),
            Arm("looped", {"model.plan": "{kind: looped, layers: 2, loops: 2}"}),
        ],
        reference="lol",
        full_iters=200,
        seeds=(1, 2, 3),
        verdict=lol_verdict,
    ),
    "foil-untied": Study(
        name="foil-untied",
        question="Does untying attention per pass lower Foil's loss at equal FLOPs, and more so at a flatter shape "
        "(fewer layers, more passes)?",
        criterion="Untied below tied by more than the seed spread at both shapes, and the margin larger at the "
        "flatter shape (2 layers x 4 passes) than at 4 layers x 2 passes.",
        arms=[
            Arm(
                f"foil{tag}-{tie}",
                {
                    **_MOE,
                    "curriculum.initial_depth": "null",
                    "model.plan": f"{{kind: foil, experts: 4, layers: {layers}, loops: {loops}, "
                    f"untie_attention: {str(tie == 'untied').lower()}}}",
                },
            )
            for tag, layers, loops in (("", 4, 2), ("-flat", 2, 4))
            for tie in ("tied", "untied")
        ],
        reference="foil-tied",
        full_iters=100,
        seeds=(1, 2),
        verdict=foil_verdict,
    ),
    "accordion-budgets": Study(
        name="accordion-budgets",
        question="Trained jointly over loop budgets, is a small Accordion model's loss-vs-budget curve monotone "
        "and saturating?",
        criterion="Validation loss does not rise with the budget beyond the seed spread; the largest budget is "
        "below k=0 by more than the spread; the middle budget recovers at least half of that gain.",
        arms=[
            Arm(
                "accordion",
                {
                    **_MOE,
                    "curriculum.initial_depth": "null",
                    "model.plan": "{kind: accordion, window: 4, budgets: [0, 1, 2, 3, 4]}",
                    "model.moe.shared_expert_intermediate_size": 192,
                },
            ),
        ],
        reference="accordion",
        full_iters=300,
        seeds=(1, 2),
        verdict=accordion_verdict,
    ),
    "path-forcing": Study(
        name="path-forcing",
        question="With the strategy visible to the router only, does forcing a strategy's mode path make the "
        "model produce that strategy (the papers' sudoku / maze forcing study in miniature)?",
        criterion="With its strategy token the model produces the requested strategy on at least half the "
        "prompts, and forcing each strategy's mode path (strategy slot filled with the filler) produces that "
        "strategy on at least half the prompts (chance: a quarter), in every seed.",
        arms=[
            Arm(
                "lol-strategy",
                {
                    "model.plan.windows.size": 16,
                    "model.plan.windows.shift": 8,
                    "training.seq_length": 64,
                    "training.micro_batch_size": 16,
                    "training.global_batch_size": 16,
                },
            ),
        ],
        reference="lol-strategy",
        full_iters=1000,
        seeds=(1, 2),
        verdict=forcing_verdict,
        prepare=path_forcing.build_task,
        evaluate=Path(path_forcing.__file__),
    ),
}

# a shape that trains two iterations in seconds: the pipeline, not the finding
SMOKE_SETS = {
    "model.hidden_size": 32,
    "model.ffn_hidden_size": 64,
    "model.plan.windows.size": 8,
    "model.plan.windows.shift": 4,
    "training.seq_length": 32,
    "training.micro_batch_size": 2,
    "training.global_batch_size": 2,
    "training.eval_interval": 2,
    "training.eval_iters": 1,
    "training.log_interval": 1,
    "optimizer.lr_warmup_iters": 1,
}


def smoke_sets(sets: dict) -> dict:
    """:data:`SMOKE_SETS` for an arm with ``sets``: the small windows only where its plan kind has
    windows (``model.plan.windows``; accordion has none, and refuses the key)."""
    import yaml

    from megatron_lol.plan import PLANS

    plan = sets.get("model.plan")
    kind = yaml.safe_load(plan)["kind"] if plan else "lol"  # tiny-cpu.yaml's plan
    windowed = "windows" in {f.name for f in dataclasses.fields(PLANS[kind].Options)}
    return {k: v for k, v in SMOKE_SETS.items() if windowed or not k.startswith("model.plan.windows.")}


# ------------------------------------------------------------------ running
def argv_sets(sets: dict) -> list:
    out = []
    for key, value in sets.items():
        text = json.dumps(value) if isinstance(value, bool) else str(value)
        out += ["--set", f"{key}={text}"]
    return out


def _cli(*args) -> list:
    return [sys.executable, "-m", "megatron_lol", *args]


# a launcher's rendezvous settings in this process's environment (a torchrun shell, a test process that
# initialised torch.distributed) would make every run rendezvous on one port: each run is a lone process
_LAUNCHER_ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def _env() -> dict:
    env = {k: v for k, v in os.environ.items() if k not in _LAUNCHER_ENV}
    return dict(env, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", PYTHONWARNINGS="ignore")


def flop_budget(study: Study, smoke: bool, config: Path, task: Optional[dict] = None) -> float:
    """Training FLOPs of the reference arm at ``full_iters`` (2 when smoke), from ``megatron-lol params``."""
    arm = next(a for a in study.arms if a.name == study.reference)
    sets = {**arm.sets, **(task or {}), **(smoke_sets(arm.sets) if smoke else {})}
    sets["training.train_iters"] = 2 if smoke else study.full_iters
    proc = subprocess.run(
        _cli("params", "--config", str(config), *argv_sets(sets), "--json"),
        capture_output=True,
        text=True,
        env=_env(),
        cwd=REPO,
        check=False,
    )
    if proc.returncode != 0:
        raise SystemExit(f"replicate: megatron-lol params failed for {study.reference}: {proc.stderr.strip()}")
    return float(json.loads(proc.stdout)["training"]["training_flops"])


def last_validation(metrics: Path) -> dict:
    """The last ``metrics.jsonl`` record with a validation loss (the run's final evaluation)."""
    found = None
    with open(metrics) as f:
        for line in f:
            record = json.loads(line)
            if "eval_loss" in record:
                found = record
    if found is None:
        raise SystemExit(f"replicate: {metrics}: no validation record (did the run evaluate?)")
    return found


def train_arm(study: Study, arm: Arm, seed: int, budget: float, args) -> dict:
    save = Path(args.out) / f"{arm.name}-seed{seed}"
    sets = {**arm.sets, **args.task, **(smoke_sets(arm.sets) if args.size == "smoke" else {})}
    sets.update({"training.train_flops": budget, "training.train_iters": "null", "training.save_interval": "null"})
    # each run its own dataset index cache: runs trained at once (--jobs) would build the same files together
    sets["data.cache_dir"] = str(save / "data_cache")
    cmd = _cli(
        "train",
        "--config",
        str(args.config),
        *argv_sets(sets),
        "--seed",
        str(seed),
        "--save",
        str(save),
        "--threads",
        "1",
    )
    start = time.time()
    with open(Path(args.out) / f"{arm.name}-seed{seed}.log", "w") as log:
        proc = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, env=_env(), cwd=REPO, check=False)
    if proc.returncode != 0:
        raise SystemExit(f"replicate: arm {arm.name} seed {seed} failed (exit {proc.returncode}); see {log.name}")
    record = last_validation(save / "metrics.jsonl")
    evaluation = None
    if study.evaluate is not None:
        prompts = "4" if args.size == "smoke" else "100"
        proc = subprocess.run(
            [sys.executable, str(study.evaluate), str(save), prompts, str(seed + 1000)],
            capture_output=True,
            text=True,
            env=_env(),
            cwd=REPO,
            check=False,
        )
        if proc.returncode != 0:
            raise SystemExit(f"replicate: evaluating {save} failed: {proc.stderr.strip()[-2000:]}")
        evaluation = json.loads(proc.stdout.strip().splitlines()[-1])
    return {
        "arm": arm.name,
        "seed": seed,
        "iterations": record["step"],
        "eval_loss": record["eval_loss"],
        "eval_loss_by_budget": record.get("eval_loss_by_budget"),
        "wall_s": round(time.time() - start, 1),
        **({"evaluation": evaluation} if evaluation is not None else {}),
    }


def plot(study: Study, results: dict, out: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.5))
    if study.name == "path-forcing":  # one confusion matrix per seed
        plt.close(fig)
        runs = results["lol-strategy"]
        names = list(path_forcing.STRATEGIES)
        fig, axes = plt.subplots(1, len(runs), figsize=(4.5 * len(runs), 3.5), squeeze=False)
        for ax, run in zip(axes[0], runs):
            confusion = run["evaluation"]["forced_confusion"]
            ax.imshow([[confusion[s][t] for t in names + ["none"]] for s in names], cmap="Blues", vmin=0)
            ax.set_xticks(range(len(names) + 1), names + ["none"], fontsize=8)
            ax.set_yticks(range(len(names)), names, fontsize=8)
            ax.set_xlabel("produced strategy")
            ax.set_ylabel("forced mode path")
            ax.set_title(f"seed {run['seed']}")
        fig.tight_layout()
        path = out / f"{study.name}.png"
        fig.savefig(path, dpi=120)
        plt.close(fig)
        return path
    if study.name == "accordion-budgets":
        for r in results["accordion"]:
            ks = sorted(r["eval_loss_by_budget"], key=int)
            ax.plot([int(k) for k in ks], [r["eval_loss_by_budget"][k] for k in ks], "o-", label=f"seed {r['seed']}")
        ax.set_xlabel("loop budget k")
    else:
        for i, arm in enumerate(results):
            values = [r["eval_loss"] for r in results[arm]]
            ax.scatter([i] * len(values), values)
        ax.set_xticks(range(len(results)), list(results), rotation=15)
    ax.set_ylabel("final validation loss")
    ax.set_title(study.name)
    if study.name == "accordion-budgets":
        ax.legend()
    fig.tight_layout()
    path = out / f"{study.name}.png"
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("study", choices=sorted(STUDIES))
    parser.add_argument("--size", choices=("full", "smoke"), default="full")
    parser.add_argument("--out", default=None, help="results directory (default runs/replication/STUDY)")
    parser.add_argument("--config", type=Path, default=BASE_CONFIG, help="base config (the bundled corpus)")
    parser.add_argument("--seeds", type=int, nargs="+", default=None, help="default: the study's")
    parser.add_argument("--jobs", type=int, default=1, help="arms trained at once (one thread each)")
    parser.add_argument("--iters", type=int, default=None, help="the reference arm's iterations (default: the study's)")
    args = parser.parse_args(argv)
    study = STUDIES[args.study]
    if args.iters is not None:
        study = dataclasses.replace(study, full_iters=args.iters)
    args.out = args.out or str(REPO / "runs" / "replication" / study.name)
    Path(args.out).mkdir(parents=True, exist_ok=True)
    seeds = args.seeds or (study.seeds[:1] if args.size == "smoke" else study.seeds)
    args.task = {}
    if study.prepare is not None:
        args.task = study.prepare(Path(args.out) / "task", 400 if args.size == "smoke" else 20_000, 0)
    budget = flop_budget(study, args.size == "smoke", args.config, args.task)
    print(
        f"{study.name}: {len(study.arms)} arm(s) x {len(seeds)} seed(s) at {budget:.4g} training FLOPs each", flush=True
    )
    todo = [(arm, seed) for seed in seeds for arm in study.arms]
    with ThreadPoolExecutor(max(1, args.jobs)) as pool:
        runs = list(pool.map(lambda job: train_arm(study, job[0], job[1], budget, args), todo))
    results: dict = {}
    for run in runs:
        results.setdefault(run["arm"], []).append(run)
        print(
            f"  {run['arm']:<20} seed {run['seed']}  iterations {run['iterations']:>5}  "
            f"eval loss {run['eval_loss']:.4f}  ({run['wall_s']} s)",
            flush=True,
        )
    verdict = study.verdict(results)
    report = {
        "study": study.name,
        "size": args.size,
        "question": study.question,
        "criterion": study.criterion,
        "train_flops": budget,
        "reference_iters": study.full_iters,
        "seeds": list(seeds),
        "command": " ".join(["python", "examples/replication/replicate.py", *(argv or sys.argv[1:])]),
        "results": results,
        "verdict": verdict,
    }
    out = Path(args.out)
    (out / "results.json").write_text(json.dumps(report, indent=1))
    figure = plot(study, results, out)
    for check in verdict["checks"]:
        print(f"  {'holds' if check['holds'] else 'fails'}: {check['claim']}")
    print(f"{study.name}: criterion {'met' if verdict['holds'] else 'not met'}; {out / 'results.json'}, {figure}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
