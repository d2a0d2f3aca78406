"""A block that runs more than once per micro-batch keeps every call's weight gradient under Transformer Engine.

megatron-core 0.16.1's TE linears (``megatron/core/extensions/transformer_engine.py``, ``TELinear``,
``TELayerNormColumnParallelLinear``, ``TEGroupedLinear``) hand TE ``is_first_microbatch`` unless their
config's ``disable_parameter_transpose_cache`` is set, and TE's backward then writes the first
micro-batch's weight gradient into ``main_grad`` with ``accumulate=False`` (docs/gpu.md, "A block that
runs at several depths"). The CPU part here applies that rule to every linear of the built model: a
linear called more than once in a forward must be built from a config that disables the cache; one
called once keeps it (FP8 weight caching stays on for the prelude and coda). The ``gpu`` test runs TE's
own layers: a block's ``main_grad`` after two micro-batches at three depths equals the sum of its calls'.
"""

from __future__ import annotations

import collections

import pytest
import torch
from conftest import ensure_megatron

VOCAB, EOD = 96, 0
_BASE = dict(hidden_size=32, num_attention_heads=4, window_size=8, window_shift=4, n_prelude=1, n_coda=1)
_MOE = dict(num_experts=4, moe_ffn_hidden_size=32, moe_router_topk=2, moe_layers="all")

PLANS = {
    "lol": dict(plan=dict(kind="lol", num_blocks=3, routed_depth=4)),
    "looped": dict(plan=dict(kind="looped", layers=2, loops=3)),
    "foil": dict(plan=dict(kind="foil", experts=8, layers=2, loops=2, untie_attention=True), **_MOE),
    "accordion": dict(plan=dict(kind="accordion", window=2, budgets=[0, 2]), **_MOE),
    "dense": dict(plan=dict(kind="dense", layers=3)),
}


def _model(**model):
    from megatron_lol.config import config_from_dict
    from megatron_lol.model.lol_model import LoLGPTModel

    ensure_megatron(3)
    cfg = config_from_dict({"model": {**_BASE, **model}}).model
    net = LoLGPTModel(cfg, VOCAB, EOD, init_seed=3)
    if hasattr(net.core, "routers"):
        gen = torch.Generator().manual_seed(4)
        with torch.no_grad():  # routes spread over the blocks, so blocks run at several depths
            for router in net.core.routers:
                router.logits.weight.copy_(torch.randn(router.logits.weight.shape, generator=gen))
    return net


def _linear_calls(net) -> dict:
    """Calls of every megatron-core linear (a module with a weight and a TransformerConfig) in one forward."""
    from megatron.core.transformer.transformer_config import TransformerConfig

    calls = collections.Counter()
    handles = []
    for name, module in net.named_modules():
        if isinstance(getattr(module, "config", None), TransformerConfig) and isinstance(
            getattr(module, "weight", None), torch.nn.Parameter
        ):
            handles.append(module.register_forward_hook(lambda m, i, o, name=name: calls.update([name])))
    tokens = torch.randint(1, VOCAB, (2, 64), generator=torch.Generator().manual_seed(0))
    try:
        net.eval()
        with torch.no_grad():
            net(tokens)
    finally:
        for h in handles:
            h.remove()
    return {name: n for name, n in calls.items()}


def te_would_hand_first_microbatch(module) -> bool:
    """megatron-core's rule (TELinear.forward):
    ``None if disable_parameter_transpose_cache else is_first_microbatch``."""
    return not module.config.disable_parameter_transpose_cache


@pytest.mark.parametrize("kind", sorted(PLANS))
def test_no_layer_that_runs_twice_would_get_is_first_microbatch(megatron_env, kind):
    net = _model(**PLANS[kind])
    calls = _linear_calls(net)
    modules = dict(net.named_modules())
    assert calls, "no linear layer ran"
    repeated = {name for name, n in calls.items() if n > 1}
    if kind == "dense":
        assert not repeated
    else:
        assert repeated, f"plan {kind}: no stored layer ran twice (the test would prove nothing)"
    wrong = [name for name in repeated if te_would_hand_first_microbatch(modules[name])]
    assert not wrong, f"plan {kind}: these layers run more than once but TE would see is_first_microbatch: {wrong}"
    assert net.core.plan.reruns_blocks == (kind != "dense")
    # layers that run once keep TE's FP8 weight caching
    once = [name for name, n in calls.items() if n == 1 and not name.startswith("core.")]
    assert once and all(te_would_hand_first_microbatch(modules[name]) for name in once)


@pytest.mark.gpu
def test_te_block_main_grad_is_the_sum_of_its_calls_over_depths_and_microbatches():
    """TE's own layers: one looped block run at 3 depths, 2 micro-batches, fused wgrad accumulation into
    main_grad; its main_grad equals the sum of the gradients of its 6 calls (each computed alone)."""
    from megatron_lol.platform import has_transformer_engine

    if not has_transformer_engine():
        pytest.skip("Transformer Engine is not installed")
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_with_transformer_engine_spec
    from megatron.core.transformer.transformer_config import TransformerConfig
    from megatron.core.transformer.transformer_layer import TransformerLayer

    ensure_megatron(5)
    torch.manual_seed(5)
    spec = get_gpt_layer_with_transformer_engine_spec()

    def config(fused: bool) -> TransformerConfig:
        return TransformerConfig(
            num_layers=1,
            hidden_size=64,
            num_attention_heads=4,
            params_dtype=torch.bfloat16,
            bf16=True,
            gradient_accumulation_fusion=fused,
            # what library.core_config sets for a plan whose blocks run more than once
            disable_parameter_transpose_cache=True,
            add_bias_linear=False,
        )

    def run(layer, inputs, grads) -> None:
        for micro, (xs, gs) in enumerate(zip(inputs, grads)):
            if micro == 0:  # what megatron-core's schedules do on the first micro-batch of a step
                for m in layer.modules():
                    if hasattr(m, "is_first_microbatch"):
                        m.is_first_microbatch = True
            h = xs
            for _ in range(3):  # the same layer at three depths
                h, _ctx = layer(h, attention_mask=None)
            h.backward(gs)

    dev = torch.device("cuda")
    inputs = [torch.randn(16, 2, 64, device=dev, dtype=torch.bfloat16) for _ in range(2)]
    grads = [torch.randn(16, 2, 64, device=dev, dtype=torch.bfloat16) for _ in range(2)]
    fused = TransformerLayer(config(True), spec.submodules, layer_number=1).to(dev)
    plain = TransformerLayer(config(False), spec.submodules, layer_number=1).to(dev)
    plain.load_state_dict(fused.state_dict())
    for p in fused.parameters():
        p.main_grad = torch.zeros(p.shape, dtype=torch.float32, device=dev)
    run(fused, inputs, grads)  # TE adds each call's weight gradient to main_grad
    run(plain, inputs, grads)  # autograd sums every call's gradient in .grad
    for (name, p), q in zip(fused.named_parameters(), plain.parameters()):
        if name.endswith("weight") and q.grad is not None and "norm" not in name:
            torch.testing.assert_close(p.main_grad, q.grad.float(), rtol=3e-2, atol=2e-3, msg=name)
