"""HuggingFace export of models with megatron-core FFN mixture-of-experts layers.

Same machinery as ``test_convert_hf.py`` (real trainer and checkpointer, real text,
SentencePiece tokenizer, the native model rebuilt from the checkpoint as reference):
tiny MoE models (width 64, 4 experts of width 48, top-2) with MoE in the prelude / coda
(``moe_layers: fixed``) or in every layer (``all``, with a shared expert), a dense-plan
MoE stack (no longer a Llama stack), and expert-parallel (EP=2) checkpoints.
"""

from __future__ import annotations

import json

import pytest
import torch

from test_convert_hf import _train, check_lol_export, corpus, export, heldout_batch, native_model  # noqa: F401

MOE = dict(num_experts=4, moe_ffn_hidden_size=48, moe_router_topk=2)
VARIANTS = {
    "moe_fixed": ({}, dict(MOE, moe_layers="fixed")),
    "moe_all_shared": ({}, dict(MOE, moe_layers="all", moe_shared_expert_intermediate_size=40)),
    "moe_dense_all": ({}, dict(MOE, moe_layers="all", plan="dense", num_blocks=2)),
}
EP2 = {
    "moe_ep2_lol_fixed": ({"expert_model_parallel_size": 2}, dict(MOE, moe_layers="fixed")),
    "moe_ep2_dense_all": ({"expert_model_parallel_size": 2},
                          dict(MOE, moe_layers="all", plan="dense", num_blocks=2,
                               moe_shared_expert_intermediate_size=40)),
}
BF16_TOL = 0.05


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
        print(f"{name} bf16: max abs logit diff {diff:.2e} (max |logit| {want.abs().max():.2f}), "
              f"argmax agreement {agree:.3f}")
        assert diff <= BF16_TOL, diff
        assert agree >= 0.9, agree  # near-flat logits of a 3-step model: a few near-ties flip


@pytest.mark.slow
@pytest.mark.parametrize("name", list(EP2))
def test_moe_expert_parallel_checkpoint(moe_ep2, name, tmp_path, corpus):  # noqa: F811
    info = __import__("yaml").safe_load(open(next(moe_ep2[name].glob("iter_*/run_config.yaml"))))["checkpoint"]
    assert info["layout"]["ep"] == 2, info["layout"]
    diff = check_lol_export(moe_ep2[name], tmp_path, corpus, gen_tokens=8)
    print(f"{name} (EP=2): max abs logit diff {diff:.2e}")


def test_moe_is_not_a_llama_stack(moe_single, tmp_path):
    from megatron_lol.cli import CliError

    with pytest.raises(CliError, match="moe_layers=all is not an ordinary Llama stack"):
        export(moe_single["moe_dense_all"], tmp_path / "llama", fmt="llama")
    assert not (tmp_path / "llama").exists()
