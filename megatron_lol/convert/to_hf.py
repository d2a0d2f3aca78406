"""``megatron-lol convert-hf``: a training checkpoint -> a HuggingFace model directory.

Reads a ``torch_dist`` checkpoint of any parallel layout on CPU, without GPUs or
process groups, one tensor at a time (see :mod:`.checkpoint`), and writes:

* ``config.json`` and ``generation_config.json``;
* ``model-0000i-of-0000n.safetensors`` shards and ``model.safetensors.index.json``;
* for LoL / looped / non-standard dense models, ``configuration_lol.py`` and
  ``modeling_lol.py`` (with the modules it imports) registered through ``auto_map`` (load with
  ``trust_remote_code=True``); a dense model with full attention and no FiLM /
  input injection is written as a stock ``LlamaForCausalLM`` (no remote code);
* tokenizer files ``AutoTokenizer`` loads (:mod:`.tokenizer_export`).

Only safetensors, JSON and the remote-code Python files are written. Peak memory is one
safetensors shard (``--max-shard-size``) plus one tensor. The directory is built
next to ``--save`` and renamed into place when complete.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from typing import Optional

import torch

from megatron_lol.config.schema import ExperimentConfig, ModelConfig
from megatron_lol.convert import mapping
from megatron_lol.convert.checkpoint import DistCheckpointReader, check_output_apart, iteration_dir, read_run_config
from megatron_lol.convert.part_sources import plugin_parts, write_part_sources
from megatron_lol.errors import CliError
from megatron_lol.model.parts import model_parts
from megatron_lol.plan.pass_parts import pass_parts_of
from megatron_lol.plan.routing import routing_of
from megatron_lol.plan.windows import fixed_attention_of, windows_of
from megatron_lol.progress import progress

TEMPLATES = os.path.join(os.path.dirname(__file__), "hf_modeling")
# the remote code written next to a LoL model's config.json (modeling_lol.py imports the others)
TEMPLATE_FILES = (
    "configuration_lol.py",
    "modeling_lol.py",
    "layers_lol.py",
    "cache_lol.py",
    "decoding_lol.py",
    "parts_lol.py",
    "plugin_parts_lol.py",
)
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
DTYPE_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16"}
# kept in fp32 whatever --dtype (the native model computes LoL routing and megatron-core's
# MoE router logits in fp32; a bf16 router weight widens exactly)
FP32_NAMES = ("model.routing.", "model.second_pass_routers.")
FP32_PARTS = (".mlp.router.",)


def keep_fp32(hf_name: str) -> bool:
    return hf_name.startswith(FP32_NAMES) or any(p in hf_name for p in FP32_PARTS)


# ------------------------------------------------------------------ helpers
def parse_size(text: str) -> int:
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMG]i?B|B)?\s*", str(text), re.IGNORECASE)
    if not m:
        raise CliError(f"--max-shard-size: {text!r} is not a size like 2GB or 500MB")
    unit = (m.group(2) or "B").upper().replace("I", "")
    return int(float(m.group(1)) * {"B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9}[unit])


def is_plain_stack(m: ModelConfig) -> bool:
    """An ordinary decoder stack that Llama computes exactly (within one document)."""
    steps = m.execution_plan().steps()
    every_block_once = all(step.block == i and step.pass_index == 0 for i, step in enumerate(steps))
    return (
        every_block_once
        and fixed_attention_of(m) == "full"
        and not model_parts(m, m.execution_plan())  # no per-pass parts (FiLM, injection, ...)
        and m.rotary_scaling_factor >= 1.0
        and m.moe.layers == "none"
    )


class ShardWriter:
    """Writes tensors into safetensors shards of at most ``max_bytes`` (a tensor larger than that gets its own)."""

    def __init__(self, out_dir: str, max_bytes: int):
        self.out_dir, self.max_bytes = out_dir, max_bytes
        self.pending: dict[str, torch.Tensor] = {}
        self.pending_bytes = 0
        self.shards: list[list[str]] = []
        self.total_bytes = 0

    def add(self, name: str, tensor: torch.Tensor) -> None:
        size = tensor.numel() * tensor.element_size()
        if self.pending and self.pending_bytes + size > self.max_bytes:
            self.flush()
        self.pending[name] = tensor.contiguous()
        self.pending_bytes += size
        self.total_bytes += size

    def flush(self) -> None:
        from safetensors.torch import save_file

        if not self.pending:
            return
        save_file(
            self.pending, os.path.join(self.out_dir, f"shard-{len(self.shards):05d}.tmp"), metadata={"format": "pt"}
        )
        self.shards.append(list(self.pending))
        self.pending, self.pending_bytes = {}, 0

    def finish(self) -> int:
        self.flush()
        n = len(self.shards)
        weight_map = {}
        for i, names in enumerate(self.shards):
            final = f"model-{i + 1:05d}-of-{n:05d}.safetensors"
            os.replace(os.path.join(self.out_dir, f"shard-{i:05d}.tmp"), os.path.join(self.out_dir, final))
            # safetensors writes its files 0600 whatever the umask; the export's other files follow the
            # umask (0644 under the usual 022), and a cluster group must be able to read them all
            os.chmod(os.path.join(self.out_dir, final), 0o666 & ~_umask())
            weight_map.update(dict.fromkeys(names, final))
        index = {"metadata": {"total_size": self.total_bytes}, "weight_map": dict(sorted(weight_map.items()))}
        _write_json(os.path.join(self.out_dir, "model.safetensors.index.json"), index)
        return n


def _umask() -> int:
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def _write_json(path: str, obj) -> None:
    with open(path, "w") as f:
        json.dump(obj, f, indent=2, ensure_ascii=False)
        f.write("\n")


def validate_checkpoint(reader: DistCheckpointReader, cfg: ExperimentConfig, source: str) -> tuple[dict, int]:
    """``{native name: checkpoint key}`` and the vocabulary size; stops on any mismatch with the config."""
    m = cfg.model
    available = set(reader.keys())
    emb = mapping.checkpoint_key("embedding.word_embeddings.weight", available)
    if emb is None:
        model_keys = [k for k in available if k.startswith("model.")]
        raise CliError(
            f"{source}: no model.embedding.word_embeddings.weight in the checkpoint "
            f"({len(model_keys)} model tensors): not a megatron-lol model checkpoint"
        )
    vocab, hidden = reader.shape(emb)
    if hidden != m.hidden_size:
        raise CliError(
            f"{source}: the checkpoint's hidden size is {hidden} but the config says "
            f"model.hidden_size={m.hidden_size}: checkpoint and config do not match"
        )
    keys = {}
    for name, shape in mapping.native_shapes(m, vocab).items():
        key = mapping.checkpoint_key(name, available)
        if key is None:
            raise CliError(
                f"{source}: tensor model.{name} is missing: the checkpoint was not saved from a "
                f"model with this config (plan={m.plan.kind}, {m.execution_plan().describe()}, "
                f"n_prelude={m.n_prelude}, n_coda={m.n_coda})"
            )
        if reader.shape(key) != tuple(shape):
            raise CliError(
                f"{source}: tensor {key} has shape {list(reader.shape(key))} but the config implies "
                f"{list(shape)}: checkpoint and config do not match"
            )
        keys[name] = key
    used = set(keys.values())
    extra = sorted(k for k in available if k.startswith("model.") and k not in used and "_extra_state" not in k)
    if extra:
        raise CliError(
            f"{source}: {len(extra)} checkpoint tensor(s) are not part of a model with this config, "
            f"e.g. {extra[0]}: checkpoint and config do not match"
        )
    return keys, vocab


# ------------------------------------------------------------------ configs
def resolve_loop_budget(m: ModelConfig, loop_budget: Optional[int]) -> Optional[int]:
    """The exported default budget of an accordion model: ``--loop-budget``, else the run's, else the largest."""
    from megatron_lol.errors import ConfigError

    try:
        return m.execution_plan().resolve_budget(loop_budget)
    except ConfigError as err:
        raise CliError(f"--loop-{err}") from None


