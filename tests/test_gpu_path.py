"""The GPU path, checked on the CPU: device placement on a fake GPU, the packed (Transformer Engine)
layout, TE specs, FP8 boundaries and padding, BF16 mixed precision, and what config validation refuses.

The fake-GPU cases run in one fresh subprocess (tests/fake_gpu_check.py; see tests/fake_gpu.py for why
not FakeTensorMode). Tests that need a real GPU are in tests/test_gpu.py (marked ``gpu``).
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from megatron_lol.config import ConfigError, config_from_dict

REPO = Path(__file__).resolve().parent.parent
PAPER = sorted((REPO / "examples" / "configs" / "paper").glob("*.yaml"))
VOCAB, EOD = 97, 0


# ----------------------------------------------------------------------------------- fake GPU
@pytest.fixture(scope="module")
def fake_gpu_results():
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.run(
        [sys.executable, str(REPO / "tests" / "fake_gpu_check.py")],
        capture_output=True,
        text=True,
        timeout=600,
        env=env,
        cwd=str(REPO),
    )
    lines = [l for l in proc.stdout.splitlines() if l.startswith("FAKE_GPU_RESULTS ")]
    assert proc.returncode == 0 and lines, proc.stderr[-3000:]
    return json.loads(lines[-1][len("FAKE_GPU_RESULTS ") :])


PLAN_CASES = [
    "dense-full",
    "dense-sliding",
    "dense-strided",
    "looped",
    "lol",
    "lol-aux-moe",
    "foil",
    "accordion",
    "packed-lol-fp8-rows",
    "packed-dense-sliding",
    "packed-foil",
]


@pytest.mark.timeout(700)
@pytest.mark.parametrize("case", PLAN_CASES)
def test_every_plan_forward_and_backward_on_a_fake_gpu(fake_gpu_results, case):
    """Parameters and inputs on the GPU device; no CPU tensor meets them anywhere in forward or backward
    (dense / looped / LoL grown to 2 of 3 depths with truncated backprop / Foil / Accordion, and the packed
    TE layout with FP8 row padding); the values are those of the CPU run."""
    r = fake_gpu_results[case]
    assert r["ok"], r.get("error", "") + "\n" + r.get("traceback", "")
    assert r["loss_on_gpu"] and r["grads_on_gpu"] and r["same_grads"]
    assert r["loss_diff"] <= 1e-6 and r["grad_diff"] <= 1e-5
    _fused_kernels_only(r["attention"])


def _fused_kernels_only(calls):
    """No attention call materialised a mask: no SDPA call with ``attn_mask``; FlexAttention calls had their
    inputs and block tables on the device, and building the block masks read nothing back to the host."""
    assert calls["sdpa_with_mask"] == 0 and calls["sdpa_other"] == 0, calls
    assert calls["flex"] > 0 and calls["flex_off_device"] == 0 and calls["mask_syncs"] == 0, calls


@pytest.mark.timeout(700)
def test_grouped_routed_core_on_a_fake_gpu(fake_gpu_results):
    """The routed core with the grouped executor (megatron_lol.model.executors.GroupedGEMMs) and its host
    layout shipped to the device: no CPU tensor meets a device tensor, forward or backward; the values
    of the CPU run."""
    r = fake_gpu_results["grouped-core"]
    assert r["ok"], r.get("error", "") + "\n" + r.get("traceback", "")
    assert r["on_gpu"] and r["same_grads"] and r["diff"] <= 1e-6
    _fused_kernels_only(r["attention"])


ATTENTION_KERNELS = {
    "causal": "sdpa_causal",
    "document": "flex",
    "sliding": "flex",
    "strided": "flex",
    "window": "flex",
    "packed": "flex",
    "packed-sliding": "flex",
}


@pytest.mark.timeout(700)
@pytest.mark.parametrize("kind", list(ATTENTION_KERNELS))
def test_attention_takes_the_fused_kernels_on_a_fake_gpu(fake_gpu_results, kind):
    """Dispatch check of each mask kind (tests/attention_cases.py) with its tensors on the fake GPU, forward
    and backward: plain causal attention is one ``F.scaled_dot_product_attention(is_causal=True)`` call with
    no mask tensor; document, sliding, strided, grouped-window and packed (THD) masks are one FlexAttention
    call with a block mask built on the device (no host read) and no SDPA call at all. What this does not
    check: FlexAttention's compiled kernel itself (it cannot run on the fake device; the call runs as the
    softmax under the mask its tables imply, whose values and gradients equal the CPU's here) nor which
    SDPA backend a real GPU picks (``is_causal`` without a mask is what makes the flash kernel eligible)."""
    r = fake_gpu_results["attention-dispatch"]
    assert r["ok"], r.get("error", "") + "\n" + r.get("traceback", "")
    calls = r[kind]
    assert calls["on_gpu"] and calls["diff"] <= 1e-5, calls
    assert calls["sdpa_with_mask"] == 0 and calls["sdpa_other"] == 0, calls
    expected = ATTENTION_KERNELS[kind]
    assert calls[expected] == 1 and calls["sdpa_causal" if expected == "flex" else "flex"] == 0, calls
    assert calls["flex_off_device"] == 0 and calls["mask_syncs"] == 0, calls


@pytest.mark.timeout(700)
def test_grouped_core_expert_exchange_keeps_collectives_on_the_device(fake_gpu_results):
    """The grouped core's expert-parallel exchange (counts, rows, window ids and positions, the way back)
    with NCCL-strict collectives on the fake GPU: device tensors only, the values of the unsharded run."""
    r = fake_gpu_results["grouped-core-expert-exchange"]
    assert r["ok"], r.get("error", "") + "\n" + r.get("traceback", "")
    assert r["on_gpu"] and r["same_grads"] and r["diff"] <= 1e-6
    assert r["collectives"] == ["all_gather", "all_to_all_single"]


@pytest.mark.timeout(700)
def test_a_planted_cpu_tensor_is_caught(fake_gpu_results):
    r = fake_gpu_results["planted-cpu-tensor"]
    assert r["ok"], r.get("error")
    assert r["runs_on_cpu"], "the planted code must be correct on the CPU: only its device is wrong"
    assert r["caught"] and "CPU tensor" in r["error"] and "index_add_" in r["error"]


@pytest.mark.timeout(700)
def test_expert_parallel_dispatch_keeps_collectives_on_the_device(fake_gpu_results):
    """The per-block executor behind the same exchange: device tensors only, the values of the unsharded run."""
    r = fake_gpu_results["expert-parallel-dispatch"]
    assert r["ok"], r.get("error", "") + "\n" + r.get("traceback", "")
    assert r["on_gpu"] and r["same_grads"] and r["diff"] <= 1e-6
    assert r["collectives"] == ["all_gather", "all_to_all_single"]


@pytest.mark.timeout(700)
def test_trainer_steps_on_a_fake_gpu_equal_the_cpu(fake_gpu_results):
    """Trainer.setup moves the model before DDP, batches are moved, every collective (DDP's gradient
    reduction, loss / load / balancing reductions) gets device tensors only; losses equal the CPU run's."""
    r = fake_gpu_results["trainer"]
    assert r["ok"], r.get("error", "") + "\n" + r.get("traceback", "")
    for plan in ("lol", "accordion"):
        p = r[plan]
        assert p["device"] == "fakegpu:0" and p["params_on_gpu"] and p["buffers_on_gpu"]
        assert "all_reduce" in p["collectives"]
        for a, b in zip(p["losses"] + p["grad_norms"], p["cpu_losses"] + p["cpu_grad_norms"]):
            assert a == pytest.approx(b, rel=1e-6)


