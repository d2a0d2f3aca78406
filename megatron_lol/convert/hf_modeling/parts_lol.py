"""Per-pass parts of a block call: one class each, written once, in plain torch.

A plan step may give a block call parts of its own beside the block's weights
(docs/model.md, "Per-pass parts"): FiLM after the block's two norms, Accordion's
loop gates on the two residual writes, input injection before the step. A part
is a subclass of :class:`Part` that says everything about itself: its
parameters (shapes from the model config, init value), the slice a step uses,
where in the block call it applies (:attr:`Part.hook`) and its arithmetic
(:meth:`Part.apply`), its parameter-count category, and whether tensor-parallel
ranks must keep it bit-identical. The megatron-core layer call, the grouped
executor and the HF remote code all call these methods, which keeps them equal
by construction.

This module is remote code too (shipped with every HF export), so it imports
torch only. A part defined outside the package is shipped by the exporter as
the source of its class (``inspect.getsource``) in a file of its own next to
this one, which the export's ``plugin_parts_lol.py`` imports and registers:
its class body may use ``torch`` and this module's names only
(docs/convert.md, "Per-pass parts").
"""

from __future__ import annotations

from typing import Optional

import torch

#: where a part applies in a step: ``input`` before the step (on the residual stream and the core's
#: input), ``norm`` on the output of the block's two norms (row 0: attention, row 1: MLP), ``write`` on
#: the block's two residual writes (row 0: attention, row 1: MLP)
HOOKS = ("input", "norm", "write")


class Part:
    """One per-pass part; subclasses set the class attributes and the methods they need.

    Parameters live on the core as ``core.<name>`` in megatron checkpoints and as ``model.<name>``
    in HF exports, one tensor per entry of :meth:`parameters`.
    """

    #: the name steps use for it (``Step.parts``, the exported steps' ``parts``)
    name: str = ""
    #: the names of its tensors (the keys of :meth:`parameters`), fixed whatever the config
    param_names: tuple = ()
    #: one of :data:`HOOKS`
    hook: str = ""
    #: its parameter-count category: a key of ``megatron_lol.model.params.BREAKDOWN_KEYS``, or a name of
    #: its own (counted under ``ParamCounts.part_params``, in the totals and the active counts)
    category: str = ""
    #: whether its parameters act on the tensor-parallel-replicated stream outside any TP reduction, so
    #: that TP ranks must keep them bit-identical (their gradients are averaged over the group:
    #: ``megatron_lol/parallel/routing_agreement.py``)
    replicated: bool = False

    @classmethod
    def enabled(cls, config) -> bool:
        """Whether the model config turns the part on for every step (model-wide parts: FiLM, input
        injection); a plan kind names the others on its steps (``Step.parts``). ``config`` is megatron's
        ``ModelConfig`` or the exported ``LoLConfig``: read a plan option with :func:`model_option`."""
        return False

    @classmethod
    def parameters(cls, config, num_blocks: int, depth: int, passes: int) -> dict:
        """``{name: (shape, initial value)}`` of the part's tensors for a core of ``num_blocks`` stored
        blocks, ``depth`` steps and ``passes`` passes over its most-used block."""
        raise NotImplementedError

    @classmethod
    def per_block(cls, config) -> bool:
        """Whether :meth:`select` gives different tensors to different blocks of one step (the grouped
        executor then gathers them per row by block); False: one set for every block of a step."""
        return True

    @classmethod
    def select(cls, params: dict, depth: int, pass_index: int, block: int) -> tuple:
        """The tensors the step at ``depth`` (1-based; ``pass_index`` its pass) gives a call of
        ``block`` (None: an ``input`` part before a routed step): the arguments of :meth:`apply` after
        the activations."""
        raise NotImplementedError

    @staticmethod
    def apply(*args) -> torch.Tensor:
        """The arithmetic, by hook: ``input``: ``apply(state, core_input, *selected)``; ``norm``:
        ``apply(y, row, *selected)``; ``write``: ``apply(before, after, row, *selected)``. Under the
        grouped executor the selected tensors carry a leading row dimension (one row per token), so
        index them from the end (``t[..., row, :]``)."""
        raise NotImplementedError


