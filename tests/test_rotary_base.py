"""A fractional RoPE base is honoured end to end: config, model, HF import and export.

A tiny stock ``LlamaForCausalLM`` with ``rope_theta=12345.5`` is imported
(``import_hf``), rebuilt natively from the checkpoint and compared with the HF
model's logits, then exported again (``convert_checkpoint``): the base stays
12345.5 everywhere instead of being truncated to 12345.
"""

from __future__ import annotations

import json

import pytest
import torch

THETA = 12345.5


def _native(ckpt):
    from conftest import ensure_megatron

    ensure_megatron()
    from megatron.core import dist_checkpointing

    from megatron_lol.convert.checkpoint import iteration_dir, read_run_config
    from megatron_lol.model.lol_model import LoLGPTModel

    path, _ = iteration_dir(str(ckpt))
    cfg, info, _ = read_run_config(path, str(ckpt))
    model = LoLGPTModel(cfg.model, cfg.model.vocab_size, info["tokenizer"]["eod_id"])
    state = dist_checkpointing.load(model.sharded_state_dict(prefix="model."), path)
    model.load_state_dict({k[len("model.") :]: v for k, v in state.items() if k.startswith("model.")}, strict=True)
    return model.eval(), cfg


def test_config_keeps_a_fractional_base():
    from megatron_lol.config import config_from_dict

    assert config_from_dict({"model": {"rotary_base": THETA}}).model.rotary_base == THETA


@pytest.mark.timeout(300)
@pytest.mark.multiprocess
def test_fractional_rope_theta_survives_import_model_and_export(tmp_path):
    from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

    from megatron_lol.convert.from_hf import import_hf
    from megatron_lol.convert.to_hf import convert_checkpoint

    torch.manual_seed(0)
    conf = LlamaConfig(
        vocab_size=128,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        rope_theta=THETA,
        tie_word_embeddings=False,
        eos_token_id=2,
        bos_token_id=1,
    )
    hf = LlamaForCausalLM(conf).eval()
    with torch.no_grad():  # make the attention (hence the rotation) matter for the logits
        for name, p in hf.named_parameters():
            if "proj" in name:
                p.mul_(4.0)
    src = tmp_path / "llama"
    hf.save_pretrained(src, safe_serialization=True)

    ckpt = tmp_path / "imported"
    import_hf(str(src), str(ckpt), n_prelude=1, n_coda=1)
    native, cfg = _native(ckpt)
    assert cfg.model.rotary_base == THETA
    # import-hf's run_config.yaml (with its `checkpoint:` record) is a valid --config
    from megatron_lol.config import load_config

    assert load_config(str(ckpt / "iter_0000000" / "run_config.yaml"), check_data=False).model.rotary_base == THETA
    head_dim = 32 // 4
    want = 1.0 / (THETA ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
    assert torch.equal(native.rotary.inv_freq.cpu(), want)
    x = torch.randint(3, 128, (2, 48), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ref = hf(x).logits
        assert (native(x) - ref).abs().max().item() <= 1e-4

    out = tmp_path / "exported"
    convert_checkpoint(str(ckpt), str(out), force=True, export_tokenizer=False)
    assert json.loads((out / "config.json").read_text())["rope_theta"] == THETA
    again = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    with torch.no_grad():
        assert (again(x).logits - ref).abs().max().item() <= 1e-5