@pytest.mark.timeout(700)
def test_profile_host_syncs_on_a_fake_gpu(fake_gpu_results):
    """``profile``'s counted steps with the model on the fake GPU: only reads of device values count (the
    step's scalars in one copy to the host, the gradient norm once); dense at most 4 per step, the grouped
    LoL step at most 2 more (issue 36)."""
    r = fake_gpu_results["profile-host-syncs"]
    assert r["ok"], r.get("error", "") + "\n" + r.get("traceback", "")
    dense, lol = r["dense"], r["lol"]
    for p in (dense, lol):
        assert p["device"] == "fakegpu:0" and p["steps"] == 2 and p["ops_per_step"] > 500
        assert p["by_name"].get("_local_scalar_dense") == 1.0 and p["by_name"].get("_to_copy (to host)") == 1.0
        assert p["host_reads_per_step"] > 0  # CPU tensors read on the host: not device reads
    assert dense["per_step"] <= 4 and lol["per_step"] <= dense["per_step"] + 2


def test_to_device_is_the_identity_on_cpu():
    from megatron_lol.platform import device, to_device

    assert device() == torch.device("cpu")
    t = torch.arange(3)
    batch = {"tokens": t, "nested": [t, (t, 5)], "n": 1}
    moved = to_device(batch)
    assert moved["tokens"] is t and moved["nested"][0] is t and moved["nested"][1][0] is t and moved["n"] == 1


