"""megatron-core 0.16.1's own Muon, run with the emerging-optimizers release pip can install.

Which Muon, and why
-------------------
megatron-core 0.16.1 ships Muon (``megatron/core/optimizer/muon.py``:
``TensorParallelMuon`` with Newton-Schulz, the TP modes ``blockwise`` /
``duplicated`` / ``distributed``, the QKV split and spectral scaling;
``get_megatron_muon_optimizer``; the ``LayerWiseDistributedOptimizer``) on top
of the ``emerging-optimizers`` package. We use exactly that code, on every
Python, rather than a Newton-Schulz of our own: the TP modes, the QKV split,
expert tensor-parallel groups, the layer-wise distributed optimizer and its
distributed checkpoints would all have to be rewritten and kept equal to it.

What pip can install: PyPI holds one release,
``emerging-optimizers 0.3.0`` (a pure-Python wheel, ``Requires-Python >=3.12``),
plus a ``999.9.9`` placeholder that is not the project and must never be
installed (on Python 3.11 it is the only version pip offers). Megatron-LM pins
the git tag ``v0.1.0`` (``>=3.10``), which is not on PyPI. So:

* Python >= 3.12: ``pyproject.toml`` installs ``emerging-optimizers==0.3.0``.
* Python < 3.12: ``tools/setup_env.sh`` installs the same wheel, pinned by its
  sha256 (``tools/requirements-muon.txt``), with ``--no-deps
  --ignore-requires-python``; its one other dependency, ``absl-py``, is a
  dependency of this package.

0.3.0 against megatron-core 0.16.1 needs four adjustments, each applied only
when it is needed (:func:`load_megatron_muon`); everything else is the
libraries' code:

1. ``typing.override`` (Python 3.12) is taken from ``typing_extensions`` when
   ``typing`` lacks it;
2. 0.3.0 imports its Triton kernels at import time; where ``triton`` is not
   installed (CPU machines) ``emerging_optimizers.triton_kernels`` is a
   stand-in with ``HAS_TRITON_340 = False``. The kernels serve only the
   ``use_syrk`` path, which megatron-core never selects, and emerging-optimizers
   refuses that path itself when the flag is False;
3. megatron-core calls ``OrthogonalizedOptimizer.__init__(..., use_nesterov=)``
   (v0.1.0's name); 0.3.0 calls it ``nesterov``;
4. megatron-core calls ``newton_schulz_tp(..., mode=)``; 0.3.0 calls it ``tp_mode``.

Adjustments 3 and 4 are needed on Python 3.12 too (they are about the two
libraries' versions, not Python), and are skipped for an installation whose
signatures already match (v0.1.0 from git). Two more concern megatron-core
alone: its split of expert-parallel Muon groups fails whenever a dense group
comes first (:class:`_GroupList`), i.e. for every expert-parallel model
without the layer-wise optimizer; and its layer-wise optimizer cannot save
the state of fp32 parameters (:func:`nest_fp32_member_states`).
"""

from __future__ import annotations

import functools
import importlib
import importlib.util
import inspect
import sys
import types
import typing
from typing import Optional

from megatron_lol.errors import CliError

PINNED_VERSION = "0.3.0"
INSTALL_HINT = (
    "bash tools/setup_env.sh, or: pip install --no-deps --ignore-requires-python --require-hashes "
    "-r tools/requirements-muon.txt && pip install absl-py"
)
_LOADED: Optional[types.ModuleType] = None


def installed_version() -> Optional[str]:
    """The installed emerging-optimizers distribution's version, or None."""
    from importlib import metadata

    try:
        return metadata.version("emerging-optimizers")
    except metadata.PackageNotFoundError:
        return None


def unavailable_reason() -> Optional[str]:
    """Why megatron-core's Muon cannot be loaded here (None: it can); cheap, imports nothing heavy."""
    version = installed_version()
    if version is None or importlib.util.find_spec("emerging_optimizers") is None:
        return f"emerging-optimizers {PINNED_VERSION} is not installed ({INSTALL_HINT})"
    if version.startswith("999"):
        return (
            f"the installed emerging-optimizers {version} is PyPI's placeholder, not the project: "
            f"pip uninstall emerging-optimizers, then {INSTALL_HINT}"
        )
    if importlib.util.find_spec("absl") is None:
        return "emerging-optimizers needs absl-py (pip install absl-py)"
    return None


def _provide_typing_override() -> None:
    if not hasattr(typing, "override"):
        import typing_extensions

        typing.override = typing_extensions.override


def _provide_triton_stand_in() -> None:
    """Adjustment 2: without triton, a ``triton_kernels`` module that says the kernels are absent."""
    name = "emerging_optimizers.triton_kernels"
    if name in sys.modules or importlib.util.find_spec("triton") is not None:
        return
    import emerging_optimizers

    stand_in = types.ModuleType(name, "Stand-in (megatron_lol.training.muon_compat): triton is not installed.")
    stand_in.HAS_TRITON_340 = False
    stand_in.__all__ = ["HAS_TRITON_340"]
    sys.modules[name] = stand_in
    emerging_optimizers.triton_kernels = stand_in


def _accept_use_nesterov() -> None:
    """Adjustment 3: ``OrthogonalizedOptimizer(use_nesterov=)`` as megatron-core passes it."""
    from emerging_optimizers.orthogonalized_optimizers import orthogonalized_optimizer as mod

    cls = mod.OrthogonalizedOptimizer
    params = inspect.signature(cls.__init__).parameters
    if "use_nesterov" in params or getattr(cls.__init__, "_megatron_lol_adapter", False):
        return
    if "nesterov" not in params:
        raise CliError(
            f"emerging-optimizers {installed_version()}: OrthogonalizedOptimizer takes neither "
            f"use_nesterov nor nesterov; megatron-core 0.16.1's Muon is tested with "
            f"{PINNED_VERSION} and v0.1.0"
        )
    original = cls.__init__

    @functools.wraps(original)
    def __init__(self, *args, use_nesterov: Optional[bool] = None, **kwargs):
        if use_nesterov is not None:
            kwargs.setdefault("nesterov", use_nesterov)
        original(self, *args, **kwargs)

    __init__._megatron_lol_adapter = True
    cls.__init__ = __init__


