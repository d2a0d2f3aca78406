"""The CPU emulation: every process-wide patch that lets megatron-core's CUDA code run on CPU with gloo.

:func:`install_cpu_patches` is the one place they are installed, called once by
:func:`megatron_lol.platform.setup_platform` when torch sees no CUDA device (never
with CUDA). :data:`CPU_PATCHES` lists them in installation order, each with why
it exists; the model knows nothing of them (it follows the device of its inputs
and parameters, and a backend, :mod:`megatron_lol.backends.cpu`, decides where a
CPU forward may leave the device mode).

=====================  ==========================================================================
patch                  why
=====================  ==========================================================================
``cuda_device_api``    ``torch.cuda.current_device/synchronize/Stream/Event/current_stream/
                       stream/set_device/get_device_properties/nvtx`` and
                       ``Tensor.record_stream`` raise on a CPU build; megatron-core calls them
                       in RoPE, the global memory buffer, timers, the checkpoint writer and the
                       MoE dispatcher (:func:`.cuda_api._patch_cuda_device_api`).
``cuda_rng``           ``torch.cuda.get/set_rng_state/manual_seed`` and megatron's private
                       ``_get/_set_cuda_rng_state`` go to the CPU generator: without it the RNG
                       tracker's ``fork()`` *silently* stops switching streams (torch queues
                       CUDA RNG sets when CUDA is absent) (:func:`.cuda_api._patch_cuda_rng`).
``moe_split_sizes``    ``moe_utils.maybe_move_tensor_to_cpu`` converts split sizes to numpy only
                       for CUDA tensors; gloo's ``all_to_all_single`` then raises TypeError in the
                       alltoall dispatcher (:func:`.collectives._patch_moe_split_sizes`).
``gloo_batched_p2p``   gloo's ``batch_isend_irecv`` with 2 pipeline stages cross-matches the
                       interleaved schedule's exchanges *silently*; batched p2p goes through the
                       unbatched even/odd ``_p2p_ops`` (:func:`.collectives._patch_gloo_batched_p2p`).
``cuda_tensors``       ``Tensor.cuda`` and ``nn.Module.cuda`` become the identity: megatron-core
                       moves modules and buffers with ``.cuda()``
                       (:func:`.device_mode._patch_cuda_tensors`).
``cuda_device_mode``   a ``TorchFunctionMode`` entered in the calling thread for the rest of the
                       process rewrites ``device='cuda'`` / ``device=current_device()`` to CPU,
                       drops ``pin_memory`` and reports ``torch.cuda.*`` type strings, for the
                       hard-coded devices and ``param.type() == 'torch.cuda.FloatTensor'``
                       asserts in the optimizers, clip_grads, schedules, causal mask and
                       ``broadcast_data``. Thread-local: other threads that run megatron-core
                       code use ``with cpu_device_mode():`` (:mod:`.device_mode`).
=====================  ==========================================================================

The patches that also apply with CUDA (missing Transformer Engine / apex, fixes of
megatron-core itself) are not emulation and stay in ``setup_platform``.
"""

from __future__ import annotations

from typing import Callable, NamedTuple

from megatron_lol.platform.collectives import _patch_gloo_batched_p2p, _patch_moe_split_sizes
from megatron_lol.platform.cuda_api import _patch_cuda_device_api, _patch_cuda_rng
from megatron_lol.platform.device_mode import _enter_global_cpu_mode, _patch_cuda_tensors


class CpuPatch(NamedTuple):
    name: str
    install: Callable[[], None]  # idempotent
    why: str


CPU_PATCHES: tuple[CpuPatch, ...] = (
    CpuPatch("cuda_device_api", _patch_cuda_device_api, "torch.cuda device/stream/event calls raise"),
    CpuPatch("cuda_rng", _patch_cuda_rng, "CUDA RNG state calls raise or are silently queued"),
    CpuPatch("moe_split_sizes", _patch_moe_split_sizes, "gloo all_to_all gets tensor split sizes"),
    CpuPatch("gloo_batched_p2p", _patch_gloo_batched_p2p, "gloo batched p2p cross-matches"),
    CpuPatch("cuda_tensors", _patch_cuda_tensors, "megatron-core calls .cuda() on tensors/modules"),
    CpuPatch("cuda_device_mode", _enter_global_cpu_mode, "hard-coded CUDA devices and type checks"),
)


def install_cpu_patches() -> None:
    """Install every patch of :data:`CPU_PATCHES`, in order (the module docstring says why each exists).

    Called by ``setup_platform`` on a machine without CUDA, from the thread that
    will run the model (the device mode is thread-local). Idempotent.
    """
    for patch in CPU_PATCHES:
        patch.install()
