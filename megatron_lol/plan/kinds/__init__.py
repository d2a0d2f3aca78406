"""The built-in plan kinds, one module each (docs/model.md, "Execution plans").

Importing this package registers them; a kind from outside the package registers
itself the same way (:func:`megatron_lol.plan.register_plan`).
"""

# registration order is the order messages list the kinds in
# isort: off
from megatron_lol.plan.kinds.dense import DensePlan
from megatron_lol.plan.kinds.looped import LoopedPlan
from megatron_lol.plan.kinds.foil import FoilPlan
from megatron_lol.plan.kinds.lol import LoLPlan
from megatron_lol.plan.kinds.accordion import AccordionPlan

# isort: on

__all__ = ["AccordionPlan", "DensePlan", "FoilPlan", "LoLPlan", "LoopedPlan"]
