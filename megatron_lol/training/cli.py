"""``megatron-lol train``: pretrain from a YAML config (and Megatron-LM-style flags).

Launch with ``torchrun --nproc-per-node N -m megatron_lol train --config ...``
(or the console script); the backend (gloo on CPU, NCCL on GPU) follows the device.

``--dry-run`` checks what the run checks before its first step and exits
without importing torch or creating a file: every key, the parallel layout
against ``WORLD_SIZE``, the batch sizes, the tokenizer built as the run builds it
(its type against the files given; a Hub name from the Hub cache, offline under
``HF_HUB_OFFLINE=1``), every dataset's ``.idx`` against its ``.bin``, the
checkpoint ``--load`` / ``--save`` will start from and a writable save directory
(:mod:`megatron_lol.training.preflight`). ``slurm/submit_pipeline.sh`` runs it for
every stage before it submits anything. ``--dry-run=config`` skips the data files
and the checkpoint to load (a pipeline builds them later).

The preemption handlers are installed before anything else, so a SIGUSR1 that
arrives during start-up is honoured at the first step boundary; every exit
status other than 0 is also recorded for the Slurm scripts
(:mod:`megatron_lol.training.runtime`).
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Optional

from megatron_lol.config import add_config_arguments, config_from_args
from megatron_lol.config.loader import add_threads_argument, overrides_from_args
from megatron_lol.errors import CliError, ConfigError
from megatron_lol.training.hooks import NO_FAULTS, FaultHooks
from megatron_lol.training.runtime import STALL_EXIT


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_config_arguments(parser)
    add_threads_argument(parser)
    parser.add_argument(
        "--dry-run",
        nargs="?",
        const="all",
        default=None,
        choices=("all", "config"),
        help="check what the run checks and exit: the config, the layout against WORLD_SIZE, the "
        "tokenizer, the datasets, the checkpoint to load, the save directory (=config: not the data "
        "files or the checkpoint to load)",
    )


def _rank0() -> bool:
    return os.environ.get("RANK", "0") == "0"


def run(args: argparse.Namespace, *, faults: Optional[FaultHooks] = None) -> int:
    """``faults``: a test's injected faults (``tests/fault_rank_runner.py``); production passes none."""
    from megatron_lol.training import signals
    from megatron_lol.training.runtime import record_exit

    signals.install_handlers()  # before the slow part: a signal during start-up is kept for the first step
    try:
        code, message = _run(args, faults or NO_FAULTS)
    except CliError as err:
        message = str(err)
        if isinstance(err, ConfigError):
            from megatron_lol.config.loader import name_flag

            message = name_flag(message)  # as rank 0 prints it
        record_exit(2, f"megatron-lol train: error: {message}")
        raise
    except Exception as err:
        first = (str(err).strip().splitlines() or [""])[0]
        record_exit(1, f"megatron-lol train: {type(err).__name__}: {first}")
        raise
    record_exit(code, message)
    return code


def _run(args: argparse.Namespace, faults: FaultHooks) -> tuple[int, str]:
    check_data = args.dry_run != "config"
    # validates everything before any process group work
    if args.use_checkpoint_args:
        from megatron_lol.training.checkpoint_args import config_with_checkpoint_args  # torch: only when used

        cfg = config_with_checkpoint_args(args.config, overrides_from_args(args), check_data=check_data)
    else:
        cfg = config_from_args(args, check_data=check_data)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    dp = cfg.parallel.data_parallel_size(world)  # layout vs world size
    if args.dry_run:
        return _dry_run(cfg, world, dp, check_data), ""
    from megatron_lol.training.preflight import check_checkpoints

    # the checkpoint to start from and the save directory, decided before anything is created (the dry
    # run's check): a --load that names no checkpoint stops here, leaving no save directory or lock behind
    check_checkpoints(cfg.training)
    from megatron_lol.training.console import announce_startup

    announce_startup(cfg, args.config or "(--use-checkpoint-args)")  # before the heavy imports (megatron-core: 5-25 s)
    from megatron_lol.log import log_rank0
    from megatron_lol.training.runtime import apply_threads

    threads, why = apply_threads(args.threads)
    from megatron_lol.training.trainer import Trainer

    trainer = Trainer(cfg, faults=faults).setup()
    log_rank0(f"threads: {threads} per process ({why})")
    return train_to_exit(trainer)


