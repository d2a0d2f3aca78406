"""HuggingFace export of models with megatron-core FFN mixture-of-experts layers,
and of the two systems built on them: Foil (looped MoE core, attention untied per
(block, pass)) and Accordion (window run once, then its first k layers again).

Same machinery as ``test_convert_hf.py`` (real trainer and checkpointer, real text,
SentencePiece tokenizer, the native model rebuilt from the checkpoint as reference):
tiny MoE models (width 64, 4 experts of width 48, top-2) with MoE in the prelude / coda
(``moe_layers: fixed``) or in every layer (``all``, with a shared expert), a dense-plan
MoE stack (exported as a LoL model, not as a Llama stack), expert-parallel (EP=2) checkpoints, a tiny Foil and
two tiny Accordions (separate second-pass router with gates and megatron-core's expert-bias balancing on
sigmoid scores; shared router, no gates).
"""

from __future__ import annotations

import json
import sys

import pytest
import torch

# corpus: the shared fixture, imported so that pytest finds it here by name
from test_convert_hf import _train, check_lol_export, corpus, export, heldout_batch, native_model  # noqa: F401

MOE = dict(num_experts=4, moe_ffn_hidden_size=48, moe_router_topk=2)
VARIANTS = {
    "moe_fixed": ({}, dict(MOE, moe_layers="fixed")),
    "moe_all_shared": ({}, dict(MOE, moe_layers="all", moe_shared_expert_intermediate_size=40)),
    "moe_dense_all": ({}, dict(MOE, moe_layers="all", plan="dense", core_layers=2)),
}
EP2 = {
    "moe_ep2_lol_fixed": ({"expert_model_parallel_size": 2}, dict(MOE, moe_layers="fixed")),
    "moe_ep2_dense_all": (
        {"expert_model_parallel_size": 2},
        dict(MOE, moe_layers="all", plan="dense", core_layers=2, moe_shared_expert_intermediate_size=40),
    ),
}
BF16_TOL = 0.05
TOL = 1e-4


@pytest.fixture(scope="module")
def moe_single(corpus):  # noqa: F811
    return _train(corpus, 1, [(name, par, model) for name, (par, model) in VARIANTS.items()])


@pytest.fixture(scope="module")
def moe_ep2(corpus):  # noqa: F811
    return _train(corpus, 2, [(name, par, model) for name, (par, model) in EP2.items()])


def _hf_config(out):
    return json.load(open(out / "hf" / "config.json"))


@pytest.mark.parametrize("name", list(VARIANTS))
def test_moe_logits_and_greedy_generation(moe_single, name, tmp_path, corpus):  # noqa: F811
    diff = check_lol_export(moe_single[name], tmp_path, corpus, gen_tokens=16)
    conf = _hf_config(tmp_path)
    model = VARIANTS[name][1]
    assert conf["moe_layers"] == model["moe_layers"] and conf["num_experts"] == 4
    assert conf["core_num_experts"] == (4 if model["moe_layers"] == "all" else None)
    assert conf["num_experts_per_tok"] == 2 and conf["moe_intermediate_size"] == 48
    assert conf["shared_expert_intermediate_size"] == model.get("moe_shared_expert_intermediate_size")
    print(f"{name}: max abs logit diff {diff:.2e}")