# ----------------------------------------------------------------------------- packed layout
def _model_config(**model):
    from fake_gpu_check import model_config  # the tiny configs the fake-GPU cases build

    return model_config(**model)


def _tokens(b=3, s=40):
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(1, VOCAB, (b, s), generator=g)
    for row, cut in zip(range(b), (10, s - 7, 5)):  # documents of several lengths
        tokens[row, cut] = EOD
    return tokens, torch.randint(1, VOCAB, (b, s), generator=g)


def _run(cfg, packed, fw=None, row_multiple=1, film_noise=False):
    from megatron_lol.model.lol_model import LoLGPTModel

    tokens, labels = _tokens()
    net = LoLGPTModel(cfg, VOCAB, EOD, init_seed=1234, packed_sequences=packed).train()
    rows = []
    if net.core is not None:
        net.core.row_multiple = row_multiple
        for block in net.core.blocks.values():
            block.register_forward_pre_hook(lambda m, a, k: rows.append(k["hidden_states"].shape[0]), with_kwargs=True)
    loss = net(tokens, labels=labels, noise_seeds=torch.tensor([11, 12, 13]), **(fw or {}))
    loss.sum().backward()
    grads = {n: p.grad.clone() for n, p in net.named_parameters() if p.grad is not None}
    with torch.no_grad():
        logits = net.eval()(tokens, **(fw or {}))
    return loss.detach(), grads, logits, rows


PACKED = {
    "lol-film-fp8-rows": (
        dict(plan="lol", film="depth_block", input_injection=True),
        dict(depth=2, backprop_depth=1),
        16,
    ),
    "dense-sliding": (dict(plan="dense", core_layers=2, dense_attention="sliding"), {}, 1),
    "dense-strided": (dict(plan="dense", core_layers=2, dense_attention="strided"), {}, 1),
    "foil": (
        dict(
            plan="foil",
            foil_layers=2,
            foil_loops=2,
            num_experts=4,
            foil_experts=8,
            moe_ffn_hidden_size=32,
            moe_router_topk=2,
            moe_layers="all",
            untie_attention=True,
        ),
        {},
        1,
    ),
    "accordion": (
        dict(
            plan="accordion",
            loop_window=3,
            num_experts=4,
            moe_ffn_hidden_size=32,
            moe_router_topk=2,
            moe_layers="all",
            moe_shared_expert_intermediate_size=32,
            loop_budgets=[0, 1, 3],
            num_query_groups=2,
            kv_channels=16,
        ),
        dict(budget=1),
        1,
    ),
}


