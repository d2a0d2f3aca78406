"""Background GPU sampler on NVML (``nvidia-ml-py``'s ``pynvml`` module).

A thread samples, every ``interval`` seconds and for every visible GPU:
utilisation (%), memory used (bytes), power (W), SM clock (MHz) and the clock
throttle ("event") reasons bit mask. :meth:`GpuSampler.summary` gives per GPU
the mean and minimum of each quantity (maximum too for memory and power), the
number of samples, and for each throttle reason the share of samples in which
it was active.

The NVML module is injectable (``nvml=``), so the arithmetic is tested against a
fake; :func:`start_if_available` starts a real sampler only when CUDA devices
and ``pynvml`` are present, and returns None otherwise (CPU runs).
"""

from __future__ import annotations

import threading
import time
from typing import Optional

# nvmlClocksThrottleReason* / nvmlClocksEventReason* bits
THROTTLE_REASONS = {
    0x1: "gpu_idle",
    0x2: "applications_clocks_setting",
    0x4: "sw_power_cap",
    0x8: "hw_slowdown",
    0x10: "sync_boost",
    0x20: "sw_thermal_slowdown",
    0x40: "hw_thermal_slowdown",
    0x80: "hw_power_brake_slowdown",
    0x100: "display_clock_setting",
}
NVML_CLOCK_SM = 1


def decode_throttle(mask: int) -> list[str]:
    return [name for bit, name in THROTTLE_REASONS.items() if mask & bit]


class GpuSampler:
    def __init__(self, nvml=None, interval: float = 0.5, indices: Optional[list] = None):
        if nvml is None:
            import pynvml as nvml  # nvidia-ml-py
        self.nvml = nvml
        self.interval = interval
        nvml.nvmlInit()
        count = nvml.nvmlDeviceGetCount()
        self.indices = list(range(count)) if indices is None else list(indices)
        self.handles = [nvml.nvmlDeviceGetHandleByIndex(i) for i in self.indices]
        self.names = []
        for h in self.handles:
            try:
                name = nvml.nvmlDeviceGetName(h)
                self.names.append(name.decode() if isinstance(name, bytes) else str(name))
            except Exception:  # noqa: BLE001 - a name is optional
                self.names.append("")
        self.samples: list[list[dict]] = [[] for _ in self.handles]
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None

    # ------------------------------------------------------------------ sampling
    def _throttle(self, handle) -> int:
        nv = self.nvml
        for fn in ("nvmlDeviceGetCurrentClocksEventReasons", "nvmlDeviceGetCurrentClocksThrottleReasons"):
            if hasattr(nv, fn):
                return int(getattr(nv, fn)(handle))
        return 0

    def sample_once(self) -> None:
        nv = self.nvml
        now = time.time()
        for k, h in enumerate(self.handles):
            util = nv.nvmlDeviceGetUtilizationRates(h)
            mem = nv.nvmlDeviceGetMemoryInfo(h)
            self.samples[k].append(
                {
                    "time": now,
                    "utilization_pct": float(util.gpu),
                    "memory_used_bytes": float(mem.used),
                    "memory_total_bytes": float(mem.total),
                    "power_w": nv.nvmlDeviceGetPowerUsage(h) / 1000.0,  # mW -> W
                    "sm_clock_mhz": float(nv.nvmlDeviceGetClockInfo(h, getattr(nv, "NVML_CLOCK_SM", NVML_CLOCK_SM))),
                    "throttle_mask": self._throttle(h),
                }
            )

    def _loop(self) -> None:
        while not self._stop.is_set():
            try:
                self.sample_once()
            except Exception:  # noqa: BLE001 - a failed sample must not kill the run
                pass
            self._stop.wait(self.interval)

    def start(self) -> "GpuSampler":
        self._stop.clear()
        self._thread = threading.Thread(target=self._loop, name="gpu-sampler", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> dict:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5 * self.interval + 1)
        try:
            self.nvml.nvmlShutdown()
        except Exception:  # noqa: BLE001
            pass
        return self.summary()

    def reset(self) -> None:
        """Forget the samples so far (e.g. the warm-up's)."""
        self.samples = [[] for _ in self.handles]

    # ------------------------------------------------------------------ summary
    def summary(self) -> dict:
        gpus = []
        for idx, name, rows in zip(self.indices, self.names, self.samples):
            gpus.append({"index": idx, "name": name, **summarize(rows)})
        return {"interval_s": self.interval, "gpus": gpus}


def summarize(rows: list[dict]) -> dict:
    out: dict = {"samples": len(rows)}
    if not rows:
        return out
    for key in ("utilization_pct", "memory_used_bytes", "power_w", "sm_clock_mhz"):
        vals = [r[key] for r in rows]
        out[key] = {"mean": sum(vals) / len(vals), "min": min(vals), "max": max(vals)}
    out["memory_total_bytes"] = rows[-1]["memory_total_bytes"]
    counts: dict = {}
    for r in rows:
        for reason in decode_throttle(r["throttle_mask"]):
            counts[reason] = counts.get(reason, 0) + 1
    out["throttle_reasons"] = {k: v / len(rows) for k, v in sorted(counts.items())}
    return out


def start_if_available(interval: float = 0.5) -> Optional[GpuSampler]:
    """A started sampler when CUDA GPUs and ``pynvml`` are present, else None."""
    try:
        import torch

        if not torch.cuda.is_available():
            return None
        import pynvml  # noqa: F401  (imported only to probe that it is installed)
    except Exception:  # noqa: BLE001
        return None
    try:
        import os

        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        indices = None
        if visible and all(v.strip().isdigit() for v in visible.split(",")):
            indices = [int(v) for v in visible.split(",")]
        return GpuSampler(interval=interval, indices=indices).start()
    except Exception:  # noqa: BLE001 - NVML missing or not permitted: profile without it
        return None
