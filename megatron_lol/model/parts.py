"""The per-pass parts a model's plan steps apply, resolved against the part registry.

A part is one class (:class:`~megatron_lol.convert.hf_modeling.parts_lol.Part`, torch only: the
HF remote code runs the same class); a plan step names the parts it applies (``Step.parts``) and a
part may be on for every step by the model config (FiLM, input injection). Everything that builds,
counts, exports or checks a core's parameters asks this module which parts a model has, never a
part by name (CONTRIBUTING.md, "Add a per-pass part").
"""

from __future__ import annotations

from megatron_lol.convert.hf_modeling.parts_lol import (
    BUILTIN_PARTS,
    PARTS,
    Part,
    part_of_parameter,
    parts_of_step,
    register_part,
    unregister_part,
)
from megatron_lol.errors import ConfigError

__all__ = [
    "BUILTIN_PARTS",
    "PARTS",
    "Part",
    "model_parts",
    "part_of_parameter",
    "part_parameters",
    "register_part",
    "step_parts",
    "unregister_part",
]


def step_parts(model, plan, prefix: str = "model") -> list:
    """Per plan step, the tuple of part classes it applies (:func:`parts_of_step`); a ConfigError naming
    the plan and the step for a part that is not registered."""
    out = []
    for step in plan.steps():
        try:
            out.append(parts_of_step(model, step.parts))
        except KeyError as err:
            raise ConfigError(f"{prefix}.plan: plan {plan.name}, step {step.depth}: {err.args[0]}") from None
    return out


def model_parts(model, plan, prefix: str = "model") -> list:
    """Every part some step of the plan applies, in first use order."""
    return list(dict.fromkeys(cls for parts in step_parts(model, plan, prefix) for cls in parts))


def part_parameters(model, plan) -> dict:
    """``{tensor name: (part, shape, initial value)}`` of the model's parts (names without ``core.``)."""
    out = {}
    for cls in model_parts(model, plan):
        shapes = cls.parameters(model, plan.num_stored_blocks, plan.depth, plan.loop_passes)
        if set(shapes) != set(cls.param_names):
            raise ValueError(
                f"part {cls.name!r}: parameters() gave {sorted(shapes)}, param_names says {cls.param_names}"
            )
        for name, (shape, init) in shapes.items():
            out[name] = (cls, tuple(shape), float(init))
    return out
