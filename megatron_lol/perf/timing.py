"""Timing whole training steps on a GPU without draining its queue (``megatron-lol profile``, the GPU
proof's GPTModel baseline)."""

from __future__ import annotations

import time


class StepTimer:
    """Seconds of whole steps: a pair of CUDA events per step on GPUs (recorded on the current stream, read
    after one synchronisation at the end, so timing does not drain the queue between steps), the wall clock
    elsewhere. ``event``: a factory of CUDA-event-like objects (``record()``, ``elapsed_time(end)`` in ms)."""

    def __init__(self, cuda: bool, event=None):
        self.cuda = cuda
        self.method = "cuda_events" if cuda else "wall_clock"
        self._event = event
        self._pairs: list = []
        self._open = None

    def _new_event(self):
        if self._event is not None:
            return self._event()
        import torch

        return torch.cuda.Event(enable_timing=True)

    def start(self) -> None:
        if self.cuda:
            self._open = self._new_event()
            self._open.record()
        else:
            self._open = time.perf_counter()

    def stop(self) -> None:
        if self.cuda:
            end = self._new_event()
            end.record()
            self._pairs.append((self._open, end))
        else:
            self._pairs.append(time.perf_counter() - self._open)
        self._open = None

    def seconds(self) -> list:
        if not self.cuda:
            return list(self._pairs)
        if self._event is None:
            import torch

            torch.cuda.synchronize()
        return [start.elapsed_time(end) / 1e3 for start, end in self._pairs]