@pytest.mark.parametrize("name", list(PACKED))
def test_packed_layout_equals_the_local_layout(megatron_env, name):
    """The TE layout (the micro-batch as one THD stream, documents / windows as packed sequences, RoPE
    restarting per sequence, sliding windows from config.window_size) run with local modules equals the
    [s, b, h] layout within 1e-5; FP8's padding of each routed block's rows to 16 changes nothing."""
    model, fw, multiple = PACKED[name]
    cfg = _model_config(**model)
    l0, g0, o0, _ = _run(cfg, False, fw)
    l1, g1, o1, rows = _run(cfg, True, fw, row_multiple=multiple)
    assert l0.shape == l1.shape and o0.shape == o1.shape
    torch.testing.assert_close(l1, l0, rtol=0, atol=1e-5)
    torch.testing.assert_close(o1, o0, rtol=0, atol=1e-5)
    assert g0.keys() == g1.keys() and len(g0) > 10
    for n in g0:
        torch.testing.assert_close(g1[n], g0[n], rtol=1e-4, atol=1e-5, msg=n)
    if multiple > 1:
        routed = [r for r in rows if r != 3 * 40]  # the routed blocks' packed windows
        assert routed and all(r % multiple == 0 for r in routed), rows


@pytest.mark.parametrize("pad_to,recompute", [(1, False), (16, True)])
def test_packed_rope_from_token_positions_equals_megatron_thd_rope_without_host_reads(megatron_env, pad_to, recompute):
    """A packed call given each token's position in its document (SegmentMask.positions) applies RoPE in
    the core attention from per-token angles: the same outputs and gradients bit for bit as megatron-core's
    unfused THD RoPE (which reads the sequence lengths back to the host), and no host read at all."""
    from megatron_lol.model.attention import SegmentMask
    from megatron_lol.model.block_call import call_block
    from megatron_lol.model.lol_model import LoLGPTModel
    from megatron_lol.model.windows import DocumentLayout
    from megatron_lol.perf.op_count import OpCounter

    net = LoLGPTModel(_model_config(plan="dense", core_layers=1), VOCAB, EOD, init_seed=1, packed_sequences=True)
    layer = net.core.block(0)
    layer.config.recompute_granularity = "full" if recompute else None
    tokens, _ = _tokens()
    docs = DocumentLayout.from_tokens(tokens, EOD)
    b, s = tokens.shape
    lengths = torch.bincount(docs.doc_index.reshape(-1))
    cu = torch.cat([torch.zeros(1, dtype=torch.long), torch.cumsum(lengths, 0)])
    x0 = torch.randn(b * s, 1, 32, generator=torch.Generator().manual_seed(5))
    results = []
    for positions in (None, docs.positions):
        x = x0.clone().requires_grad_(True)
        mask = SegmentMask(segments=docs.doc_index, cu_seqlens=cu, positions=positions)
        with OpCounter() as count:
            out, _ = call_block(layer, x, mask, net.rotary(s), packed=True, pad_to=pad_to, recompute=recompute)
            out.square().sum().backward()
        grads = [p.grad.clone() for p in layer.parameters()]
        layer.zero_grad(set_to_none=True)
        results.append((out.detach(), x.grad, grads, count))
    (o0, x0g, g0, c0), (o1, x1g, g1, c1) = results
    assert c0.sync_names["tolist"] > 0  # megatron-core's THD RoPE did read back: the comparison means something
    assert torch.equal(o0, o1) and torch.equal(x0g, x1g)
    assert all(torch.equal(a, c) for a, c in zip(g0, g1))
    assert c1.syncs == 0, c1.sync_names