def test_moe_bf16_export(moe_single, tmp_path, corpus):  # noqa: F811
    """``--dtype bf16``: bf16 weights, routers (LoL and MoE) stay fp32; logits close to the fp32 model's."""
    from safetensors import safe_open
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from megatron_lol.cli import main

    for name in ("moe_fixed", "moe_all_shared"):
        out = tmp_path / name
        assert main(["convert-hf", "--load", str(moe_single[name]), "--save", str(out), "--dtype", "bf16"]) == 0
        conf = json.load(open(out / "config.json"))
        assert conf["torch_dtype"] == "bfloat16"
        dtypes = {}
        for shard in out.glob("*.safetensors"):
            with safe_open(str(shard), "pt") as f:
                dtypes.update({k: f.get_tensor(k).dtype for k in f.keys()})
        routers = [k for k in dtypes if ".mlp.router." in k or k.startswith("model.routing.")]
        assert routers and all(dtypes[k] == torch.float32 for k in routers)
        assert all(dtypes[k] == torch.bfloat16 for k in dtypes if k not in routers)
        hf = AutoModelForCausalLM.from_pretrained(out, trust_remote_code=True).eval()  # config dtype: bf16
        params = dict(hf.named_parameters())
        assert params["model.embed_tokens.weight"].dtype == torch.bfloat16
        assert all(params[k].dtype == torch.float32 for k in routers)
        x = heldout_batch(AutoTokenizer.from_pretrained(out, trust_remote_code=True), corpus)
        with torch.no_grad():
            want = native_model(moe_single[name])(x)
            got = hf(x).logits
        assert got.dtype == torch.bfloat16
        diff = (want - got.float()).abs().max().item()
        agree = (want.argmax(-1) == got.argmax(-1)).float().mean().item()
        print(
            f"{name} bf16: max abs logit diff {diff:.2e} (max |logit| {want.abs().max():.2f}), "
            f"argmax agreement {agree:.3f}"
        )
        assert diff <= BF16_TOL, diff
        # the 3-step model's logits are nearly flat, so raw argmax agreement is fragile (near-ties
        # flip); wherever the fp32 top-2 margin exceeds twice the measured bf16 error, it must agree
        top2 = want.topk(2, dim=-1).values
        clear = (top2[..., 0] - top2[..., 1]) > 2 * diff
        assert clear.any() and bool((want.argmax(-1) == got.argmax(-1))[clear].all()), (agree, int(clear.sum()))


@pytest.mark.slow
@pytest.mark.parametrize("name", list(EP2))
@pytest.mark.multiprocess
def test_moe_expert_parallel_checkpoint(moe_ep2, name, tmp_path, corpus):  # noqa: F811
    info = __import__("yaml").safe_load(open(next(moe_ep2[name].glob("iter_*/run_config.yaml"))))["checkpoint"]
    assert info["layout"]["ep"] == 2, info["layout"]
    diff = check_lol_export(moe_ep2[name], tmp_path, corpus, gen_tokens=8)
    print(f"{name} (EP=2): max abs logit diff {diff:.2e}")


def test_moe_is_not_a_llama_stack(moe_single, tmp_path):
    from megatron_lol.errors import CliError

    with pytest.raises(CliError, match=r"moe\.layers=all is not an ordinary Llama stack"):
        export(moe_single["moe_dense_all"], tmp_path / "llama", fmt="llama")
    assert not (tmp_path / "llama").exists()


# ------------------------------------------------------------------ Foil and Accordion
FOIL = dict(
    plan="foil",
    foil_layers=2,
    foil_loops=2,
    num_experts=4,
    foil_experts=6,
    moe_ffn_hidden_size=48,
    moe_router_topk=2,
    moe_layers="all",
    untie_attention=True,
    moe_z_loss_coeff=1e-3,
    moe_loss_average_over_executions=True,
)
ACCORDION = dict(
    plan="accordion",
    n_prelude=1,
    loop_window=3,
    n_coda=1,
    num_experts=4,
    moe_ffn_hidden_size=48,
    moe_router_topk=2,
    moe_layers="all",
    moe_shared_expert_intermediate_size=40,
    loop_budgets=[0, 1, 3],
    second_pass_router="separate",
)
# the separate-router Accordion balances with megatron-core's expert biases (sigmoid scores), at a rate that
# makes three steps' biases choose other experts than the scores alone: the export must carry them
EXPERT_BIAS = dict(
    moe_router_score_function="sigmoid",
    moe_router_enable_expert_bias=True,
    moe_router_bias_update_rate=0.05,
    moe_aux_loss_coeff=0.0,
)
SYSTEMS = {
    "foil": FOIL,
    "accordion": dict(ACCORDION, **EXPERT_BIAS),
    "accordion_shared_nogates": dict(
        ACCORDION, second_pass_router="shared", loop_gates=False, loop_budget=1, loop_budgets=[0, 1, 2, 3]
    ),
}
GATE_NOISE = 0.2  # three training steps move the loop gates ~1e-2 from 1: spread them before saving


