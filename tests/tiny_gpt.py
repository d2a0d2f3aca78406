"""A tiny megatron-core GPTModel (local spec, RMSNorm, SwiGLU, RoPE, no bias)
for platform and parallel-layout tests. Import after setup_platform()."""

from __future__ import annotations

import torch
import torch.nn.functional as F

VOCAB = 64
SEQ = 16


def gpt_config(
    num_layers: int = 4,
    hidden: int = 32,
    heads: int = 4,
    ffn: int = 64,
    dropout: float = 0.0,
    **parallel,
):
    """A TransformerConfig; ``parallel`` holds e.g. tensor_model_parallel_size,
    pipeline_model_parallel_size, sequence_parallel, virtual_pipeline_model_parallel_size."""
    from megatron.core.transformer import TransformerConfig

    return TransformerConfig(
        num_layers=num_layers,
        hidden_size=hidden,
        num_attention_heads=heads,
        ffn_hidden_size=ffn,
        normalization="RMSNorm",
        gated_linear_unit=True,
        activation_func=F.silu,
        add_bias_linear=False,
        hidden_dropout=dropout,
        attention_dropout=dropout,
        use_cpu_initialization=True,
        bias_activation_fusion=False,
        masked_softmax_fusion=False,
        bias_dropout_fusion=False,
        apply_rope_fusion=False,
        gradient_accumulation_fusion=False,
        persist_layer_norm=False,
        pipeline_dtype=torch.float32,
        **parallel,
    )


class SPRMSNorm(torch.nn.RMSNorm):
    """torch RMSNorm usable with sequence parallel: megatron's WrappedTorchNorm
    (the local spec's norm) refuses sequence_parallel=True; marking the weight
    ``sequence_parallel`` lets finalize_model_grads all-reduce its gradient."""

    def __init__(self, config, hidden_size, eps=1e-5, **unused):
        super().__init__(hidden_size, eps=eps)
        self.weight.sequence_parallel = config.sequence_parallel


def layer_spec(config, vp_stage=None):
    """Local-spec GPT layer; with sequence parallel, a block spec whose norms are SPRMSNorm."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    spec = get_gpt_layer_local_spec(normalization="RMSNorm")
    if not config.sequence_parallel:
        return spec
    from megatron.core.transformer.transformer_block import (
        TransformerBlockSubmodules,
        get_num_layers_to_build,
    )

    spec.submodules.input_layernorm = SPRMSNorm
    spec.submodules.pre_mlp_layernorm = SPRMSNorm
    n = get_num_layers_to_build(config, vp_stage=vp_stage)
    return TransformerBlockSubmodules(layer_specs=[spec] * n, layer_norm=SPRMSNorm)


def build_gpt(config=None, pre_process=True, post_process=True, vp_stage=None, **config_kw):
    """Build a tiny GPTModel from ``config`` (or ``gpt_config(**config_kw)``)."""
    from megatron.core.models.gpt import GPTModel

    cfg = config if config is not None else gpt_config(**config_kw)
    return GPTModel(
        config=cfg,
        transformer_layer_spec=layer_spec(cfg, vp_stage),
        vocab_size=VOCAB,
        max_sequence_length=SEQ,
        pre_process=pre_process,
        post_process=post_process,
        position_embedding_type="rope",
        share_embeddings_and_output_weights=False,
        vp_stage=vp_stage,
    )


def gpt_batch(batch: int = 2, seq: int = SEQ, vocab: int = VOCAB, seed: int = 0):
    """(tokens, position_ids, labels) as [batch, seq] int64 tensors."""
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, vocab, (batch, seq + 1), generator=g)
    position_ids = torch.arange(seq).unsqueeze(0).expand(batch, -1).contiguous()
    return tokens[:, :-1].contiguous(), position_ids, tokens[:, 1:].contiguous()


def _global_param_name(model, name: str) -> str:
    """Name a parameter by its *global* layer number, so the same parameter
    has the same name in every pipeline stage / virtual chunk."""
    prefix = "decoder.layers."
    if name.startswith(prefix):
        local, rest = name[len(prefix) :].split(".", 1)
        layer = model.decoder.layers[int(local)]
        return f"{prefix}{layer.layer_number - 1}.{rest}"
    return name


def deterministic_init(model, seed: int = 0) -> None:
    """Give every parameter values that depend only on its global name, seed
    and full (unpartitioned) shape, then take this tensor-parallel rank's slice
    the way megatron's CPU initialisation does (``partition_dim``,
    ``partition_stride``: SwiGLU's fc1 is interleaved with stride 2).

    Makes a model built under any TP/PP/VPP layout hold exactly the weights
    of the same model built in one process.
    """
    import zlib

    from megatron.core import parallel_state as ps

    tp_size = ps.get_tensor_model_parallel_world_size()
    tp_rank = ps.get_tensor_model_parallel_rank()
    with torch.no_grad():
        for name, p in model.named_parameters():
            gname = _global_param_name(model, name)
            g = torch.Generator().manual_seed(seed * 1_000_003 + zlib.crc32(gname.encode()))
            is_tp = getattr(p, "tensor_model_parallel", False) and tp_size > 1
            shape = list(p.shape)
            dim = getattr(p, "partition_dim", 0)
            stride = getattr(p, "partition_stride", 1)
            if is_tp:
                shape[dim] *= tp_size
            if "layernorm" in gname or "norm" in gname.split(".")[-2:][0]:
                full = 1.0 + 0.1 * torch.randn(shape, generator=g)
            else:
                full = 0.05 * torch.randn(shape, generator=g)
            if is_tp:
                per = shape[dim] // tp_size // stride
                chunks = torch.split(full, per, dim=dim)
                full = torch.cat(chunks[tp_rank::tp_size], dim=dim)
            p.copy_(full.to(p.dtype))
