"""Profiler traces of training steps: Megatron-LM's ``--profile`` flags, and named ranges in the forward.

``train --profile --profile-step-start N --profile-step-end M [--profile-ranks R ...]``
profiles iterations ``N .. M-1`` (0-based, Megatron-LM's count) on the listed
global ranks (default 0):

* ``--use-pytorch-profiler`` (and always without CUDA): a ``torch.profiler``
  session whose schedule records exactly those iterations; each profiled rank
  writes one Chrome trace, ``trace-rank{R}-iter{N}-{M}.json``, into
  ``training.profile_dir`` (default ``--tensorboard-dir``, else
  ``<save>/profile``, else ``./profile``). Open it in Perfetto
  (https://ui.perfetto.dev) or ``chrome://tracing``;
* otherwise, on CUDA: an nsys capture range (``cudaProfilerStart`` /
  ``cudaProfilerStop``) around those iterations, with autograd's NVTX ranges
  (``emit_nvtx``), for ``nsys profile --capture-range=cudaProfilerApi``.

Either way the forward is annotated with named ranges
(:func:`megatron_lol.platform.trace_ranges.trace_range`):
``prelude``, ``depth {l}`` for every step of the core (routed depths and
fixed steps), inside a routed depth ``router`` and ``dispatch`` (grouping,
gather / scatter and the block calls), ``block {b}`` for every block call, and
``coda``.
"""

from __future__ import annotations

import os
from typing import Optional

from megatron_lol.log import log_rank0
from megatron_lol.platform.trace_ranges import enable_ranges
from megatron_lol.training.hooks import Hook, Stop


def profile_dir(training_cfg) -> str:
    tr = training_cfg
    if tr.profile_dir:
        return tr.profile_dir
    if tr.tensorboard_dir:
        return tr.tensorboard_dir
    return os.path.join(tr.save, "profile") if tr.save else "profile"


def trace_path(directory: str, rank: int, start: int, end: int) -> str:
    return os.path.join(directory, f"trace-rank{rank}-iter{start}-{end}.json")


class ProfilerHook(Hook):
    """Opens the profile window of ``training.profile_*`` (see the module docstring)."""

    def __init__(self):
        self.mode: Optional[str] = None  # "torch", "nsys" or None (this rank does not profile)
        self.prof = None
        self.nvtx = None
        self.path: Optional[str] = None

    def on_start(self, trainer) -> None:
        import torch

        tr = trainer.cfg.training
        rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
        if rank not in tr.profile_ranks:
            return
        start, end, now = tr.profile_step_start, tr.profile_step_end, trainer.iteration
        if now >= end:
            log_rank0(f" profile: iterations {start}-{end - 1} are behind this run (it starts at {now}): not profiled")
            return
        cuda = trainer.device.type == "cuda"
        self.mode = "torch" if tr.use_pytorch_profiler or not cuda else "nsys"
        if self.mode == "nsys":
            print(
                f" profile: rank {rank}: nsys capture range over iterations {start}-{end - 1} "
                f"(run under nsys profile --capture-range=cudaProfilerApi)",
                flush=True,
            )
            if now >= start:
                self._nsys(True)
            return
        from torch.profiler import ProfilerActivity, profile, schedule

        first = max(start, now)
        self.path = trace_path(profile_dir(tr), rank, first, end)
        ahead = first - now  # steps before the first profiled one
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
        self.prof = profile(
            activities=activities,
            record_shapes=True,
            schedule=schedule(wait=max(ahead - 1, 0), warmup=1 if ahead else 0, active=end - first, repeat=1),
            on_trace_ready=self._write,
        )
        self.prof.start()
        enable_ranges(True, nvtx=cuda)
        if not tr.use_pytorch_profiler:
            print(f" profile: rank {rank}: no CUDA, so a torch.profiler trace (as --use-pytorch-profiler)", flush=True)
        print(f" profile: rank {rank}: torch.profiler over iterations {first}-{end - 1} -> {self.path}", flush=True)

    def _write(self, prof) -> None:
        os.makedirs(os.path.dirname(os.path.abspath(self.path)), exist_ok=True)
        prof.export_chrome_trace(self.path)
        print(f" profile: wrote {self.path}", flush=True)

    def _nsys(self, on: bool) -> None:
        import torch

        if on:
            torch.cuda.cudart().cudaProfilerStart()
            self.nvtx = torch.autograd.profiler.emit_nvtx(record_shapes=True)
            self.nvtx.__enter__()
            enable_ranges(True, nvtx=True)
        else:
            enable_ranges(False)
            self.nvtx.__exit__(None, None, None)
            self.nvtx = None
            torch.cuda.cudart().cudaProfilerStop()

    def on_step_end(self, trainer, result) -> Optional[Stop]:
        tr = trainer.cfg.training
        if self.mode == "torch" and self.prof is not None:
            self.prof.step()
            if trainer.iteration >= tr.profile_step_end:
                self._close()
        elif self.mode == "nsys":
            if trainer.iteration == tr.profile_step_start and self.nvtx is None:
                self._nsys(True)
            elif trainer.iteration >= tr.profile_step_end and self.nvtx is not None:
                self._nsys(False)
                self.mode = None
        return None

    def _close(self) -> None:
        enable_ranges(False)
        if self.prof is not None:
            self.prof.stop()
            self.prof = None

    def on_end(self, trainer, stop: Optional[Stop]) -> None:
        if self.mode == "torch":
            self._close()
        elif self.mode == "nsys" and self.nvtx is not None:
            self._nsys(False)
        self.mode = None