def _accept_mode(muon_module: types.ModuleType) -> None:
    """Adjustment 4: ``newton_schulz_tp(mode=)`` as megatron-core's closure calls it."""
    fn = muon_module.newton_schulz_tp
    params = inspect.signature(fn).parameters
    if "mode" in params or getattr(fn, "_megatron_lol_adapter", False):
        return
    if "tp_mode" not in params:
        raise CliError(
            f"emerging-optimizers {installed_version()}: newton_schulz_tp takes neither mode nor "
            f"tp_mode; megatron-core 0.16.1's Muon is tested with {PINNED_VERSION} and v0.1.0"
        )

    @functools.wraps(fn)
    def newton_schulz_tp(*args, mode: Optional[str] = None, **kwargs):
        if mode is not None:
            kwargs.setdefault("tp_mode", mode)
        return fn(*args, **kwargs)

    newton_schulz_tp._megatron_lol_adapter = True
    muon_module.newton_schulz_tp = newton_schulz_tp


class _GroupList(list):
    """megatron-core's list of Muon parameter groups, safe for how it moves expert groups out.

    ``get_megatron_muon_optimizer`` (without the layer-wise optimizer) runs
    ``for group in groups: if group['is_expert_parallel']: groups.remove(group)``:
    ``list.remove`` compares the dicts with ``==``, which compares their
    parameter tensors ("Boolean value of Tensor ... is ambiguous" whenever a
    dense group precedes the expert group), and removing while iterating
    skips the next group. Here iteration walks a snapshot and ``remove`` goes
    by identity, which is what that loop means.
    """

    def __iter__(self):
        return iter(list.copy(self))

    def remove(self, item) -> None:
        for i, group in enumerate(list.__iter__(self)):
            if group is item:
                del self[i]
                return
        raise ValueError("group not in list")


def _safe_expert_group_split(muon_module: types.ModuleType) -> None:
    """Adjustment 5 (megatron-core itself): see :class:`_GroupList`."""
    fn = muon_module._get_param_groups
    if getattr(fn, "_megatron_lol_adapter", False):
        return
    if "linear_param_groups.remove(group)" not in inspect.getsource(muon_module.get_megatron_muon_optimizer):
        return  # megatron-core changed that loop: nothing to adjust

    @functools.wraps(fn)
    def _get_param_groups(*args, **kwargs):
        return _GroupList(fn(*args, **kwargs))

    _get_param_groups._megatron_lol_adapter = True
    muon_module._get_param_groups = _get_param_groups


def nest_fp32_member_states(layer_wise_optimizer) -> None:
    """Checkpoints of megatron-core's layer-wise optimizer with fp32 parameters.

    ``LayerWiseDistributedOptimizer.sharded_state_dict`` reads each member's
    state as ``{'optimizer': {'state', 'param_groups'}}``, the layout of its
    bf16 members (``Float16OptimizerWithFloat16Params``); an fp32 member
    (``FP32Optimizer``) has torch's ``{'state', 'param_groups'}``, so every
    save fails (``KeyError: 'optimizer'``). Each fp32 member here writes and
    reads its state one level down, in the bf16 members' layout.
    """
    from megatron.core.optimizer.optimizer import FP32Optimizer

    for member in layer_wise_optimizer.chained_optimizers:
        if not isinstance(member, FP32Optimizer) or getattr(member, "_megatron_lol_nested", False):
            continue
        sharded, load = member.sharded_state_dict, member.load_state_dict

        def sharded_state_dict(*args, _sharded=sharded, **kwargs):
            return {"optimizer": _sharded(*args, **kwargs)}

        def load_state_dict(state_dict, _load=load):
            return _load(state_dict["optimizer"])

        member.sharded_state_dict, member.load_state_dict = sharded_state_dict, load_state_dict
        member._megatron_lol_nested = True


def load_megatron_muon() -> types.ModuleType:
    """``megatron.core.optimizer.muon``, ready to build Muon (CliError with the fix when it cannot be).

    Idempotent. Re-imports megatron's module if it was imported before
    emerging-optimizers could be (its ``HAVE_EMERGING_OPTIMIZERS`` is fixed at
    import time).
    """
    global _LOADED
    if _LOADED is not None:
        return _LOADED
    reason = unavailable_reason()
    if reason:
        raise CliError(f"optimizer.name: muon: {reason}")
    _provide_typing_override()
    _provide_triton_stand_in()
    try:
        importlib.import_module("emerging_optimizers.orthogonalized_optimizers")
    except ImportError as err:
        raise CliError(
            f"optimizer.name: muon: emerging-optimizers {installed_version()} does not import "
            f"({type(err).__name__}: {err})"
        ) from None
    _accept_use_nesterov()
    module = importlib.import_module("megatron.core.optimizer.muon")
    if not module.HAVE_EMERGING_OPTIMIZERS:
        module = importlib.reload(module)
    if not module.HAVE_EMERGING_OPTIMIZERS:  # pragma: no cover - the import above succeeded
        raise CliError("optimizer.name: muon: megatron-core does not see emerging-optimizers")
    _accept_mode(module)
    _safe_expert_group_split(module)
    _LOADED = module
    return module