def train_to_exit(trainer) -> tuple[int, str]:
    """Run the training loop; ``(exit status, one-line message)`` of how it ended: 0, 3 (non-finite loss),
    4 (tensor-parallel ranks routed differently: every rank of the group stops at the same depth), 5 (a rank
    died: a collective lost its peer and the heartbeat names who) or the status a callback stopped with
    (85: saved for a requeue)."""
    from megatron_lol.log import log_rank0
    from megatron_lol.parallel.routing_agreement import RoutingDisagreement

    try:
        outcome = trainer.train()
        trainer.stop_heartbeat()
    except FloatingPointError as err:  # every rank stops alike (as below): none is left to watch
        trainer.stop_heartbeat()
        log_rank0(f"megatron-lol train: error: {err}")
        return 3, f"megatron-lol train: error: {err}"
    except RoutingDisagreement as err:
        trainer.stop_heartbeat()
        log_rank0(f"megatron-lol train: error: {err}")
        return 4, f"megatron-lol train: error: {err}"
    except RuntimeError as err:
        line = _lost_peer(trainer, err)
        if line is None:
            raise
        print(line, file=sys.stderr, flush=True)
        return STALL_EXIT, line
    if outcome.exit_code:
        return outcome.exit_code, (
            f"megatron-lol train: saved iteration {trainer.iteration} before stopping "
            f"({outcome.reason}, status {outcome.exit_code}): relaunch to continue"
        )
    return 0, ""


def _lost_peer(trainer, err: RuntimeError) -> str | None:
    """A collective that failed because a peer closed its connection (gloo: a rank died) becomes one line
    naming the rank(s) whose heartbeat stopped, instead of a traceback on every rank; None otherwise."""
    heartbeat = getattr(trainer, "heartbeat", None)
    if heartbeat is None or "peer" not in str(err).lower():
        return None
    lost = heartbeat.lost_ranks()
    if lost is None:
        return None
    first = (str(err).strip().splitlines() or [""])[0]
    return f"megatron-lol train: error: {lost} ({first[:160]}); rank {heartbeat.rank} stops (status {STALL_EXIT})"


def _dry_run(cfg, world: int, dp: int, check_data: bool) -> int:
    """What the run checks before its first step, without torch or process groups
    (:mod:`megatron_lol.training.preflight`, the same functions the trainer calls)."""
    from megatron_lol.training.preflight import check_checkpoints, check_datasets, config_tokenizer

    tr, d = cfg.training, cfg.data
    if not check_data:
        d.validate(check_files=False)
    gbs = tr.global_batch_size or tr.micro_batch_size * dp
    if gbs % (tr.micro_batch_size * dp):
        raise ConfigError(
            f"training.global_batch_size: {gbs} is not a multiple of micro_batch_size x "
            f"data_parallel_size = {tr.micro_batch_size * dp} (world size {world})"
        )
    tokenizer = config_tokenizer(d)  # as the trainer builds it: a Hub name offline under HF_HUB_OFFLINE=1
    headers = check_datasets(d) if check_data else []
    plan = check_checkpoints(tr, check_load=check_data)
    if tr.train_flops is not None:
        from megatron_lol.perf.budget import apply_flop_budget
        from megatron_lol.perf.params_cli import pad_vocab

        vocab = cfg.model.vocab_size or pad_vocab(tokenizer.vocab_size, cfg.model.make_vocab_size_divisible_by)
        apply_flop_budget(cfg, vocab)
    if _rank0():
        par = cfg.parallel
        if not check_data:
            start = "data files and --load not checked"
        elif plan is None:
            start = "starts from scratch"
        else:
            start = f"{'resumes' if plan.resume else 'starts from'} {plan.path}"
        tokens = sum(int(h.sequence_count) for h in headers)
        data = f"{len(headers)} dataset(s) of {tokens:,} sequences, " if headers else ""
        print(
            f"megatron-lol train: config OK: {cfg.model.execution_plan().name} model, world size {world} = TP "
            f"{par.tensor_model_parallel_size} x PP {par.pipeline_model_parallel_size} x DP {dp}, "
            f"{tr.train_iters} iterations of {gbs} x {tr.seq_length} tokens; tokenizer {d.tokenizer_type} "
            f"({tokenizer.vocab_size:,} tokens); {data}{start}",
            flush=True,
        )
    return 0