def test_packed_sliding_window_needs_the_layer_window_size(megatron_env):
    from megatron_lol.model.attention import SegmentMask
    from megatron_lol.model.block_call import call_block
    from megatron_lol.model.lol_model import LoLGPTModel

    net = LoLGPTModel(_model_config(plan="dense", core_layers=1), VOCAB, EOD, init_seed=1, packed_sequences=True)
    x = torch.randn(16, 1, 32)
    mask = SegmentMask(segments=torch.zeros(1, 16, dtype=torch.long), sliding=4)
    with pytest.raises(RuntimeError, match=r"window_size=None.*core_config\(packed=True\)"):
        call_block(net.core.block(0), x, mask, net.rotary(16), packed=True)


# ---------------------------------------------------------------------------------- TE specs
@pytest.fixture
def te_spec_provider(monkeypatch):
    """megatron-core's TE layer spec builds without TE once its provider is importable and its version
    checks answer (the TE classes are megatron-core's names; without TE some are stand-in objects)."""
    import megatron.core.extensions.transformer_engine_spec_provider as provider
    import megatron.core.models.gpt.gpt_layer_specs as specs

    monkeypatch.setattr(specs, "TESpecProvider", provider.TESpecProvider, raising=False)
    monkeypatch.setattr(provider, "is_te_min_version", lambda *a, **k: True)
    import megatron.core.extensions.transformer_engine as te

    return te


@pytest.mark.parametrize("experts", [None, 4])
def test_te_spec_film_layout(megatron_env, te_spec_provider, experts):
    from megatron_lol.model.block_call import LoLTransformerLayer
    from megatron_lol.model.library import block_spec

    te = te_spec_provider
    fused = block_spec(use_te=True, num_experts=experts)
    film = block_spec(use_te=True, num_experts=experts, film=True)
    for spec in (fused, film):
        assert spec.module is LoLTransformerLayer
        assert spec.submodules.self_attention.submodules.core_attention is te.TEDotProductAttention
        assert spec.submodules.sharded_state_dict_keys_map.get("pre_mlp_layernorm.") == (
            "mlp.linear_fc1.layer_norm_" if (experts or spec is film) else None
        )
    # without FiLM: megatron-core's fused norm + linear
    assert fused.submodules.self_attention.submodules.linear_qkv is te.TELayerNormColumnParallelLinear
    # FiLM: separate TENorm modules (their output is what FiLM modulates), then TE column-parallel linears
    sub = film.submodules
    assert sub.input_layernorm is te.TENorm and sub.pre_mlp_layernorm is te.TENorm
    assert sub.self_attention.submodules.linear_qkv is te.TEColumnParallelLinear
    assert sub.sharded_state_dict_keys_map["input_layernorm."] == "self_attention.linear_qkv.layer_norm_"
    if experts is None:
        assert sub.mlp.submodules.linear_fc1 is te.TEColumnParallelLinear
    else:  # the MoE's experts and router are megatron-core's as they are
        assert sub.mlp == fused.submodules.mlp


def test_local_and_te_film_layouts_save_the_same_keys(megatron_env):
    """The local spec's keys map (what its checkpoints are named) is the one the TE FiLM layout uses."""
    from megatron_lol.model.library import block_spec

    local = block_spec(use_te=False).submodules.sharded_state_dict_keys_map
    assert local == {
        "input_layernorm.": "self_attention.linear_qkv.layer_norm_",
        "pre_mlp_layernorm.": "mlp.linear_fc1.layer_norm_",
    }


