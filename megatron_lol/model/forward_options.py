"""What a caller asks of one forward of the model, as one object.

A forward of :class:`~.lol_model.LoLGPTModel` runs the prelude, this stage's
share of the plan's steps and the coda. Besides the tokens, a caller decides
how far the plan runs (growing depth, Accordion's budget), whether routes are
forced, what is recorded, how gradients are truncated, where the router noise
comes from and whether the micro-batch brings its host-built layout. These
choices travel as one :class:`ForwardOptions` from the model to the core
(``LoLGPTModel.forward`` -> ``Core.forward`` -> :class:`~.core_steps.CoreContext`),
so adding one touches this file and the step that reads it, not every
signature in between.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any, Callable, Optional

import torch

__all__ = ["ForwardOptions"]


@dataclass(frozen=True)
class ForwardOptions:
    """The options of one forward (all optional; the defaults run the whole plan, unforced, unrecorded).

    ``depth``: how many of the plan's steps run (growing depth; None: all). ``budget``: Accordion's
    loop budget ``k`` (None: ``model.plan.budget``, else the largest); it sets the depth.
    ``forced_path``: a :class:`~.core.ForcedPath` of block ids and gates. ``record`` /
    ``record_moe``: keep the routing / MoE-router records in the returned ``CoreOutput``.
    ``backprop_depth`` ``k``: only the last ``k`` steps get gradients (first windows excepted when
    ``first_window_full_backprop``). ``noise_seeds`` ``[b]``: one router-noise seed per row (None:
    the global RNG). ``aux_loss_scale``: the weight of the balancing loss's gradient (the trainer
    passes ``1 / num_microbatches``, as the LM loss is scaled). ``routing_check(depth, decision)``:
    called with each routed depth's decision before its blocks run (the tensor-parallel agreement
    check). ``layout``: the micro-batch's host-built :class:`~.host_layout.HostLayout` on the
    device: the documents come from it and the routed depths run grouped.
    """

    depth: Optional[int] = None
    budget: Optional[int] = None
    forced_path: Any = None
    record: bool = False
    record_moe: bool = False
    backprop_depth: Optional[int] = None
    first_window_full_backprop: bool = True
    noise_seeds: Optional[torch.Tensor] = None
    aux_loss_scale: float = 1.0
    routing_check: Optional[Callable] = None
    layout: Any = None

    @classmethod
    def of(cls, options: Optional["ForwardOptions"], overrides: dict, caller: str) -> "ForwardOptions":
        """``options`` (default: all defaults) with the keyword ``overrides`` a caller passed beside it.

        An unknown keyword is a ``TypeError`` naming it and the options there are, as Python's own
        error for a misspelt argument would."""
        if not overrides:
            return options if options is not None else cls()
        for name in overrides:
            if name not in _OPTION_NAMES:
                raise TypeError(
                    f"{caller}() got an unexpected keyword argument {name!r} "
                    f"(forward options: {', '.join(_OPTION_NAMES)})"
                )
        values = {name: getattr(options, name) for name in _OPTION_NAMES} if options is not None else {}
        values.update(overrides)
        return cls(**values)  # field by field, not dataclasses.replace: torch.compile traces this too


#: the option names, computed once (``dataclasses.fields`` is not traced by ``torch.compile``)
_OPTION_NAMES = tuple(f.name for f in fields(ForwardOptions))