def lol_config_json(
    cfg: ExperimentConfig, vocab: int, dtype: torch.dtype, tokens: dict, loop_budget: Optional[int] = None
) -> dict:
    m, d = cfg.model, mapping.Dims.of(cfg.model)
    plan = m.execution_plan()
    accordion = plan.has_budgets
    return {
        "architectures": ["LoLForCausalLM"],
        "model_type": "lol",
        "auto_map": {
            "AutoConfig": "configuration_lol.LoLConfig",
            "AutoModelForCausalLM": "modeling_lol.LoLForCausalLM",
        },
        "vocab_size": vocab,
        "hidden_size": m.hidden_size,
        "intermediate_size": d.ffn,
        "num_attention_heads": d.heads,
        "num_key_value_heads": d.groups,
        "head_dim": d.head_dim,
        "n_prelude": m.n_prelude,
        "n_coda": m.n_coda,
        "plan": plan.name,
        "num_blocks": plan.num_stored_blocks,  # blocks stored
        "routed_depth": plan.depth,  # core steps (the largest budget's for accordion)
        "execution_plan": plan.to_dict(),  # the schedule the remote code runs (not re-derived there)
        # the per-pass parts the steps name that the export ships as source (plugin_parts_lol.py)
        "part_modules": {cls.name: f"part_{cls.name.replace('-', '_')}" for cls in plugin_parts(model_parts(m, plan))},
        "window_size": windows_of(m).size,
        "window_shift": windows_of(m).shift,
        "dense_attention": fixed_attention_of(m),
        "router_tied": routing_of(m).router_tied,
        "router_input": routing_of(m).router_input,
        "router_only_tokens": list(routing_of(m).router_only_tokens),
        "router_only_filler": routing_of(m).router_only_filler,
        "per_depth_bias": routing_of(m).per_depth_bias,
        "film": pass_parts_of(m).film,
        "input_injection": pass_parts_of(m).input_injection,
        "moe_layers": m.moe.layers,
        "num_experts": mapping.fixed_experts(m),
        "core_num_experts": mapping.core_experts(m),
        "num_experts_per_tok": m.moe.router_topk if m.moe.layers != "none" else None,
        "moe_intermediate_size": d.moe_ffn or None,
        "shared_expert_intermediate_size": d.shared_ffn or None,
        "moe_router_score_function": m.moe.router_score_function,
        "moe_router_expert_bias": bool(d.expert_bias),
        "untie_attention": bool(plan.untied_attention_sets()),
        "loop_budgets": list(plan.budgets) if accordion else [0],
        "loop_budget": loop_budget if accordion else 0,
        "second_pass_router": m.plan.second_pass_router if accordion else "shared",
        "loop_gates": bool(m.plan.gates) if accordion else False,
        "rms_norm_eps": m.norm_epsilon,
        "rope_theta": float(m.rotary_base),
        "rope_scaling_factor": m.rotary_scaling_factor,
        "max_position_embeddings": cfg.training.seq_length,
        "tie_word_embeddings": not m.untie_embeddings_and_output_weights,
        "initializer_range": m.init_method_std,
        "eod_token_id": tokens.get("eod_id"),
        "bos_token_id": tokens.get("bos_id"),
        "eos_token_id": tokens.get("eod_id"),
        "pad_token_id": tokens.get("pad_id"),
        "use_cache": True,  # every plan decodes with a LoLCache (cache_lol.py)
        "torch_dtype": DTYPE_NAMES[dtype],
    }


