"""Run a test function in N gloo processes (CPU) or N NCCL processes (CUDA).

Usage::

    from distributed import run_distributed, model_parallel

    def _check(scale):                      # module level: must be picklable
        import torch, torch.distributed as dist
        t = torch.ones(1) * (dist.get_rank() + 1) * scale
        dist.all_reduce(t)
        return t.item()                     # return values must be picklable

    def test_allreduce():
        assert run_distributed(_check, 2, 10.0) == [30.0, 30.0]

Every rank runs ``setup_platform()`` and ``init_distributed()`` (torchrun-style
environment: RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT) before
calling ``fn(*args, **kwargs)``. ``run_distributed`` returns the list of
per-rank return values, or raises :class:`DistributedTestError` carrying the
failing rank's traceback (the first rank to fail), or ``TimeoutError``.

Cost: each launch pays ~4 s of CPU for ``import megatron.core`` in every process, so
one launch should run many checks. Inside one launch, switch between parallel
layouts with :func:`model_parallel`, which tears down and re-initialises
megatron's ``parallel_state`` (and re-seeds the RNG tracker) for each layout::

    def _layouts():
        out = {}
        for tp, pp in [(2, 1), (1, 2)]:
            with model_parallel(tp=tp, pp=pp, seed=1):
                out[(tp, pp)] = run_one_step()
        return out

Ranks start from a ``forkserver`` that has imported torch and megatron-core
once (:data:`PRELOAD`): a rank is a fresh process forked from that clean
interpreter (no process group, no parallel state, never this test process), so it
costs milliseconds instead of the ~4 s of CPU that ``import megatron.core`` takes
in a new interpreter. Each rank gets this process's environment as it is at the
call (as ``spawn`` would give it). The function and its module must be importable by
name in the rank (``sys.path`` is inherited): test modules under ``tests/`` work
because pytest puts ``tests/`` on ``sys.path``.
"""

from __future__ import annotations

import contextlib
import os
import pickle
import queue as queue_mod
import socket
import time
import traceback
from typing import Any, Callable, Iterator

__all__ = ["run_distributed", "model_parallel", "DistributedTestError", "free_port", "rank_context"]

#: what the forkserver imports before it forks a rank: the start-up cost every rank would pay;
#: the package first, so that megatron-core imports as in its processes (megatron_lol/megatron_import.py)
PRELOAD = [
    "megatron_lol",
    "torch",
    "megatron.core",
    "megatron.core.models.gpt",
    "megatron.core.optimizer",
    "megatron.core.pipeline_parallel",
    "megatron.core.dist_checkpointing",
    "megatron_lol.platform",
    "megatron_lol.model.lol_model",
    "megatron_lol.training.trainer",
]


def rank_context():
    """The multiprocessing context ranks start from: a forkserver that preloaded :data:`PRELOAD`.

    The forkserver starts with this process's first call (paying the imports once per test process)
    and forks every later rank from its clean state."""
    import torch.multiprocessing as mp

    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(PRELOAD)
    return ctx


class DistributedTestError(RuntimeError):
    """A rank raised; ``rank`` and the remote ``remote_traceback`` are attached."""

    def __init__(self, rank: int, remote_traceback: str):
        super().__init__(f"rank {rank} failed:\n{remote_traceback}")
        self.rank = rank
        self.remote_traceback = remote_traceback


