"""Memory estimate (``megatron-lol memory``) against the measured peak of the same layouts on CPU.

    python bench/memory.py [--config examples/configs/tiny-cpu.yaml] [--steps 3] [--layouts NAME ...]

For each layout, ``torchrun`` starts the ranks; every rank imports what training
uses, initialises its process group, then records its resident memory (the
baseline: Python, torch, megatron-core, the process group), resets the kernel's
peak-RSS counter (``/proc/self/clear_refs``) and builds the trainer of the
config (synthetic tokens, so no dataset index is read; the full core depth from
the first step) and runs ``--steps`` training steps. glibc is told to return
freed blocks of 64 KiB and more at once (``MALLOC_MMAP_THRESHOLD_=65536``), so
the peak RSS follows the live tensors rather than what the heap keeps. Measured =
peak RSS (``VmHWM``) minus the baseline, the largest over the ranks of each
pipeline stage: it also holds what the run allocates besides tensors (autograd
and kernel caches, small objects: 40-50 MiB here, after the first step); estimated =
:func:`megatron_lol.perf.memory.rank_memory` for that stage. The table prints both
and their ratio, per layout and stage. Linux only (``/proc``).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

# name: (processes, --set overrides)
LAYOUTS = {
    "1 process": (1, {}),
    "TP=2": (2, {"parallel.tensor_model_parallel_size": 2}),
    "TP=2 + SP": (2, {"parallel.tensor_model_parallel_size": 2, "parallel.sequence_parallel": True}),
    "PP=2": (2, {"parallel.pipeline_model_parallel_size": 2}),
    "DP=2, distributed optimizer": (2, {"parallel.use_distributed_optimizer": True, "training.global_batch_size": 16}),
    "1 process, recompute full": (1, {"parallel.recompute_granularity": "full"}),
    "1 process, adam": (1, {"optimizer.name": "adam"}),
}
VOCAB = 8000  # the quickstart tokenizer's


def _overrides(overrides: dict) -> list:
    """The layout's settings, the vocabulary, and the full core depth from the first step (the
    growing curriculum would start shallower; the estimate is the run's peak, at full depth)."""
    return [(k, v, "bench") for k, v in overrides.items()] + [
        ("model.vocab_size", VOCAB, "bench"),
        ("curriculum.initial_depth", None, "bench"),
    ]


def _status(key: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"/proc/self/status has no {key}")


def worker(config: str, overrides: dict, steps: int, out_dir: str) -> None:
    """One rank (under torchrun): baseline, reset peak, build and train, write the measurement."""
    import gc

    import megatron.core.distributed  # noqa: F401
    import megatron.core.optimizer  # noqa: F401
    import megatron.core.pipeline_parallel  # noqa: F401
    import torch  # noqa: F401 - imported before the baseline on purpose

    import megatron_lol.model.lol_model  # noqa: F401
    from megatron_lol.config import load_config
    from megatron_lol.platform import init_distributed, setup_platform
    from megatron_lol.training.muon_compat import load_megatron_muon
    from megatron_lol.training.profile import SyntheticDataset, _StubTokenizer
    from megatron_lol.training.trainer import Trainer

    cfg = load_config(config, _overrides(overrides), check_data=False)
    if cfg.optimizer.name == "muon":
        load_megatron_muon()
    setup_platform()
    init_distributed()
    gc.collect()
    baseline = _status("VmRSS")
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # reset VmHWM to the current RSS
    tok = _StubTokenizer(VOCAB, eod=2)
    data = SyntheticDataset(cfg.training.seq_length, VOCAB, 2, seed=cfg.training.seed)
    trainer = Trainer(cfg, tokenizer=tok, datasets=(data, None, None)).setup()
    it = trainer.data_iterator(trainer.train_ds, 0)
    for _ in range(steps):
        trainer.train_step(it)
    from megatron.core import parallel_state

    rank = torch.distributed.get_rank()
    record = {
        "rank": rank,
        "pp_rank": parallel_state.get_pipeline_model_parallel_rank(),
        "baseline": baseline,
        "peak": _status("VmHWM"),
        "vocab": trainer.vocab_size,
    }
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(record, f)


def measure(config: str, nproc: int, overrides: dict, steps: int) -> list:
    with tempfile.TemporaryDirectory() as out:
        # glibc returns freed blocks of 64 KiB and more to the system at once, so the peak RSS follows the
        # live tensors instead of what the heap keeps after freeing them
        env = dict(
            os.environ,
            OMP_NUM_THREADS="1",
            PYTHONWARNINGS="ignore",
            MALLOC_MMAP_THRESHOLD_="65536",
            PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""),
        )
        for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
            env.pop(k, None)
        cmd = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nproc-per-node",
            str(nproc),
            "--master-addr",
            "127.0.0.1",
            "--master-port",
            str(_free_port()),
            __file__,
            "--worker",
            json.dumps({"config": config, "overrides": overrides, "steps": steps, "out": out}),
        ]
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, cwd=REPO)
        if proc.returncode:
            raise RuntimeError(f"{overrides}: exit {proc.returncode}\n{proc.stderr[-3000:]}")
        return [json.load(open(os.path.join(out, f))) for f in sorted(os.listdir(out))]


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
    p.add_argument("--config", default=os.path.join(REPO, "examples", "configs", "tiny-cpu.yaml"))
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--layouts", nargs="+", default=list(LAYOUTS), choices=list(LAYOUTS))
    p.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        spec = json.loads(args.worker)
        worker(spec["config"], spec["overrides"], spec["steps"], spec["out"])
        return
    from megatron_lol.config import load_config
    from megatron_lol.perf.memory import Layout, rank_memory

    print(
        f"{args.config}, {args.steps} steps, synthetic tokens (vocab {VOCAB}); MiB per rank; measured = peak RSS "
        f"minus the RSS after imports and process-group start"
    )
    print(f"{'layout':<30} {'stage':>5} {'estimated':>10} {'measured':>10} {'est/meas':>9}   estimate parts")
    for name in args.layouts:
        nproc, overrides = LAYOUTS[name]
        records = measure(args.config, nproc, overrides, args.steps)
        cfg = load_config(args.config, _overrides(overrides), check_data=False)
        layout = Layout.of(cfg, nproc)
        for stage in sorted({r["pp_rank"] for r in records}):
            measured = max(r["peak"] - r["baseline"] for r in records if r["pp_rank"] == stage)
            est = rank_memory(cfg, records[0]["vocab"], layout, stage)
            parts = ", ".join(
                f"{k} {v / 2**20:.0f}"
                for k, v in est.to_dict().items()
                if k in ("weights", "gradients", "optimizer", "activations", "logits", "backward")
            )
            print(
                f"{name:<30} {stage:>5} {est.total / 2**20:>10.1f} {measured / 2**20:>10.1f} "
                f"{est.total / measured:>9.2f}   {parts}",
                flush=True,
            )


if __name__ == "__main__":
    main()