def llama_config_json(cfg: ExperimentConfig, vocab: int, dtype: torch.dtype, tokens: dict) -> dict:
    m, d = cfg.model, mapping.Dims.of(cfg.model)
    out = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": vocab,
        "hidden_size": m.hidden_size,
        "intermediate_size": d.ffn,
        "num_hidden_layers": m.n_prelude + m.execution_plan().num_stored_blocks + m.n_coda,
        "num_attention_heads": d.heads,
        "num_key_value_heads": d.groups,
        "head_dim": d.head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": cfg.training.seq_length,
        "rms_norm_eps": m.norm_epsilon,
        "rope_theta": float(m.rotary_base),
        "attention_bias": False,
        "mlp_bias": False,
        "tie_word_embeddings": not m.untie_embeddings_and_output_weights,
        "initializer_range": m.init_method_std,
        "bos_token_id": tokens.get("bos_id"),
        "eos_token_id": tokens.get("eod_id"),
        "pad_token_id": tokens.get("pad_id"),
        "torch_dtype": DTYPE_NAMES[dtype],
    }
    if m.rotary_scaling_factor != 1.0:
        out["rope_scaling"] = {"rope_type": "linear", "factor": m.rotary_scaling_factor}
    return out


# ------------------------------------------------------------------ conversion
def convert_checkpoint(
    load: str,
    save: str,
    *,
    iteration: Optional[int] = None,
    dtype: Optional[str] = None,
    tokenizer: Optional[str] = None,
    tokenizer_type: Optional[str] = None,
    export_tokenizer: bool = True,
    eod_id: Optional[int] = None,
    config: Optional[str] = None,
    fmt: str = "auto",
    max_shard_size="5GB",
    force: bool = False,
    loop_budget: Optional[int] = None,
) -> dict:
    path, it = iteration_dir(load, iteration)
    if config is not None:
        from megatron_lol.config import load_config

        cfg, info = load_config(config, check_data=False), {}
    else:
        cfg, info, _ = read_run_config(path, load)
    budget = resolve_loop_budget(cfg.model, loop_budget)
    reader = DistCheckpointReader(path)
    keys, vocab = validate_checkpoint(reader, cfg, path)
    m = cfg.model
    if m.execution_plan().untied_attention_sets() and pass_parts_of(m).film != "off":
        raise CliError(
            f"{path}: FiLM with untied per-pass attention (plan.film={pass_parts_of(m).film}) is not exported "
            f"(no test covers the exported per-pass norms)"
        )
    if fmt == "llama" and not is_plain_stack(m):
        raise CliError(
            f"--format llama: plan={m.plan.kind}, plan.attention={fixed_attention_of(m)}, "
            f"plan.film={pass_parts_of(m).film}, plan.input_injection={pass_parts_of(m).input_injection}, "
            f"moe.layers={m.moe.layers} is not an ordinary "
            f"Llama stack"
        )
    llama = fmt == "llama" or (fmt == "auto" and is_plain_stack(m))
    torch_dtype = DTYPES[dtype or m.precision.params_dtype]
    max_bytes = parse_size(max_shard_size)

    check_output_apart(save, load)  # --force never deletes the checkpoint being converted
    if os.path.exists(save) and (not os.path.isdir(save) or os.listdir(save)) and not force:
        raise CliError(f"--save {save} exists and is not empty (pass --force to replace it)")
    tmp = f"{save.rstrip(os.sep)}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(tmp)
    try:
        tokens = {"eod_id": None, "bos_id": None, "pad_id": None}
        if export_tokenizer:
            from megatron_lol.convert.tokenizer_export import export_tokenizer as write_tokenizer

            d = cfg.data
            files = tokenizer_files(path, cfg, info)
            tokens = write_tokenizer(
                tokenizer_type or d.tokenizer_type,
                tokenizer or files["tokenizer_model"],
                tmp,
                vocab_file=files["vocab_file"],
                merge_file=files["merge_file"],
                max_length=cfg.training.seq_length,
            )
        saved_eod = (info.get("tokenizer") or {}).get("eod_id")
        if eod_id is None and saved_eod is not None:
            if tokens["eod_id"] is not None and tokens["eod_id"] != saved_eod:
                raise CliError(
                    f"the tokenizer's eos id is {tokens['eod_id']} but the run trained with "
                    f"eod_id={saved_eod}: wrong --tokenizer? (pass --eod-id to override)"
                )
            eod_id = saved_eod
        if eod_id is not None:
            tokens["eod_id"] = eod_id
        if tokens["eod_id"] is None:
            raise CliError("the end-of-document token id is unknown: export the tokenizer or pass --eod-id")

        writer = ShardWriter(tmp, max_bytes)
        d = mapping.Dims.of(m)
        for name in progress(mapping.native_shapes(m, vocab), desc="convert-hf", unit="tensor"):
            tensor = reader.read(keys[name])
            for hf_name, t in hf_tensors(name, tensor, m, d, llama):
                keep32 = not llama and keep_fp32(hf_name)
                writer.add(hf_name, t.to(torch.float32 if keep32 else torch_dtype))
            del tensor
        num_shards = writer.finish()

        conf = (
            llama_config_json(cfg, vocab, torch_dtype, tokens)
            if llama
            else lol_config_json(cfg, vocab, torch_dtype, tokens, budget)
        )
        conf["megatron_lol"] = {"model": _model_dict(m), "iteration": it, "source": os.path.abspath(path)}
        _write_json(os.path.join(tmp, "config.json"), conf)
        gen = {
            "bos_token_id": tokens.get("bos_id"),
            "eos_token_id": tokens["eod_id"],
            "pad_token_id": tokens.get("pad_id"),
            "do_sample": False,
        }
        if not llama:
            gen["use_cache"] = True
        _write_json(os.path.join(tmp, "generation_config.json"), {k: v for k, v in gen.items() if v is not None})
        if not llama:
            for f in TEMPLATE_FILES:
                shutil.copyfile(os.path.join(TEMPLATES, f), os.path.join(tmp, f))
            write_part_sources(tmp, model_parts(m, m.execution_plan()))
        if os.path.exists(save):
            shutil.rmtree(save) if os.path.isdir(save) else os.remove(save)
        os.replace(tmp, save)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return {
        "format": "llama" if llama else "lol",
        "num_tensors": sum(len(s) for s in writer.shards),
        "num_shards": num_shards,
        "dtype": DTYPE_NAMES[torch_dtype],
        "source": path,
        "iteration": it,
    }