def train_perturb_save(save: str, tokenizer_model: str, parallel: dict, model: dict, steps: int = 3) -> str:
    """``test_convert_hf.train_and_save``, then Accordion's loop gates are moved well away from 1."""
    from test_convert_hf import train_and_save

    return train_and_save(save, tokenizer_model, parallel, model, steps, before_save=_spread_loop_gates)


def _spread_loop_gates(trainer) -> None:
    gen = torch.Generator().manual_seed(7)
    for chunk in trainer.model_chunks:
        gates = getattr(getattr(chunk.module, "core", None), "loop_gates", None)
        if gates is not None:
            gates.add_(torch.randn(gates.shape, generator=gen).to(gates.dtype) * GATE_NOISE)


@pytest.fixture(scope="module")
def systems(corpus):  # noqa: F811
    """One 1-process launch (this file is the rank script): Foil and the two Accordions."""
    return _train(corpus, 1, [(name, {}, model) for name, model in SYSTEMS.items()], script=__file__)


def _load(out):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    hf = AutoModelForCausalLM.from_pretrained(out, trust_remote_code=True, dtype=torch.float32).eval()
    return hf, AutoTokenizer.from_pretrained(out, trust_remote_code=True)


def _greedy_hf(hf, prompt, n, **kw):
    return hf.generate(prompt, max_new_tokens=n, min_new_tokens=n, do_sample=False, **kw)


def test_foil_logits_and_cached_generation(systems, tmp_path, corpus):  # noqa: F811
    """Foil: 2 blocks x 2 passes, pass 1 with its own attention; core experts (6) != prelude/coda experts (4)."""
    diff = check_lol_export(systems["foil"], tmp_path, corpus, gen_tokens=16)  # greedy with the KV cache
    conf = _hf_config(tmp_path)
    assert conf["untie_attention"] and conf["core_num_experts"] == 6 and conf["num_experts"] == 4
    assert conf["use_cache"]
    index = json.load(open(tmp_path / "hf" / "model.safetensors.index.json"))["weight_map"]
    assert {
        "model.pass_attention.0_1.self_attn.q_proj.weight",
        "model.pass_attention.1_1.input_layernorm.weight",
        "model.blocks.1.mlp.experts.5.down_proj.weight",
    } <= set(index)
    assert not any(k.startswith("model.pass_attention.") and ".mlp." in k for k in index)
    hf, tok = _load(tmp_path / "hf")
    assert hf.config.num_hidden_layers == 1 + 4 + 1  # layer executions: one KV cache entry each
    # the untied attention is used: pass 1 with the block's own attention gives other logits
    x = heldout_batch(tok, corpus)
    with torch.no_grad():
        ref = hf(x).logits
        for i in range(2):
            att = hf.model.pass_attention[f"{i}_1"]
            att.load_state_dict(
                {
                    "input_layernorm.weight": hf.model.blocks[i].input_layernorm.weight,
                    **{f"self_attn.{k}": v for k, v in hf.model.blocks[i].self_attn.state_dict().items()},
                }
            )
        assert (hf(x).logits - ref).abs().max() > 1e-3
        with pytest.raises(ValueError, match="only plan accordion has a loop budget"):
            hf(x, loop_budget=1)
    print(f"foil: max abs logit diff {diff:.2e}")


