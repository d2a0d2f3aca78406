"""Deprecated spellings of the model's shape keys, read with a deprecation warning.

Configs (and checkpoints' ``run_config.yaml``) in the deprecated spelling use
``num_blocks`` / ``routed_depth`` for every plan and write Foil as
``plan: looped`` with MoE blocks. They are rewritten in place to the current
keys, so every config keeps its parameter count:

============  ==============================  =====================================
plan          deprecated keys                 current keys
============  ==============================  =====================================
dense         ``num_blocks``                  ``core_layers``
looped        ``num_blocks``, ``routed_depth``  ``loop_layers``, ``loop_count``
looped + MoE  ``num_blocks``, ``routed_depth``,  ``plan: foil``, ``foil_layers``,
blocks        ``core_num_experts``            ``foil_loops``, ``foil_experts``
accordion     ``num_blocks``                  ``loop_window``
============  ==============================  =====================================
"""

from __future__ import annotations

import warnings

from megatron_lol.errors import ConfigError
from megatron_lol.plan.kinds.lol import LOL_DEFAULT_BLOCKS, LOL_DEFAULT_DEPTH


class ConfigDeprecationWarning(FutureWarning):
    """A config key in the deprecated spelling (read and rewritten)."""


def _warn(message: str) -> None:
    warnings.warn(f"config: {message}", ConfigDeprecationWarning, stacklevel=4)


def _move(model, old: str, new: str, value) -> None:
    if getattr(model, new) is not None and getattr(model, new) != value:
        raise ConfigError(f"model.{old}: given together with model.{new} (plan {model.plan} reads {new}); remove {old}")
    setattr(model, new, value)
    setattr(model, old, None)


def migrate_model_keys(model) -> None:
    """Rewrite ``model`` (a ``ModelConfig``) from the deprecated shape keys; idempotent."""
    plan = model.plan
    blocks, depth = model.num_blocks, model.routed_depth
    if plan == "lol":
        if model.num_blocks is None:
            model.num_blocks = LOL_DEFAULT_BLOCKS
        if model.routed_depth is None:
            model.routed_depth = LOL_DEFAULT_DEPTH
        return
    if blocks is None and depth is None:
        return
    # a config that uses the plan's own keys is not the deprecated spelling: the plan refuses stray keys
    if plan == "dense" and model.core_layers is None:
        if blocks is not None:
            _move(model, "num_blocks", "core_layers", blocks)
        model.routed_depth = None  # always ignored by the dense plan
        _warn(f"plan dense: model.num_blocks is now model.core_layers (={model.core_layers})")
    elif plan == "accordion" and model.loop_window is None:
        if blocks is not None:
            _move(model, "num_blocks", "loop_window", blocks)
        model.routed_depth = None
        _warn(f"plan accordion: model.num_blocks is now model.loop_window (={model.loop_window})")
    elif plan == "looped" and model.loop_layers is None and model.loop_count is None:
        if blocks is None or depth is None:
            raise ConfigError(
                f"model.{'num_blocks' if blocks is None else 'routed_depth'}: the older looped "
                f"spelling needs both num_blocks and routed_depth (better: loop_layers/loop_count)"
            )
        if depth % blocks:
            raise ConfigError(
                f"model.routed_depth: a looped plan needs routed_depth ({depth}) to be a "
                f"multiple of num_blocks ({blocks})"
            )
        layers, loops = "loop_layers", "loop_count"
        if model.moe_layers == "all":
            model.plan = "foil"
            layers, loops = "foil_layers", "foil_loops"
            if model.core_num_experts is not None or model.foil_experts is None:
                _move(model, "core_num_experts", "foil_experts", model.core_num_experts or model.num_experts)
            if model.untie_attention is None:
                model.untie_attention = False  # the default of the deprecated spelling
        _move(model, "num_blocks", layers, blocks)
        _move(model, "routed_depth", loops, depth // blocks)
        _warn(
            f"plan looped{' with MoE blocks is now plan foil;' if model.plan == 'foil' else ':'} "
            f"num_blocks / routed_depth are now {layers}={blocks} / {loops}={depth // blocks}"
        )