def model_option(config, name: str, default):
    """The model-wide option ``name`` (``film``, ``input_injection``) of ``config``: megatron's
    ``ModelConfig`` keeps it in its plan's section (``config.plan.film``; ``default`` for a kind
    without it), the exported ``LoLConfig`` as a key of config.json (``config.film``), a published
    format that stays flat."""
    plan = getattr(config, "plan", None)
    if plan is not None and not isinstance(plan, (str, dict)):  # a ModelConfig's section object
        return getattr(plan, name, default)
    return getattr(config, name, default)


class FiLM(Part):
    """``gamma * y + beta`` per channel on each norm's output (docs/model.md, "FiLM"): one ``(gamma,
    beta)`` pair of ``[2, h]`` per depth (``film: depth``) or per (depth, block) (``depth_block``)."""

    name, hook, category = "film", "norm", "film"
    param_names = ("film_gamma", "film_beta")

    @classmethod
    def enabled(cls, config) -> bool:
        return model_option(config, "film", "off") != "off"

    @classmethod
    def parameters(cls, config, num_blocks, depth, passes) -> dict:
        h = config.hidden_size
        shape = (depth, 2, h) if model_option(config, "film", "off") == "depth" else (depth, num_blocks, 2, h)
        return {"film_gamma": (shape, 1.0), "film_beta": (shape, 0.0)}

    @classmethod
    def per_block(cls, config) -> bool:
        return model_option(config, "film", "off") == "depth_block"

    @classmethod
    def select(cls, params, depth, pass_index, block) -> tuple:
        gamma, beta = params["film_gamma"][depth - 1], params["film_beta"][depth - 1]
        if gamma.dim() == 3:  # per (depth, block)
            return gamma[block], beta[block]
        return gamma, beta

    @staticmethod
    def apply(y, row, gamma, beta):
        return film(y, gamma[..., row, :], beta[..., row, :])


class LoopGates(Part):
    """Accordion's second-pass write gates, per stored block and channel: ``before + g * (after -
    before)`` on the attention (row 0) and MLP (row 1) writes; a gate of 1 is the ordinary write."""

    name, hook, category, replicated = "loop_gates", "write", "loop_gates", True
    param_names = ("loop_gates",)

    @classmethod
    def parameters(cls, config, num_blocks, depth, passes) -> dict:
        return {"loop_gates": ((num_blocks, 2, config.hidden_size), 1.0)}

    @classmethod
    def select(cls, params, depth, pass_index, block) -> tuple:
        return (params["loop_gates"][block],)

    @staticmethod
    def apply(before, after, row, gates):
        return gated_write(before, after, gates[..., row, :])


class InputInjection(Part):
    """``sigmoid(theta) * s + (1 - sigmoid(theta)) * s0`` before every step (docs/model.md, "Input
    injection"): the core's input ``s0`` mixed back into the state, one logit per channel."""

    name, hook, category, replicated = "input_injection", "input", "injection", True
    param_names = ("injection_logit",)

    @classmethod
    def enabled(cls, config) -> bool:
        return bool(model_option(config, "input_injection", False))

    @classmethod
    def parameters(cls, config, num_blocks, depth, passes) -> dict:
        return {"injection_logit": ((config.hidden_size,), 0.0)}

    @classmethod
    def select(cls, params, depth, pass_index, block) -> tuple:
        return (params["injection_logit"],)

    @staticmethod
    def apply(state, injected, logit):
        return inject(state, injected, logit)


def film(y: torch.Tensor, gamma: torch.Tensor, beta: torch.Tensor) -> torch.Tensor:
    """FiLM: ``gamma * y + beta`` per channel, on a norm's output ``y`` (docs/model.md, "FiLM")."""
    return gamma.to(y.dtype) * y + beta.to(y.dtype)


