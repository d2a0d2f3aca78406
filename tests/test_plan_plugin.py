"""A new model variant is one file: this one (and, for a new per-pass part, the file that defines it).

It defines a plan kind the package does not know (a loop over the same stored
layers whose second pass runs them in reverse order), with its own config
section ``model.plan: {kind: reversed-loop, layers: 2, loops: 2}``, registers
it, and checks that the rest of the stack takes it without a change to
``megatron_lol/``: two training steps and a checkpoint, the parameter count
from the meta-built model, the HF export (the remote code runs the exported
schedule) with logits equal to megatron's, and greedy decoding with the
cache equal to recomputation.

The second kind, ``gated-loop`` (tests/plugin_residual_gate.py), brings a per-pass part the package
does not know either (a scalar gate per pass on each residual update): it is counted by ``params``
and the memory estimate, trains on two tensor-parallel ranks (which keep its tensor bit-identical:
the part says it acts on the replicated stream), and the HF export ships the part's source, with
logits equal to megatron's and cached decoding equal to recomputation.
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


# ------------------------------------------------------------------ a per-pass part as a plug-in
@pytest.fixture
def gated_kind():
    import plugin_residual_gate as plug

    plug.register()
    yield plug
    plug.unregister()


def test_plugin_part_is_on_the_steps_and_counted(gated_kind):
    """``params`` counts the part's tensor in a category of its own, in the totals and the active counts,
    and the memory estimate holds it; nothing else changes against a dense core of the same layers."""
    from megatron_lol.config import config_from_dict
    from megatron_lol.model.params import category, count_parameters
    from megatron_lol.perf.memory import Layout, rank_parameters

    cfg = config_from_dict({"model": dict(gated_kind.GATED)})
    plan = cfg.model.execution_plan()
    assert [(s.block, s.pass_index, s.parts) for s in plan.steps()] == [
        (0, 0, ("residual_gate",)),
        (1, 0, ("residual_gate",)),
        (0, 1, ("residual_gate",)),
        (1, 1, ("residual_gate",)),
    ]
    assert plan.to_dict()["steps"][0]["parts"] == ["residual_gate"]
    assert category("core.residual_gate") == "residual_gates"
    dense_cfg = config_from_dict({"model": {"plan": {"kind": "dense", "layers": 2}}})
    gated, dense = count_parameters(cfg.model, 512), count_parameters(dense_cfg.model, 512)
    assert gated.part_params == {"residual_gates": 2 * 2}  # (passes, two writes)
    assert gated.to_dict()["part_params"] == {"residual_gates": 4} and "part_params" not in dense.to_dict()
    assert gated.total == dense.total + 4 and gated.active_per_token == dense.active_per_token + 4
    assert gated.breakdown == dense.breakdown
    mem_gated, mem_dense = (rank_parameters(c, 512, Layout()) for c in (cfg, dense_cfg))
    assert mem_gated.other == mem_dense.other + 4 and mem_gated.muon == mem_dense.muon


def test_a_step_naming_an_unregistered_part_is_refused(gated_kind):
    from megatron_lol.config import config_from_dict
    from megatron_lol.errors import ConfigError
    from megatron_lol.model.parts import step_parts, unregister_part

    model = config_from_dict({"model": dict(gated_kind.GATED)}).model
    unregister_part("residual_gate")
    with pytest.raises(
        ConfigError, match=r"model.plan: plan gated-loop, step 1: part 'residual_gate' is not registered"
    ):
        step_parts(model, model.execution_plan())
    with pytest.raises(ValueError, match="part 'film' is built in"):
        unregister_part("film")


def test_a_part_reading_its_module_is_not_shipped(gated_kind):
    """The export ships a plug-in part as the source of its class: one that reads a name of its module
    (which would not be there) is refused with a line naming it."""
    from megatron_lol.convert.part_sources import class_source
    from megatron_lol.errors import CliError

    assert "class ResidualGate(Part):" in class_source(gated_kind.ResidualGate)

    class ModuleReader(gated_kind.ResidualGate):
        @staticmethod
        def apply(before, after, row, gate):
            return before + json.loads("1.0") * (after - before)

    with pytest.raises(CliError, match=r"part 'residual_gate' .*ModuleReader\) reads gated_kind, json from its module"):
        class_source(ModuleReader)


@pytest.mark.slow
@pytest.mark.multiprocess
def test_plugin_part_trains_on_two_tp_ranks_exports_and_decodes(gated_kind, corpus, tmp_path):
    """One launch of two tensor-parallel ranks: two training steps move the gates, which stay
    bit-identical on both ranks (the TP routing-agreement average covers them); then the HF export
    (the part's source shipped with it): logits equal to megatron's, cached decoding equal to recomputation."""
    from test_convert_hf import _train, check_lol_export

    save = _train(corpus, 2, [("gated_loop_tp2", {"tensor_model_parallel_size": 2}, gated_kind.GATED)], script=__file__)
    save = save["gated_loop_tp2"]
    tp = json.loads((save / "plugin_tp.json").read_text())
    assert tp == {"tp": 2, "replicated": True, "moved": True, "ranks_equal": True}, tp
    diff = check_lol_export(save, tmp_path, corpus, gen_tokens=8)
    hf = tmp_path / "hf"
    conf = json.loads((hf / "config.json").read_text())
    assert conf["part_modules"] == {"residual_gate": "part_residual_gate"}
    assert all(step["parts"] == ["residual_gate"] for step in conf["execution_plan"]["steps"])
    shipped = (hf / "part_residual_gate.py").read_text()
    assert "class ResidualGate(Part):" in shipped and "megatron_lol" not in shipped.split('"""', 2)[2]
    assert "from .part_residual_gate import ResidualGate" in (hf / "plugin_parts_lol.py").read_text()
    from safetensors.torch import load_file

    shard = json.loads((hf / "model.safetensors.index.json").read_text())["weight_map"]["model.residual_gate"]
    exported = load_file(hf / shard)["model.residual_gate"]
    assert exported.tolist() == gated_kind.GATE_VALUES  # the gates the logits above went through
    print(f"gated-loop plug-in part, TP=2: max abs logit diff {diff:.2e}")


def _check_gates_then_set(save: str):
    """``before_save`` of the gated-loop job: record that training moved the gates, that they are among the
    parameters TP ranks keep identical and are identical, then write non-trivial gates for the export."""

    def before_save(trainer) -> None:
        import torch
        from megatron.core import parallel_state
        from plugin_residual_gate import GATE_VALUES

        from megatron_lol.parallel.routing_agreement import replicated_routing_parameters

        chunk = trainer.model_chunks[0]
        core = getattr(chunk, "module", chunk).core
        gate = core.residual_gate
        group = parallel_state.get_tensor_model_parallel_group()
        tp = torch.distributed.get_world_size(group)
        copies = [torch.empty_like(gate) for _ in range(tp)]
        torch.distributed.all_gather(copies, gate.detach().contiguous(), group=group)
        report = {
            "tp": tp,
            "replicated": any(p is gate for p in replicated_routing_parameters(core)),
            "moved": bool((gate != 1).any()),
            "ranks_equal": all(torch.equal(copies[0], c) for c in copies),
        }
        gate.copy_(torch.tensor(GATE_VALUES, dtype=gate.dtype, device=gate.device))
        if torch.distributed.get_rank() == 0:
            with open(f"{save}/plugin_tp.json", "w") as f:
                json.dump(report, f)

    return before_save


if __name__ == "__main__":  # a rank of _train (launched by torch.distributed.run): two steps, then a save
    import os
    import sys

    import plugin_residual_gate
    from test_convert_hf import train_and_save

    register_plan(ReversedLoopPlan)
    plugin_residual_gate.register()
    for save, tokenizer_model, parallel, model in json.loads(sys.argv[1]):
        gated = model["plan"]["kind"] == plugin_residual_gate.GatedLoopPlan.name
        os.makedirs(save, exist_ok=True)
        before = _check_gates_then_set(save) if gated else None
        train_and_save(save, tokenizer_model, parallel, model, steps=2, before_save=before)