def _dense_twin(native, m):
    """The native model with the second pass removed: plan dense over the same prelude, blocks and coda."""
    from dataclasses import replace

    from megatron_lol.model.lol_model import LoLGPTModel

    dense = LoLGPTModel(
        replace(
            m,
            plan={"kind": "dense", "layers": m.plan.window},
        ),
        native.vocab_size,
        native.eod_id,
    )
    state = {
        k: v
        for k, v in native.state_dict().items()
        if not k.startswith(("core.loop_gates", "core.second_pass_routers"))
    }
    dense.load_state_dict(state, strict=True)
    return dense.eval()


@pytest.mark.parametrize("name", ["accordion", "accordion_shared_nogates"])
def test_accordion_every_budget(systems, name, tmp_path, corpus):  # noqa: F811
    m = SYSTEMS[name]
    out = tmp_path / "hf"
    export(systems[name], out)
    conf = json.load(open(out / "config.json"))
    default = m.get("loop_budget", max(m["loop_budgets"]))
    assert conf["loop_budgets"] == m["loop_budgets"] and conf["loop_budget"] == default
    assert conf["use_cache"]
    index = json.load(open(out / "model.safetensors.index.json"))["weight_map"]
    assert ("model.loop_gates" in index) == m.get("loop_gates", True)
    assert ("model.second_pass_routers.2.weight" in index) == (m["second_pass_router"] == "separate")
    bias = m.get("moe_router_enable_expert_bias", False)
    assert conf["moe_router_expert_bias"] == bias and conf["moe_router_score_function"] == m.get(
        "moe_router_score_function", "softmax"
    )
    assert ("model.blocks.0.mlp.router.expert_bias" in index) == bias
    assert ("model.second_pass_routers.2.expert_bias" in index) == (bias and m["second_pass_router"] == "separate")
    hf, tok = _load(out)
    assert hf.config.num_hidden_layers == 1 + 3 + max(m["loop_budgets"]) + 1
    native = native_model(systems[name])
    x = heldout_batch(tok, corpus)
    diffs = {}
    with torch.no_grad():
        if m.get("loop_gates", True):  # the saved gates are far from 1 (this test's perturbation)
            assert (native.core.loop_gates - 1).abs().max() > 0.1
        if bias:  # the biases moved, and the export routes with them: dropping them changes the logits
            assert native.core.blocks["0"].mlp.router.expert_bias.abs().max() > 0
            ref = hf(x).logits
            saved = {n: b.clone() for n, b in hf.named_buffers() if n.endswith("expert_bias")}
            for n, b in hf.named_buffers():
                if n.endswith("expert_bias"):
                    b.zero_()
            assert (hf(x).logits - ref).abs().max() > 1e-3
            for n, b in hf.named_buffers():
                if n in saved:
                    b.copy_(saved[n])
        for k in m["loop_budgets"]:
            want = native(x, budget=k)
            diffs[k] = (want - hf(x, loop_budget=k).logits).abs().max().item()
            assert diffs[k] <= TOL, (k, diffs)
        assert torch.equal(hf(x).logits, hf(x, loop_budget=default).logits)
        budgets = m["loop_budgets"]
        assert (hf(x, loop_budget=budgets[0]).logits - hf(x, loop_budget=budgets[-1]).logits).abs().max() > 1e-3
        # k = 0 is the model with the second pass removed
        twin = _dense_twin(native, native.cfg)
        zero = (twin(x) - hf(x, loop_budget=0).logits).abs().max().item()
        assert zero <= TOL, zero
        with pytest.raises(ValueError, match="loop_budget=5 is not one of"):
            hf(x, loop_budget=5)
    # greedy generation with a budget: KV cache (one entry per execution) == no cache == native
    prompt = x[:1, :12]
    for k in (1, budgets[-1]):
        got = _greedy_hf(hf, prompt, 12, loop_budget=k)
        assert torch.equal(got, _greedy_hf(hf, prompt, 12, loop_budget=k, use_cache=False))
        seq = prompt
        with torch.no_grad():
            for _ in range(12):
                seq = torch.cat([seq, native(seq, budget=k)[:, -1].argmax(-1, keepdim=True)], dim=1)
        assert torch.equal(got, seq), (k, got, seq)
    print(
        f"{name}: max abs logit diff per budget "
        + ", ".join(f"k={k}: {d:.2e}" for k, d in diffs.items())
        + f"; k=0 vs second pass removed: {zero:.2e}"
    )


