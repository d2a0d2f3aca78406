"""BF16 gradients of every parameter against FP32 at the same (BF16-rounded) weights, per executor and plan.

One training step's backward at 4 x 1,024 tokens: the model in BF16 (megatron-core's fused
gradient accumulation: linear weight gradients land in FP32 ``main_grad``, as the trainer runs
it) and the same model in FP32, with the same weights (the BF16 ones, widened), the same
tokens and, for routed plans, the same forced routes (so both precisions run the same path).
For each parameter, ``|g_bf16 - g_fp32| / |g_fp32|``:

* the per-block executor (megatron-core ``TransformerLayer`` calls, one per block and depth)
  is the yardstick: every parameter within ``MAX_ERROR``;
* the grouped executor (the routed core a GPU runs) within ``MAX_ERROR`` and within 2x the
  per-block executor's worst error of the same parameter kind (a kind: the name with its block,
  depth and layer numbers dropped), or within one BF16 rounding (2^-8) where both are that small.

A sum over the thousands of rows a block sees per depth accumulated in BF16 (as
``torch.segment_reduce`` does in its input dtype) puts the grouped core's norm gains and FiLM
far outside both bounds; ``test_fidelity_test_sees_a_bf16_row_sum`` shows the test catches it.
"""

from __future__ import annotations

import re

import pytest
import torch
from conftest import ensure_megatron

VOCAB, EOD = 97, 0
B, S = 4, 1024
MAX_ERROR = 0.02
# below one BF16 rounding (2^-8) two errors are not told apart: the 2x comparison starts there
BF16_ULP = 2.0**-8
_BASE = dict(
    hidden_size=64,
    num_attention_heads=4,
    ffn_hidden_size=128,
    window_size=64,
    window_shift=32,
    n_prelude=1,
    n_coda=1,
)
# every token to every expert: MoE routes are then the same in both precisions (a top-2 of 4 flips
# near-ties between BF16 and FP32, and an expert's gradient then differs by whole tokens)
_MOE = dict(num_experts=4, moe_ffn_hidden_size=64, moe_router_topk=4, moe_layers="all")
PLANS = {
    "lol": dict(plan=dict(kind="lol", num_blocks=3, routed_depth=4), film="depth_block"),
    "looped": dict(plan=dict(kind="looped", layers=2, loops=3)),
    "foil": dict(plan=dict(kind="foil", experts=4, layers=2, loops=2, untie_attention=True), **_MOE),
    "accordion": dict(plan=dict(kind="accordion", window=2, budgets=[0, 2]), **_MOE),
}


def _tokens():
    g = torch.Generator().manual_seed(11)
    tokens = torch.randint(1, VOCAB, (B, S), generator=g)
    tokens[0, 300] = tokens[1, 700] = tokens[2, 64] = tokens[2, 900] = EOD  # documents of several lengths
    return tokens


def _build(model: dict, dtype: str):
    from megatron_lol.config import config_from_dict
    from megatron_lol.model.lol_model import LoLGPTModel

    ensure_megatron(7)
    cfg = config_from_dict({"model": {**_BASE, **model, "params_dtype": dtype}}).model
    net = LoLGPTModel(cfg, VOCAB, EOD, init_seed=7, gradient_accumulation_fusion=dtype == "bf16")
    return net.train(), cfg


def _pair(model: dict):
    """The BF16 model and an FP32 model holding exactly its (rounded) weights; FiLM and norm gains
    perturbed away from their initial 1 / 0, so their gradients are not those of an identity."""
    bf16, cfg = _build(model, "bf16")
    fp32, _ = _build(model, "fp32")
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for name, p in bf16.named_parameters():
            if "film" in name or "norm" in name or "loop_gates" in name:
                p.add_(0.1 * torch.randn(p.shape, generator=g).to(p.dtype))
        for p, q in zip(bf16.parameters(), fp32.parameters()):
            q.copy_(p.float())
    return bf16, fp32, cfg


def _forced(cfg):
    """Random blocks and gates for every (depth, window ordinal): both precisions route alike."""
    from megatron_lol.model.core import ForcedPath

    plan = cfg.execution_plan()
    g = torch.Generator().manual_seed(5)
    k = S // cfg.plan.windows.size + 2
    ids = torch.randint(0, plan.num_stored_blocks, (plan.depth, k), generator=g)
    gates = 0.3 + 0.6 * torch.rand(plan.depth, k, generator=g)
    return ForcedPath(ids=ids, gates=gates)