# ------------------------------------------------------------------------- validation under TE
def _shrunk(model) -> dict:
    """A tiny model config with the same options (plan, FiLM, attention, MoE kinds, budgets...)."""
    d = {f.name: getattr(model, f.name) for f in dataclasses.fields(model)}
    d.update(
        hidden_size=32,
        num_attention_heads=4,
        ffn_hidden_size=64,
        kv_channels=None,
        vocab_size=128,
        window_size=8,
        window_shift=4,
        n_prelude=min(d["n_prelude"], 1),
        n_coda=min(d["n_coda"], 1),
        precision=dataclasses.replace(model.precision, transformer_engine=False, params_dtype="fp32", fp8=None),
    )
    moe = model.moe
    d["moe"] = dataclasses.replace(
        moe,
        num_experts=moe.num_experts and min(moe.num_experts, 4),
        core_num_experts=moe.core_num_experts and min(moe.core_num_experts, 4),
        router_topk=min(moe.router_topk, 2),
        ffn_hidden_size=moe.ffn_hidden_size and 32,
        shared_expert_intermediate_size=moe.shared_expert_intermediate_size and 32,
    )
    if d["num_query_groups"]:
        d["num_query_groups"] = 2
    small = {
        "num_blocks": 3,
        "routed_depth": 3,
        "core_layers": 2,
        "loop_layers": 2,
        "loop_count": 2,
        "foil_layers": 2,
        "foil_loops": 2,
        "foil_experts": 4,
        "loop_window": 3,
    }
    for key, n in small.items():
        if d.get(key) is not None:
            d[key] = min(d[key], n)
    if d["plan"] == "accordion":
        d["loop_budgets"] = sorted({min(k, 3) for k in d["loop_budgets"]})
        d["loop_budget"] = None
    return d


@pytest.mark.parametrize("path", PAPER, ids=lambda p: p.stem)
def test_paper_configs_with_transformer_engine(megatron_env, monkeypatch, path):
    """Every paper config with ``--set model.precision.transformer_engine=true`` (and with BF16 FP8 on top) is
    accepted or refused by validation in one line naming a key; an accepted one builds and runs forward and
    backward in the TE layout (packed sequences, sliding windows from the config, FiLM norms)."""
    from megatron_lol.config import load_config
    from megatron_lol.model.lol_model import LoLGPTModel

    monkeypatch.setattr("megatron_lol.platform.has_transformer_engine", lambda: True)
    monkeypatch.setattr("megatron_lol.platform.cuda_available", lambda: True)  # params_dtype auto: bf16
    for extra in (
        [],
        [("model.precision.params_dtype", "bf16", "--bf16"), ("model.precision.fp8", "hybrid", "--fp8-format")],
    ):
        overrides = [
            ("model.precision.transformer_engine", True, "--set model.precision.transformer_engine=true"),
            *extra,
        ]
        try:
            cfg = load_config(path, overrides, check_data=False)
        except ConfigError as err:
            message = str(err)
            assert "\n" not in message and message.split(":")[0].count(".") in (1, 2), message
            assert message.split(":")[0].split(".")[0] in ("model", "parallel", "training", "curriculum")
            continue
        assert cfg.model.precision.transformer_engine is True and cfg.model.precision.params_dtype == "bf16"
    # the paper configs' own options (not their sizes) in the TE layout, with local modules
    cfg = load_config(path, [("model.precision.transformer_engine", True, "--set")], check_data=False)
    tiny = config_from_dict({"model": _shrunk(cfg.model)}).model
    net = LoLGPTModel(tiny, 128, EOD, init_seed=3, packed_sequences=True).train()
    tokens = torch.randint(1, 128, (2, 24), generator=torch.Generator().manual_seed(0))
    tokens[0, 7] = EOD
    loss = net(tokens, labels=tokens, noise_seeds=torch.tensor([1, 2]))
    loss.mean().backward()
    assert torch.isfinite(loss).all()