def test_cache_with_documents_and_padding(systems, tmp_path, corpus):  # noqa: F811
    """The KV cache path equals full recomputation across an EOD and with left padding (batched generate)."""
    out = tmp_path / "hf"
    export(systems["accordion"], out)
    hf, tok = _load(out)
    x = heldout_batch(tok, corpus)
    with torch.no_grad():
        full = hf(x, loop_budget=1).logits
        # prefill 20 tokens (the EOD is at 21), then one token at a time
        step = hf(x[:, :20], loop_budget=1, use_cache=True)
        cache, logits = getattr(step, "cache", None) or step.past_key_values, [step.logits]
        for t in range(20, x.shape[1]):
            step = hf(x[:, t : t + 1], loop_budget=1, cache=cache, context_ids=x[:, : t + 1])
            logits.append(step.logits)
        assert (torch.cat(logits, dim=1) - full).abs().max() <= TOL
        with pytest.raises(ValueError, match="loop_budget=1, not 3"):
            hf(x[:, :1], loop_budget=3, cache=cache, context_ids=x[:, : x.shape[1] + 1])
    # batched generation with left padding: each row as generated alone
    rows = [x[0, :9], x[1, :14]]
    pad = hf.generation_config.pad_token_id if hf.generation_config.pad_token_id is not None else 0
    batch = torch.full((2, 14), pad, dtype=torch.long)
    mask = torch.zeros(2, 14, dtype=torch.long)
    for i, r in enumerate(rows):
        batch[i, 14 - len(r) :], mask[i, 14 - len(r) :] = r, 1
    got = _greedy_hf(hf, batch, 8, attention_mask=mask, loop_budget=1, pad_token_id=pad)
    for i, r in enumerate(rows):
        alone = _greedy_hf(hf, r.unsqueeze(0), 8, loop_budget=1)
        assert torch.equal(got[i, 14:], alone[0, len(r) :]), i


def test_loop_budget_flag(systems, tmp_path):
    from megatron_lol.cli import main

    out = tmp_path / "k1"
    assert (
        main(
            [
                "convert-hf",
                "--load",
                str(systems["accordion"]),
                "--save",
                str(out),
                "--loop-budget",
                "1",
                "--no-tokenizer",
                "--eod-id",
                "2",
            ]
        )
        == 0
    )
    assert json.load(open(out / "config.json"))["loop_budget"] == 1
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(out, trust_remote_code=True, dtype=torch.float32).eval()
    x = torch.arange(3, 40).view(1, -1)
    with torch.no_grad():
        assert torch.equal(hf(x).logits, hf(x, loop_budget=1).logits)
    from megatron_lol.convert.to_hf import convert_checkpoint
    from megatron_lol.errors import CliError

    with pytest.raises(CliError, match=r"^--loop-budget: 2 is not one of the model's budgets \[0, 1, 3\]$"):
        convert_checkpoint(str(systems["accordion"]), str(tmp_path / "k2"), loop_budget=2, export_tokenizer=False)
    with pytest.raises(CliError, match="^--loop-budget: only plan accordion has a loop budget"):
        convert_checkpoint(str(systems["foil"]), str(tmp_path / "k3"), loop_budget=1, export_tokenizer=False)
    assert (
        main(["convert-hf", "--load", str(systems["accordion"]), "--save", str(tmp_path / "k4"), "--loop-budget", "2"])
        == 2
    )
    assert not (tmp_path / "k2").exists() and not (tmp_path / "k4").exists()


if __name__ == "__main__":  # a rank of the ``systems`` launch (tests/cli_processes.py)
    for job in json.loads(sys.argv[1]):
        train_perturb_save(*job)
