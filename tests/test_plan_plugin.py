"""A new model variant is one file: this one.

It defines a plan kind the package does not know (a loop over the same stored
layers whose second pass runs them in reverse order), with its own config
section ``model.plan: {kind: reversed-loop, layers: 2, loops: 2}``, registers
it, and checks that the rest of the stack takes it without a change to
``megatron_lol/``: two training steps and a checkpoint, the parameter count
from the meta-built model, the HF export (the remote code runs the exported
schedule) with logits equal to megatron's, and greedy decoding with the
cache equal to recomputation.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

import pytest

from megatron_lol.plan import ExecutionPlan, Step, option, register_plan, unregister_plan


@dataclass
class ReversedLoopOptions:
    layers: int = option(2, help="stored layers of the looped block")
    loops: int = option(2, help="passes over it; every second pass runs the layers in reverse order")


class ReversedLoopPlan(ExecutionPlan):
    """Pass ``p`` runs the ``layers`` stored layers in order when ``p`` is even, reversed when odd."""

    name = "reversed-loop"
    Options = ReversedLoopOptions

    def _stored_blocks(self) -> int:
        self.loops = self._require("plan.loops", self.options.loops)
        return self._require("plan.layers", self.options.layers)

    def _build_steps(self) -> list:
        n, attention = self.num_stored_blocks, self._fixed_attention()
        order = [b if p % 2 == 0 else n - 1 - b for p in range(self.loops) for b in range(n)]
        return [Step(depth=d + 1, block=b, pass_index=d // n, attention=attention) for d, b in enumerate(order)]

    def describe(self) -> str:
        return f"{self.num_stored_blocks} layers x {self.loops} passes, odd passes reversed"


TOY = {"plan": {"kind": "reversed-loop", "layers": 2, "loops": 2}}


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """A SentencePiece model and held-out documents, as tests/test_convert_hf.py builds them."""
    from test_convert_hf import _spm_and_docs

    root = tmp_path_factory.mktemp("plugin_corpus")
    model, docs = _spm_and_docs(str(root))
    return {"model": model, "heldout": docs[-4:], "root": root}


@pytest.fixture
def toy_kind():
    register_plan(ReversedLoopPlan)
    yield ReversedLoopPlan
    unregister_plan(ReversedLoopPlan.name)


def test_toy_plan_section_is_validated(toy_kind):
    from megatron_lol.config import config_from_dict
    from megatron_lol.errors import ConfigError

    cfg = config_from_dict({"model": dict(TOY)})
    plan = cfg.model.execution_plan()
    assert [s.block for s in plan.steps()] == [0, 1, 1, 0] and plan.loop_passes == 2 and not plan.routes
    assert cfg.to_dict()["model"]["plan"] == {"kind": "reversed-loop", "layers": 2, "loops": 2}
    with pytest.raises(ConfigError, match=r"model.plan.width is not an option of plan reversed-loop"):
        config_from_dict({"model": {"plan": {"kind": "reversed-loop", "width": 3}}})
    with pytest.raises(ConfigError, match=r"model.plan.loops: must be > 0"):
        config_from_dict({"model": {"plan": {"kind": "reversed-loop", "loops": 0}}})
    with pytest.raises(ConfigError, match=r"model.plan.layers must be int"):
        config_from_dict({"model": {"plan": {"kind": "reversed-loop", "layers": "two"}}})


def test_toy_plan_is_gone_once_unregistered():
    from megatron_lol.config import config_from_dict
    from megatron_lol.errors import ConfigError

    with pytest.raises(ConfigError, match="model.plan: kind must be one of dense, looped, foil, lol, accordion"):
        config_from_dict({"model": dict(TOY)})


def test_toy_plan_parameters_are_those_of_its_stored_layers(toy_kind):
    """Counted from the meta-built model: the stored layers of a 2-layer dense core, whatever the passes."""
    from megatron_lol.config import config_from_dict
    from megatron_lol.model.params import count_parameters

    toy = count_parameters(config_from_dict({"model": dict(TOY)}).model, 512).total
    dense2 = count_parameters(config_from_dict({"model": {"plan": {"kind": "dense", "layers": 2}}}).model, 512)
    dense4 = count_parameters(config_from_dict({"model": {"plan": {"kind": "dense", "layers": 4}}}).model, 512)
    assert toy == dense2.total < dense4.total


@pytest.mark.slow
def test_toy_plan_trains_exports_and_decodes(toy_kind, corpus, tmp_path):
    """Two training steps in a torchrun rank (this file registers the kind there too), then the HF
    export: logits equal to megatron's, cached greedy decoding equal to recomputation."""
    from test_convert_hf import _train, check_lol_export

    save = _train(corpus, 1, [("reversed_loop", {}, TOY)], script=__file__)["reversed_loop"]
    run_config = (save / "iter_0000002" / "run_config.yaml").read_text()
    assert "kind: reversed-loop" in run_config
    diff = check_lol_export(save, tmp_path, corpus, gen_tokens=8)
    conf = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert [step["block"] for step in conf["execution_plan"]["steps"]] == [0, 1, 1, 0]
    print(f"reversed-loop plug-in: max abs logit diff {diff:.2e}")


if __name__ == "__main__":  # a rank of _train (launched by torch.distributed.run): two steps, then a save
    import sys

    from test_convert_hf import train_and_save

    register_plan(ReversedLoopPlan)
    for save, tokenizer_model, parallel, model in json.loads(sys.argv[1]):
        train_and_save(save, tokenizer_model, parallel, model, steps=2)