def test_fp8_and_precision_validation(monkeypatch):
    base = dict(hidden_size=64, num_attention_heads=4, num_blocks=4, routed_depth=4, window_size=8, window_shift=4)
    with pytest.raises(
        ConfigError, match=r"^model\.precision\.params_dtype: fp16 is not offered \(it needs loss scaling\)"
    ):
        config_from_dict({"model": dict(base, params_dtype="fp16")})
    monkeypatch.setattr("megatron_lol.platform.has_transformer_engine", lambda: True)
    fp8 = dict(base, params_dtype="bf16", fp8="hybrid")
    cfg = config_from_dict({"model": fp8, "training": {"seq_length": 64, "micro_batch_size": 2}})
    # a routed plan: current scaling by default (delayed scaling is refused for it: tests/test_gpu_first_run.py)
    assert (cfg.model.precision.fp8, cfg.model.precision.fp8_recipe, cfg.model.precision.fp8_amax_history_len) == (
        "hybrid",
        "tensorwise",
        1,
    )
    with pytest.raises(
        ConfigError,
        match=r"^training\.seq_length: FP8 GEMMs \(tensorwise\) need micro_batch_size x "
        r"seq_length = 30 tokens in multiples of 16",
    ):
        config_from_dict({"model": fp8, "training": {"seq_length": 15, "micro_batch_size": 2}})
    with pytest.raises(ConfigError, match=r"^model\.precision\.fp8: routed MoE blocks"):
        config_from_dict({"model": dict(fp8, num_experts=4, moe_layers="all")})
    with pytest.raises(ConfigError, match=r"^model\.precision\.fp8_amax_compute_algo: must be one of most_recent, max"):
        config_from_dict({"model": dict(fp8, fp8_amax_compute_algo="mean")})
    with pytest.raises(ConfigError, match=r"^model\.precision\.fp8: FP8 training needs params_dtype: bf16"):
        config_from_dict({"model": dict(fp8, params_dtype="fp32")})
    monkeypatch.setattr("megatron_lol.platform.cuda_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    with pytest.raises(ConfigError, match=r"^model\.precision\.fp8_recipe: mxfp8 needs a Blackwell GPU"):
        config_from_dict({"model": dict(fp8, fp8_recipe="mxfp8")})


def test_megatron_lm_precision_flags(tmp_path, monkeypatch):
    import argparse

    from megatron_lol.config.loader import add_config_arguments, config_from_args

    monkeypatch.setattr("megatron_lol.platform.has_transformer_engine", lambda: True)
    path = tmp_path / "c.yaml"
    path.write_text(
        "model: {hidden_size: 64, num_attention_heads: 4, num_blocks: 4, routed_depth: 4}\n"
        "training: {seq_length: 64, micro_batch_size: 2}\n"
    )
    parser = argparse.ArgumentParser()
    add_config_arguments(parser)
    args = parser.parse_args(
        [
            "--config",
            str(path),
            "--bf16",
            "--transformer-impl",
            "transformer_engine",
            "--fp8-format",
            "e4m3",
            "--fp8-recipe",
            "tensorwise",
            "--fp8-amax-history-len",
            "1024",
            "--fp8-amax-compute-algo",
            "max",
            "--fp8-margin",
            "1",
        ]
    )
    m = config_from_args(args, check_data=False).model
    assert (m.precision.params_dtype, m.precision.transformer_engine, m.precision.fp8, m.precision.fp8_recipe) == (
        "bf16",
        True,
        "e4m3",
        "tensorwise",
    )
    assert (m.precision.fp8_amax_history_len, m.precision.fp8_amax_compute_algo, m.precision.fp8_margin) == (
        1024,
        "max",
        1,
    )
    args = parser.parse_args(["--config", str(path), "--fp16"])
    with pytest.raises(ConfigError, match=r"^model\.precision\.params_dtype: fp16"):
        config_from_args(args, check_data=False)


# ------------------------------------------------------------------------------ FP8 boundaries
def test_fp8_runs_the_layers_only(megatron_env, monkeypatch):
    """Inside the model's FP8 context: every transformer layer's linear; outside (or in the disabled
    region): the embedding, the window router and the LM head. TE's autocast is replaced by a recorder."""
    import contextlib

    from megatron_lol.model import precision
    from megatron_lol.model.lol_model import LoLGPTModel

    state = [False]

    @contextlib.contextmanager
    def recorder(config, enabled):
        saved = state[0]
        state[0] = enabled
        try:
            yield
        finally:
            state[0] = saved

    monkeypatch.setattr(precision, "_te_autocast", recorder)
    cfg = _model_config(plan="lol", film="depth", num_experts=4, moe_ffn_hidden_size=32, moe_layers="fixed")
    net = LoLGPTModel(cfg, VOCAB, EOD, init_seed=1).train()
    # what transformer_config sets from model.precision.fp8 (TE itself is not here), in the model's config and
    # in the core's (its own copy: library.core_config)
    net.config.fp8 = net.core.tconfig.fp8 = "hybrid"
    seen: dict = {}
    for name, module in net.named_modules():
        if (
            isinstance(module, torch.nn.Linear)
            or type(module).__name__.endswith("ParallelLinear")
            or type(module).__name__ in ("VocabParallelEmbedding", "TopKRouter")
        ):
            module.register_forward_pre_hook(lambda m, a, n=name: seen.setdefault(n, set()).add(state[0]))
    tokens, labels = _tokens(2, 24)
    net(tokens, labels=labels, noise_seeds=torch.tensor([1, 2]))
    layers = {n: s for n, s in seen.items() if n.startswith(("prelude.", "coda.", "core.blocks."))}
    gemms = {n: s for n, s in layers.items() if "linear" in n and "router" not in n}
    assert len(gemms) >= 20 and all(s == {True} for s in gemms.values()), gemms
    outside = {n: s for n, s in seen.items() if n.startswith(("core.routers", "output_layer", "embedding"))}
    assert len(outside) >= 3 and all(s == {False} for s in outside.values()), outside
    assert precision.row_multiple(net.config) == 16 and net.core.row_multiple == 1  # built before fp8 was set


# ------------------------------------------------------------------------- mixed precision
def test_bf16_model_keeps_routing_fp32_and_ddp_main_grads_fp32(megatron_env):
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig

    from megatron_lol.model.lol_model import LoLGPTModel

    cfg = _model_config(plan="lol", film="depth", params_dtype="bf16")
    net = LoLGPTModel(cfg, VOCAB, EOD, init_seed=1).train()
    dtypes = {n: p.dtype for n, p in net.named_parameters()}
    assert dtypes["core.blocks.0.self_attention.linear_qkv.weight"] == torch.bfloat16
    assert dtypes["core.film_gamma"] == torch.bfloat16
    for name in ("core.routers.0.logits.weight", "core.routers.0.noise_scale.weight", "core.depth_vectors"):
        assert dtypes[name] == torch.float32, name
    assert net.core.balancer.bias.dtype == torch.float32 and net.core.balancer.loads.dtype == torch.float64
    tokens, labels = _tokens(2, 24)
    loss, core = net(tokens, labels=labels, noise_seeds=torch.tensor([1, 2]), record=True, return_core=True)
    assert loss.dtype == torch.float32
    assert all(r.probs.dtype == torch.float32 and r.gate.dtype == torch.float32 for r in core.records)
    ddp = DistributedDataParallel(
        config=net.config, ddp_config=DistributedDataParallelConfig(grad_reduce_in_fp32=True), module=net
    )
    loss.sum().backward()
    assert {p.main_grad.dtype for p in ddp.module.parameters()} == {torch.float32}


def test_fp8_padding_bench_runs():
    """bench/fp8_padding.py (the figures in docs/performance.md) runs and stays within its bound:
    at most 15 padding rows per block per depth."""
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.run(
        [sys.executable, str(REPO / "bench" / "fp8_padding.py"), "--batches", "1"],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
        cwd=str(REPO),
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    rows = [l for l in proc.stdout.splitlines() if l.startswith("lol-360m")]
    assert len(rows) == 5
    for line in rows:
        import re

        L, tokens, uniform, one_block, _ = re.match(
            r".+?\s+(\d+)\s+(\d+)\s+([\d.]+)%\s+([\d.]+)%\s+([\d.]+)%$", line
        ).groups()
        assert 0 < float(uniform) <= 100 * 15 * int(L) / int(tokens) and float(one_block) == 0.0, line