def _grads(net, cfg, tokens, executor: str) -> dict:
    """Each parameter's gradient after one forward and backward, as megatron-core's DDP would see it."""
    from megatron_lol.model.host_layout import build_host_layout

    for p in net.parameters():
        p.grad = None
        p.main_grad = torch.zeros(p.shape, dtype=torch.float32)
        p.grad_added_to_main_grad = False
    plan = cfg.execution_plan()
    kwargs = dict(noise_seeds=torch.arange(1, B + 1))
    if plan.routed:
        kwargs["forced_path"] = _forced(cfg)
    if plan.routed:  # the routed depths' executor, as a model built for it would choose
        from megatron_lol.model.executors import GroupedGEMMs, PerBlockCalls
        from megatron_lol.model.grouped_core import grouped_core_support

        if executor == "grouped":
            assert grouped_core_support(net.core) is None
        net.core.executor = GroupedGEMMs() if executor == "grouped" else PerBlockCalls()
        depths = [step.depth for step in plan.steps() if step.routed]
        kwargs["layout"] = build_host_layout(
            tokens,
            EOD,
            cfg.plan.windows.size,
            cfg.plan.windows.shift,
            depths,
            plan.num_stored_blocks,
            kwargs["noise_seeds"],
        )
    labels = torch.roll(tokens, -1, dims=1)
    loss = net(tokens, labels, **kwargs).float().mean()
    loss.backward()
    out = {}
    for name, p in net.named_parameters():
        g = p.main_grad.clone()
        if p.grad is not None and not p.grad_added_to_main_grad:
            g += p.grad.float()
        out[name] = g
    return out


def _errors(model: dict, executor: str) -> dict:
    tokens = _tokens()
    bf16, fp32, cfg = _pair(model)
    truth = _grads(fp32, cfg, tokens, "reference")
    got = _grads(bf16, cfg, tokens, executor)
    errors = {}
    for name, want in truth.items():
        norm = want.norm()
        if norm > 0:
            errors[name] = float((got[name] - want).norm() / norm)
    return errors


def _kind(name: str) -> str:
    """A parameter's kind: its name without block, depth, pass and expert numbers."""
    return re.sub(r"\.\d+(_\d+)?(?=\.|$)", ".N", name)


@pytest.fixture
def per_block_executor(monkeypatch):
    # megatron-core's per-layer calls, as on a GPU (not the CPU backend's fused fast paths)
    monkeypatch.setenv("MEGATRON_LOL_CPU_BACKEND", "0")


@pytest.mark.parametrize("kind", sorted(PLANS))
def test_bf16_gradients_of_every_parameter_follow_fp32(megatron_env, per_block_executor, kind):
    reference = _errors(PLANS[kind], "reference")
    assert len(reference) > 10
    worst = max(reference, key=reference.get)
    assert reference[worst] <= MAX_ERROR, f"{kind}, per-block executor: {worst} off by {reference[worst]:.4f}"
    if kind != "lol":  # the grouped executor runs routed depths only
        return
    grouped = _errors(PLANS[kind], "grouped")
    assert grouped.keys() == reference.keys()
    kind_worst = {}
    for name, err in reference.items():
        kind_worst[_kind(name)] = max(kind_worst.get(_kind(name), 0.0), err)
    bad = {
        name: (round(err, 4), round(kind_worst[_kind(name)], 4))
        for name, err in grouped.items()
        if err > MAX_ERROR or err > max(2 * kind_worst[_kind(name)], BF16_ULP)
    }
    assert not bad, f"grouped executor: (error, per-block worst of the kind) {bad}"
    # FiLM per depth and block, and the blocks' norm gains, are in the comparison
    assert any("film" in n for n in grouped) and any("layernorm" in n or "norm" in n for n in grouped)


def test_fidelity_test_sees_a_bf16_row_sum(megatron_env, per_block_executor, monkeypatch):
    """With the grouped core's row sums accumulated in BF16 (``torch.segment_reduce`` in the rows' dtype,
    which it does without the FP32 widening), its FiLM and norm-gain gradients leave the bounds."""
    from megatron_lol.model import static_routing

    def bf16_segment_sum(x, offsets):
        return torch.segment_reduce(x, "sum", offsets=offsets, axis=0, unsafe=True)

    monkeypatch.setattr(static_routing, "segment_sum", bf16_segment_sum)
    grouped = _errors(PLANS["lol"], "grouped")
    film = max(err for name, err in grouped.items() if "film" in name)
    assert film > MAX_ERROR


def main() -> None:
    """``python tests/test_bf16_fidelity.py``: the worst error per parameter kind of both executors (LoL)."""
    import os
    import warnings

    warnings.filterwarnings("ignore")
    os.environ["MEGATRON_LOL_CPU_BACKEND"] = "0"
    torch.set_num_threads(1)
    table = {}
    for executor in ("reference", "grouped"):
        for name, err in _errors(PLANS["lol"], executor).items():
            row = table.setdefault(_kind(name), {})
            row[executor] = max(row.get(executor, 0.0), err)
    print(f"{'parameter kind':<48} {'per-block':>10} {'grouped':>10}")
    for kind, row in sorted(table.items()):
        print(f"{kind:<48} {row['reference']:>10.4f} {row['grouped']:>10.4f}")


if __name__ == "__main__":
    main()