def free_port() -> int:
    """A currently free TCP port on localhost."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(
    rank: int, world_size: int, port: int, threads: int, fn: Callable, args: tuple, kwargs: dict, q: Any, env: dict
) -> None:
    """Entry point of one rank (a process forked from the forkserver)."""
    os.environ.clear()
    os.environ.update(env)  # the caller's environment at the call, not the forkserver's at its start
    os.environ.update(
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_WORLD_SIZE=str(world_size),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
    )
    try:
        import warnings

        warnings.filterwarnings("ignore", category=UserWarning)
        warnings.filterwarnings("ignore", category=DeprecationWarning)
        import torch

        torch.set_num_threads(threads)
        from megatron_lol.platform import init_distributed, setup_platform

        setup_platform()
        init_distributed()
        result = fn(*args, **kwargs)
        payload = pickle.dumps(result)
        q.put((rank, "ok", payload))
    except BaseException:  # noqa: BLE001 - report everything to the parent
        q.put((rank, "error", traceback.format_exc()))
        return
    try:
        import torch.distributed as dist

        with contextlib.suppress(Exception):
            from megatron.core import parallel_state as ps

            ps.destroy_model_parallel()
        if dist.is_initialized():
            dist.barrier()
            dist.destroy_process_group()
    except Exception:  # noqa: BLE001 - the result is already delivered
        pass


def run_distributed(
    fn: Callable,
    world_size: int,
    *args: Any,
    timeout: float = 120.0,
    threads_per_rank: int | None = None,
    **kwargs: Any,
) -> list:
    """Run ``fn(*args, **kwargs)`` on ``world_size`` spawned ranks; return per-rank results.

    ``fn`` must be a module-level function; arguments and return values must
    be picklable. ``timeout`` (seconds) bounds the whole launch; on timeout all
    ranks are killed and ``TimeoutError`` is raised. On the first rank error
    the other ranks are killed and :class:`DistributedTestError` is raised
    with that rank's traceback. ``threads_per_rank`` defaults to
    ``cpu_count // world_size`` (at least 1) so ranks do not oversubscribe.
    """
    ctx = rank_context()
    q = ctx.Queue()
    port = free_port()
    threads = threads_per_rank or max(1, (os.cpu_count() or 1) // world_size)
    procs = [
        ctx.Process(
            target=_worker, args=(r, world_size, port, threads, fn, args, kwargs, q, dict(os.environ)), daemon=True
        )
        for r in range(world_size)
    ]
    for p in procs:
        p.start()
    results: dict[int, Any] = {}
    deadline = time.monotonic() + timeout
    try:
        while len(results) < world_size:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise TimeoutError(
                    f"run_distributed({getattr(fn, '__name__', fn)}): ranks "
                    f"{sorted(set(range(world_size)) - set(results))} gave no result within {timeout:.0f} s"
                )
            try:
                rank, status, payload = q.get(timeout=min(remaining, 1.0))
            except queue_mod.Empty:
                dead = [r for r, p in enumerate(procs) if r not in results and p.exitcode is not None]
                if dead:
                    # Give a just-exited rank's message a moment to arrive.
                    try:
                        rank, status, payload = q.get(timeout=2.0)
                    except queue_mod.Empty:
                        raise DistributedTestError(
                            dead[0], f"process exited with code {procs[dead[0]].exitcode} without a result"
                        ) from None
                else:
                    continue
            if status == "error":
                raise DistributedTestError(rank, payload)
            results[rank] = pickle.loads(payload)
        for p in procs:
            p.join(timeout=max(1.0, min(10.0, deadline - time.monotonic())))
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join(timeout=5)
        q.close()
    return [results[r] for r in range(world_size)]


@contextlib.contextmanager
def model_parallel(
    tp: int = 1,
    pp: int = 1,
    vpp: int | None = None,
    cp: int = 1,
    ep: int = 1,
    etp: int | None = None,
    seed: int = 1234,
    **init_kwargs: Any,
) -> Iterator[None]:
    """Initialise megatron ``parallel_state`` for one layout, then tear it down.

    Destroys any existing model-parallel state first, calls
    ``initialize_model_parallel`` (extra ``init_kwargs`` are passed through),
    seeds torch and the RNG tracker with ``seed`` (``model_parallel_cuda_manual_seed``),
    and on exit destroys the state again, so the next layout starts clean.
    Also resets the microbatch calculator if one was set up.
    """
    import torch
    from megatron.core import parallel_state as ps
    from megatron.core import tensor_parallel

    ps.destroy_model_parallel()
    ps.initialize_model_parallel(
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp,
        virtual_pipeline_model_parallel_size=vpp,
        context_parallel_size=cp,
        expert_model_parallel_size=ep,
        expert_tensor_parallel_size=etp,
        **init_kwargs,
    )
    torch.manual_seed(seed)
    tensor_parallel.model_parallel_cuda_manual_seed(seed, force_reset_rng=True)
    try:
        yield
    finally:
        ps.destroy_model_parallel()
        with contextlib.suppress(Exception):
            from megatron.core import num_microbatches_calculator as nmc

            nmc.destroy_num_microbatches_calculator()
        with contextlib.suppress(Exception):
            from megatron.core.transformer.moe.moe_utils import clear_aux_losses_tracker

            clear_aux_losses_tracker()
