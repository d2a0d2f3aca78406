"""Peak dense matmul throughput of accelerators, for MFU.

Figures are the vendors' dense (no structured sparsity) tensor-core peaks in
TFLOP/s per device, from the NVIDIA H100 / H200 / A100 datasheets (H800 has
the H100 SXM's compute and a narrower NVLink). MFU is ``achieved model FLOP/s
/ peak``; it is only reported when a device is known (or ``--peak-tflops`` is
given): on CPU it is omitted.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional


@dataclass(frozen=True)
class DevicePeak:
    name: str
    bf16: float  # TFLOP/s, dense
    fp8: Optional[float]
    tf32: float
    fp32: float  # non-tensor-core

    def for_precision(self, precision: str) -> Optional[float]:
        return {"bf16": self.bf16, "fp16": self.bf16, "fp8": self.fp8, "tf32": self.tf32, "fp32": self.fp32}.get(
            precision
        )


# ordered: the first whose keys all occur in the (lower-cased) device name wins
PEAKS: list[tuple[tuple[str, ...], DevicePeak]] = [
    (("h100", "pcie"), DevicePeak("H100 PCIe", bf16=756.0, fp8=1513.0, tf32=378.0, fp32=51.2)),
    (("h100", "nvl"), DevicePeak("H100 NVL", bf16=835.0, fp8=1671.0, tf32=418.0, fp32=60.0)),
    (("h100",), DevicePeak("H100 SXM", bf16=989.4, fp8=1978.9, tf32=494.7, fp32=66.9)),
    (("h800", "pcie"), DevicePeak("H800 PCIe", bf16=756.0, fp8=1513.0, tf32=378.0, fp32=51.2)),
    (("h800",), DevicePeak("H800", bf16=989.4, fp8=1978.9, tf32=494.7, fp32=66.9)),
    (("h200", "nvl"), DevicePeak("H200 NVL", bf16=835.0, fp8=1671.0, tf32=418.0, fp32=60.0)),
    (("h200",), DevicePeak("H200", bf16=989.4, fp8=1978.9, tf32=494.7, fp32=66.9)),
    (("a100",), DevicePeak("A100", bf16=312.0, fp8=None, tf32=156.0, fp32=19.5)),
    (("a800",), DevicePeak("A800", bf16=312.0, fp8=None, tf32=156.0, fp32=19.5)),
]


def lookup_peak(device_name: Optional[str]) -> Optional[DevicePeak]:
    """The peak entry for a ``torch.cuda.get_device_name()`` string, or None (CPU, unknown GPU)."""
    if not device_name:
        return None
    name = device_name.lower()
    for keys, peak in PEAKS:
        if all(k in name for k in keys):
            return peak
    return None


def peak_tflops(
    device_name: Optional[str], precision: str = "bf16", override: Optional[float] = None
) -> Optional[float]:
    """Peak TFLOP/s per device: ``override`` if given, else the table's figure, else None."""
    if override is not None:
        return float(override)
    peak = lookup_peak(device_name)
    return peak.for_precision(precision) if peak is not None else None


def mfu(achieved_tflops: float, peak: Optional[float]) -> Optional[float]:
    """Model FLOP utilisation in [0, 1] (None without a peak)."""
    if peak is None or peak <= 0:
        return None
    return achieved_tflops / peak