def gated_write(before: torch.Tensor, after: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
    """A residual write scaled per channel: ``before + gate * (after - before)``."""
    return before + gate.to(before.dtype) * (after - before)


def inject(state: torch.Tensor, injected: torch.Tensor, logit: torch.Tensor) -> torch.Tensor:
    """Input injection: ``sigmoid(theta) * s + (1 - sigmoid(theta)) * s0``."""
    mix = torch.sigmoid(logit).to(state.dtype)
    return mix * state + (1 - mix) * injected


# ------------------------------------------------------------------ registry
#: registered parts by name, in registration order (model-wide parts apply in this order)
PARTS: dict = {}
BUILTIN_PARTS = (FiLM, LoopGates, InputInjection)


def register_part(cls: type) -> type:
    """Make part ``cls`` available to plan steps by ``cls.name`` (a class decorator). A second class under
    a taken name is refused; :func:`unregister_part` removes one."""
    if not (isinstance(cls, type) and issubclass(cls, Part)) or not cls.name:
        raise TypeError(f"{cls!r}: a part is a named subclass of Part")
    if cls.hook not in HOOKS:
        raise ValueError(f"part {cls.name!r}: hook must be one of {', '.join(HOOKS)} (got {cls.hook!r})")
    if not cls.category or not cls.param_names:
        raise ValueError(f"part {cls.name!r}: needs a parameter-count category and its param_names")
    taken = {n: p.name for p in PARTS.values() if p is not cls for n in p.param_names}
    clash = [n for n in cls.param_names if n in taken]
    if clash:
        raise ValueError(f"part {cls.name!r}: parameter {clash[0]!r} is part {taken[clash[0]]!r}'s")
    known = PARTS.get(cls.name)
    if known is not None and known is not cls:
        raise ValueError(f"part {cls.name!r} is already registered ({known.__qualname__})")
    PARTS[cls.name] = cls
    return cls


def unregister_part(name: str) -> None:
    if any(p.name == name for p in BUILTIN_PARTS):
        raise ValueError(f"part {name!r} is built in")
    PARTS.pop(name, None)


def part(name: str) -> type:
    """The registered part ``name``; KeyError naming the known ones."""
    cls = PARTS.get(name)
    if cls is None:
        raise KeyError(f"part {name!r} is not registered (known: {', '.join(PARTS)})")
    return cls


def part_of_parameter(name: str) -> Optional[type]:
    """The registered part holding tensor ``name`` (without the ``core.`` / ``model.`` prefix), else None."""
    return next((cls for cls in PARTS.values() if name in cls.param_names), None)


def parts_of_step(config, step_parts) -> tuple:
    """The part classes a step applies, in order: the model-wide ones ``config`` enables, then the step's
    own (``step_parts``: its names)."""
    wide = [cls for cls in PARTS.values() if cls.enabled(config)]
    own = [part(name) for name in step_parts if PARTS.get(name) not in wide]
    return tuple(wide + own)


def selected(parts, params: dict, depth: int, pass_index: int, block: int, hook: Optional[str] = None) -> tuple:
    """``((part, tensors), ...)`` of ``parts`` (of ``hook`` only, when given) for one block call."""
    return tuple(
        (cls, cls.select(params, depth, pass_index, block)) for cls in parts if hook is None or cls.hook == hook
    )


def apply_norm(y: torch.Tensor, row: int, norm_parts) -> torch.Tensor:
    """``y`` through each ``(part, tensors)`` of the ``norm`` hook."""
    for cls, args in norm_parts:
        y = cls.apply(y, row, *args)
    return y


def apply_write(before: torch.Tensor, after: torch.Tensor, row: int, write_parts) -> torch.Tensor:
    """The residual write ``before -> after`` through each ``(part, tensors)`` of the ``write`` hook."""
    for cls, args in write_parts:
        after = cls.apply(before, after, row, *args)
    return after


for _cls in BUILTIN_PARTS:
    register_part(_cls)
