"""What a process of this package pays before its first step: the imports, against named baselines.

    python bench/startup.py [--repeats 5]

Every figure is a fresh interpreter, timed from outside (CPU seconds of the
child from ``getrusage``, and wall seconds); the table gives the median of
``--repeats`` runs, each pair run in turn so that the machine's drift hits both:

* ``import megatron.core`` as installed (the baseline), against the same import
  in a process of this package, where :mod:`megatron_lol.megatron_import` runs it
  without megatron's ``torch.compile``'d fusions (no CUDA here) and without wandb;
* the Manager that carries the results of megatron's checkpoint writers (a
  spawned interpreter), started and handed one save's results by a process that
  has imported torch, torch.distributed.checkpoint and megatron-core as a
  training process has: megatron-core's own ``_get_write_results_queue()`` as the
  baseline, against
  :func:`megatron_lol.training.checkpointing.writer_manager.prepare_writer_processes`.
"""

from __future__ import annotations

import argparse
import os
import resource
import statistics
import subprocess
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

_SAVE_RESULTS = (
    "import megatron_lol; from torch.distributed.checkpoint.metadata import MetadataIndex; "
    "from torch.distributed.checkpoint.storage import WriteResult; "
    "from megatron.core.dist_checkpointing.strategies import filesystem_async as fa; "
    "{start}; q = fa._results_queue; "
    "q.put({{0: [WriteResult(MetadataIndex('w', (0,)), 8, None)]}}); q.get_nowait()"
)

PAIRS = (
    (
        "import megatron.core",
        "import megatron.core  # as installed",
        "import megatron_lol, megatron.core  # this package's process",
    ),
    (
        "writer Manager: start, one save's results",
        _SAVE_RESULTS.format(start="fa._results_queue = fa._get_write_results_queue()"),
        _SAVE_RESULTS.format(
            start="from megatron_lol.training.checkpointing import writer_manager as wm; wm.prepare_writer_processes()"
        ),
    ),
)


def _run(code: str) -> tuple[float, float]:
    """(CPU seconds, wall seconds) of ``python -c code``."""
    env = dict(os.environ, PYTHONWARNINGS="ignore", OMP_NUM_THREADS="1")
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.perf_counter()
    subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env, check=True)
    wall = time.perf_counter() - t0
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return cpu, wall


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5, help="runs of each command (median reported)")
    args = parser.parse_args()
    print(f"{'what':<40} {'baseline CPU s':>14} {'ours CPU s':>10} {'baseline wall s':>15} {'ours wall s':>11}")
    for label, baseline, ours in PAIRS:
        _run(baseline), _run(ours)  # warm the page cache
        runs = {baseline: [], ours: []}
        for _ in range(args.repeats):
            for code in (baseline, ours):
                runs[code].append(_run(code))
        med = {code: [statistics.median(x[i] for x in runs[code]) for i in (0, 1)] for code in runs}
        print(
            f"{label:<40} {med[baseline][0]:>14.2f} {med[ours][0]:>10.2f} {med[baseline][1]:>15.2f} "
            f"{med[ours][1]:>11.2f}"
        )
    print(f"baselines: megatron-core as installed, and its own results queue; median of {args.repeats} runs")


if __name__ == "__main__":
    main()