def tokenizer_files(path: str, cfg: ExperimentConfig, info: dict) -> dict:
    """Tokenizer files of the run: the copies saved in the checkpoint when present, else the config's paths."""
    saved = (info.get("tokenizer") or {}).get("copied_files") or {}
    out = {}
    for key in ("tokenizer_model", "vocab_file", "merge_file"):
        rel = saved.get(key)
        copy = os.path.join(path, rel) if rel else None
        out[key] = copy if copy and os.path.exists(copy) else getattr(cfg.data, key)
    return out


def _model_dict(m: ModelConfig) -> dict:
    return m.to_dict()


def hf_tensors(name: str, tensor: torch.Tensor, m: ModelConfig, d: mapping.Dims, llama: bool):
    """``[(HF name, tensor)]`` for one checkpoint tensor: a layer's fused tensors split into HF's
    (convert/mapping.py), names in the Llama layout (``llama``) or the LoL remote code's; ``[]`` for
    tensors the HF model does not keep. The exporter and in-process loading share it, so both see
    the same model."""
    if name.startswith(("prelude.", "core.blocks.", "core.pass_attention.", "coda.")):
        prefix, suffix = mapping.split_layer_name(name)
        if llama:
            hf_prefix = f"model.layers.{mapping.llama_layer_index(prefix, m)}."
        else:
            hf_prefix = mapping.lol_hf_names(prefix, m)
        return [(hf_prefix + s, t) for s, t in mapping.layer_to_hf(suffix, tensor, d)]
    if llama:
        names = {
            "embedding.word_embeddings.weight": "model.embed_tokens.weight",
            "final_norm.weight": "model.norm.weight",
            "output_layer.weight": "lm_head.weight",
        }
        return [(names[name], tensor)]
    hf = mapping.lol_hf_names(name, m)
    return [] if hf is None else [(hf, tensor)]
