"""The CPU backend: faster implementations of the model's hot paths for CPU runs.

Each path computes what the reference in ``megatron_lol.model`` computes (tests
compare them bit for bit, or within 1e-6 where only a summation order differs)
and declines (returns None) wherever it does not apply, so the caller runs the
reference instead:

* :func:`~.combine.fused_gated_update`: a routed depth's gated combine as one
  C loop each way (``routing_cpu.c``, compiled on first use; see
  :mod:`.kernels`);
* :func:`~.layer.attention_half` / :func:`~.layer.mlp_half`: a short call path
  for megatron-core's local layer halves;
* :meth:`CpuBackend.core_context`: the routed core outside the platform's
  CUDA-to-CPU function mode when nothing in it can touch CUDA.

Chosen at run time by :func:`megatron_lol.backends.select_backend` for tensors
on the CPU; GPU runs never use it.
"""

from __future__ import annotations

import contextlib

from megatron_lol.backends.cpu.combine import fused_gated_update
from megatron_lol.backends.cpu.layer import attention_half, mlp_half


class CpuBackend:
    """The CPU paths behind one object (the model asks it, and falls back to the reference)."""

    name = "cpu"

    gated_update = staticmethod(fused_gated_update)
    attention_half = staticmethod(attention_half)
    mlp_half = staticmethod(mlp_half)

    @staticmethod
    def needs_device_mode(core) -> bool:
        """Whether a forward of ``core`` may create tensors through megatron-core's CUDA device calls:
        packed (THD) attention, full recomputation, MoE layers, or a tensor- / expert-parallel group
        (megatron's collectives and RNG trackers name CUDA devices)."""
        from megatron.core import parallel_state

        if core.packed or core.recompute_full or core.cfg.moe.layers == "all":
            return True
        if not parallel_state.model_parallel_is_initialized():
            return False
        return (
            parallel_state.get_tensor_model_parallel_world_size() > 1
            or parallel_state.get_expert_model_parallel_world_size() > 1
        )

    @classmethod
    def core_context(cls, core):
        """Run a forward of ``core`` outside the platform's CUDA-to-CPU mode unless it may need it.

        The mode costs about 10 us per torch call, and a routed core makes ``L``
        block calls per depth. Code that creates no CUDA tensors (a core on one
        TP / EP rank without MoE layers or recomputation) runs without it; safe
        by failure, as any CUDA use there raises instead of running elsewhere.
        The model does not ask which platform it runs on: this backend decides.
        """
        if cls.needs_device_mode(core):
            return contextlib.nullcontext()
        from megatron_lol.platform import device_mode_suspended

        return device_mode_suspended()


__all__ = ["CpuBackend", "attention_half", "fused_gated_update", "mlp_half"]
