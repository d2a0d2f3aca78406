"""``megatron-lol import-hf``: a Llama-architecture HF checkpoint -> a megatron-lol checkpoint.

The result is a dense-plan ``LoLGPTModel`` (``plan: dense``, full attention):
the HF layers become ``n_prelude`` prelude layers, ``plan.layers`` core layers
and ``n_coda`` coda layers, in order. A directory written by ``convert-hf``
records the original split in ``config.json`` and gets it back. The checkpoint
has the training layout (:mod:`megatron_lol.training.checkpointing`):
``iter_0000000/`` (``torch_dist``, model weights only, iteration 0),
``run_config.yaml`` and the tracker, so ``megatron-lol train --load DIR``
(with a config whose ``model:`` section matches, e.g. the written
``run_config.yaml``) starts from it with a fresh optimizer.

Reading the HF side touches only JSON and safetensors (``safe_open``, one tensor
at a time); a truncated or corrupted shard stops with the shard's name.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
from typing import Optional

import torch

from megatron_lol.config.schema import ModelConfig
from megatron_lol.convert import mapping
from megatron_lol.errors import CliError
from megatron_lol.progress import progress

TRACKER = "latest_checkpointed_iteration.txt"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--hf-dir", "--load", dest="hf_dir", required=True, help="HuggingFace model directory")
    parser.add_argument("--save", required=True, help="megatron-lol checkpoint directory to create")
    parser.add_argument(
        "--n-prelude",
        type=int,
        default=None,
        help="HF layers that become prelude layers (default: as recorded by convert-hf, else 1)",
    )
    parser.add_argument(
        "--n-coda",
        type=int,
        default=None,
        help="HF layers that become coda layers (default: as recorded by convert-hf, else 1)",
    )
    parser.add_argument(
        "--config", default=None, help="training YAML whose data/optimizer/training sections the run_config.yaml takes"
    )
    parser.add_argument("--dtype", choices=("fp32", "bf16"), default="fp32", help="model.precision.params_dtype")
    parser.add_argument("--force", action="store_true", help="replace an existing --save directory")


def run(args: argparse.Namespace) -> int:
    out = import_hf(
        args.hf_dir,
        args.save,
        n_prelude=args.n_prelude,
        n_coda=args.n_coda,
        config=args.config,
        dtype=args.dtype,
        force=args.force,
    )
    print(
        f"wrote {out['path']} ({out['num_layers']} layers: {out['n_prelude']} prelude, {out['core_layers']} "
        f"blocks, {out['n_coda']} coda; vocab {out['vocab_size']})"
    )
    return 0


# ------------------------------------------------------------------ HF side
class HFCheckpoint:
    """Tensors of an HF directory, read lazily from safetensors (index or single file)."""

    def __init__(self, hf_dir: str):
        if not os.path.isdir(hf_dir):
            raise CliError(f"{hf_dir} is not a directory")
        self.dir = hf_dir
        index = os.path.join(hf_dir, "model.safetensors.index.json")
        single = os.path.join(hf_dir, "model.safetensors")
        if os.path.isfile(index):
            try:
                with open(index) as f:
                    self.weight_map = json.load(f)["weight_map"]
            except (OSError, ValueError, KeyError) as err:
                raise CliError(f"{index} is not a valid safetensors index: {err}") from None
        elif os.path.isfile(single):
            self.weight_map = {name: "model.safetensors" for name in self._open("model.safetensors").keys()}
        else:
            bins = [f for f in os.listdir(hf_dir) if f.endswith((".bin", ".pt", ".pth"))]
            hint = f" (found {bins[0]}: pickled weights are not read; re-save with safe_serialization)" if bins else ""
            raise CliError(f"{hf_dir} has no model.safetensors or model.safetensors.index.json{hint}")
        self._handles: dict = {}
        for shard in sorted(set(self.weight_map.values())):
            self._open(shard)

    def _open(self, shard: str):
        from safetensors import safe_open

        if shard in getattr(self, "_handles", {}):
            return self._handles[shard]
        path = os.path.join(self.dir, shard)
        if not os.path.isfile(path):
            raise CliError(f"safetensors shard {shard} listed in the index is missing from {self.dir}")
        _check_safetensors_file(path)
        try:
            handle = safe_open(path, framework="pt")
        except Exception as err:  # noqa: BLE001 - safetensors raises its own error types
            raise CliError(f"safetensors shard {path} is corrupted or truncated: {err}") from None
        if hasattr(self, "_handles"):
            self._handles[shard] = handle
        return handle

    def has(self, name: str) -> bool:
        return name in self.weight_map

    def shape(self, name: str) -> tuple:
        return tuple(self._open(self.weight_map[name]).get_slice(name).get_shape())

    def read(self, name: str) -> torch.Tensor:
        if name not in self.weight_map:
            raise CliError(f"{self.dir}: tensor {name} is missing")
        shard = self.weight_map[name]
        try:
            return self._open(shard).get_tensor(name)
        except Exception as err:  # noqa: BLE001
            raise CliError(
                f"safetensors shard {os.path.join(self.dir, shard)} is corrupted: cannot read {name}: {err}"
            ) from None


def _check_safetensors_file(path: str) -> None:
    """Header and data extent of a safetensors file (catches truncation before any tensor is used)."""
    size = os.path.getsize(path)
    try:
        with open(path, "rb") as f:
            raw = f.read(8)
            if len(raw) < 8:
                raise ValueError("shorter than its 8-byte header length")
            n = int.from_bytes(raw, "little")
            if n <= 0 or 8 + n > size:
                raise ValueError(f"header of {n} bytes does not fit in the file ({size} bytes)")
            header = json.loads(f.read(n))
        end = max((v["data_offsets"][1] for k, v in header.items() if k != "__metadata__"), default=0)
        if 8 + n + end != size:
            raise ValueError(f"tensor data needs {8 + n + end} bytes, the file has {size}")
    except (ValueError, KeyError, TypeError, UnicodeDecodeError) as err:
        raise CliError(f"safetensors shard {path} is corrupted or truncated: {err}") from None


def _read_config(hf_dir: str) -> dict:
    path = os.path.join(hf_dir, "config.json")
    if not os.path.isfile(path):
        raise CliError(f"{hf_dir} has no config.json")
    try:
        with open(path) as f:
            conf = json.load(f)
    except ValueError as err:
        raise CliError(f"{path} is not valid JSON: {err}") from None
    arch = conf.get("architectures") or []
    if conf.get("model_type") != "llama" and "LlamaForCausalLM" not in arch:
        raise CliError(
            f"{path}: model_type {conf.get('model_type')!r} / architectures {arch} is not a Llama "
            "model; import-hf reads LlamaForCausalLM checkpoints"
        )
    checks = {"hidden_act": "silu", "attention_bias": False, "mlp_bias": False}
    for key, want in checks.items():
        if conf.get(key, want) != want:
            raise CliError(f"{path}: {key}={conf[key]!r} is not supported (megatron-lol blocks need {want!r})")
    return conf


def _rope(conf: dict) -> tuple[float, float]:
    params = conf.get("rope_parameters") or {}
    scaling = conf.get("rope_scaling") or {}
    theta = params.get("rope_theta", conf.get("rope_theta", 10000.0))
    kind = params.get("rope_type") or scaling.get("rope_type") or scaling.get("type") or "default"
    factor = 1.0
    if kind == "linear":
        factor = float(params.get("factor", scaling.get("factor", 1.0)))
    elif kind != "default":
        raise CliError(f"config.json: rope type {kind!r} is not supported (default or linear only)")
    return float(theta), factor


def model_config_from_hf(conf: dict, n_prelude: Optional[int], n_coda: Optional[int], dtype: str) -> ModelConfig:
    recorded = (conf.get("megatron_lol") or {}).get("model") or {}
    layers = int(conf["num_hidden_layers"])
    if n_prelude is None:
        n_prelude = recorded.get("n_prelude", 1 if layers >= 3 else 0)
    if n_coda is None:
        n_coda = recorded.get("n_coda", 1 if layers >= 3 else 0)
    blocks = layers - n_prelude - n_coda
    if blocks < 1:
        raise CliError(f"--n-prelude {n_prelude} + --n-coda {n_coda} leave no core block of the {layers} layers")
    heads = int(conf["num_attention_heads"])
    hidden = int(conf["hidden_size"])
    head_dim = int(conf.get("head_dim") or hidden // heads)
    theta, factor = _rope(conf)
    plan = {"kind": "dense", "layers": blocks}
    section = recorded.get("plan")
    if isinstance(section, dict) and section.get("kind") == "dense" and isinstance(section.get("windows"), dict):
        plan["windows"] = section["windows"]  # recorded by the export (unused by full attention, kept)
    # an export of an earlier version recorded the windows and router keys flat: the migration reads them
    earlier = {
        k: recorded[k]
        for k in ("window_size", "window_shift", "balancing", "router_tied", "router_input")
        if k in recorded
    }
    m = ModelConfig(
        plan=plan,
        **earlier,
        hidden_size=hidden,
        num_attention_heads=heads,
        num_query_groups=int(conf.get("num_key_value_heads") or heads),
        kv_channels=head_dim if head_dim * heads != hidden else None,
        ffn_hidden_size=int(conf["intermediate_size"]),
        n_prelude=n_prelude,
        n_coda=n_coda,
        vocab_size=int(conf["vocab_size"]),
        untie_embeddings_and_output_weights=not conf.get("tie_word_embeddings", False),
        rotary_base=theta,
        rotary_scaling_factor=factor,
        norm_epsilon=float(conf.get("rms_norm_eps", 1e-6)),
        init_method_std=float(conf.get("initializer_range", 0.02)),
        precision={"params_dtype": dtype},
    )
    if "make_vocab_size_divisible_by" in recorded:
        m.make_vocab_size_divisible_by = recorded["make_vocab_size_divisible_by"]
    m.validate()
    return m


def native_tensor(name: str, hf: HFCheckpoint, m: ModelConfig) -> torch.Tensor:
    """The native tensor ``name`` assembled from the HF Llama tensors."""
    d = mapping.Dims.of(m)
    fixed = {
        "embedding.word_embeddings.weight": "model.embed_tokens.weight",
        "final_norm.weight": "model.norm.weight",
        "output_layer.weight": "lm_head.weight",
    }
    if name in fixed:
        return hf.read(fixed[name])
    prefix, suffix = mapping.split_layer_name(name)
    p = f"model.layers.{mapping.llama_layer_index(prefix, m)}."
    if suffix == "self_attention.linear_qkv.weight":
        return mapping.merge_qkv(
            hf.read(p + "self_attn.q_proj.weight"),
            hf.read(p + "self_attn.k_proj.weight"),
            hf.read(p + "self_attn.v_proj.weight"),
            d,
        )
    if suffix == "mlp.linear_fc1.weight":
        return torch.cat([hf.read(p + "mlp.gate_proj.weight"), hf.read(p + "mlp.up_proj.weight")], dim=0)
    return hf.read(p + mapping.HF_LAYER[suffix])


def _check_hf_tensors(hf: HFCheckpoint, m: ModelConfig) -> None:
    layers = m.n_prelude + m.execution_plan().num_stored_blocks + m.n_coda
    expected = {f"model.layers.{layers}.input_layernorm.weight": None}  # must NOT exist
    if hf.has(next(iter(expected))):
        raise CliError(f"{hf.dir} has more than num_hidden_layers={layers} layers")
    d = mapping.Dims.of(m)
    want = {"model.embed_tokens.weight": (m.vocab_size, m.hidden_size), "model.norm.weight": (m.hidden_size,)}
    if m.untie_embeddings_and_output_weights:
        want["lm_head.weight"] = (m.vocab_size, m.hidden_size)
    for i in range(layers):
        p = f"model.layers.{i}."
        want.update(
            {
                p + "input_layernorm.weight": (d.hidden,),
                p + "post_attention_layernorm.weight": (d.hidden,),
                p + "self_attn.q_proj.weight": (d.heads * d.head_dim, d.hidden),
                p + "self_attn.k_proj.weight": (d.groups * d.head_dim, d.hidden),
                p + "self_attn.v_proj.weight": (d.groups * d.head_dim, d.hidden),
                p + "self_attn.o_proj.weight": (d.hidden, d.heads * d.head_dim),
                p + "mlp.gate_proj.weight": (d.ffn, d.hidden),
                p + "mlp.up_proj.weight": (d.ffn, d.hidden),
                p + "mlp.down_proj.weight": (d.hidden, d.ffn),
            }
        )
    for name, shape in want.items():
        if not hf.has(name):
            raise CliError(f"{hf.dir}: tensor {name} is missing (config.json and weights do not match)")
        if hf.shape(name) != shape:
            raise CliError(
                f"{hf.dir}: tensor {name} has shape {list(hf.shape(name))}, config.json implies {list(shape)}"
            )


def _tokenizer_section(hf_dir: str, save: str, conf: dict) -> dict:
    """Copy the tokenizer into ``{save}/tokenizer`` and return the ``data:`` keys pointing at it."""
    dst = os.path.join(save, "tokenizer")
    for name, kind in (("tokenizer.model", "SentencePieceTokenizer"), ("tokenizer.json", "HuggingFaceTokenizer")):
        src = os.path.join(hf_dir, name)
        if os.path.isfile(src):
            os.makedirs(dst, exist_ok=True)
            for extra in ("tokenizer.model", "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
                if os.path.isfile(os.path.join(hf_dir, extra)):
                    shutil.copyfile(os.path.join(hf_dir, extra), os.path.join(dst, extra))
            path = os.path.join(os.path.abspath(dst), name if kind == "SentencePieceTokenizer" else "")
            return {"tokenizer_type": kind, "tokenizer_model": path.rstrip(os.sep)}
    return {}


# ------------------------------------------------------------------ import
def import_hf(
    hf_dir: str,
    save: str,
    *,
    n_prelude: Optional[int] = None,
    n_coda: Optional[int] = None,
    config: Optional[str] = None,
    dtype: str = "fp32",
    force: bool = False,
) -> dict:
    import yaml

    conf = _read_config(hf_dir)
    m = model_config_from_hf(conf, n_prelude, n_coda, dtype)
    hf = HFCheckpoint(hf_dir)
    _check_hf_tensors(hf, m)
    eod = conf.get("eos_token_id")
    if isinstance(eod, list):
        eod = eod[0] if eod else None

    if os.path.exists(save) and os.listdir(save) and not force:
        raise CliError(f"--save {save} exists and is not empty (pass --force to replace it)")
    shutil.rmtree(save, ignore_errors=True)
    os.makedirs(save)

    from megatron_lol.config import config_from_dict, load_config

    base = load_config(config, check_data=False).to_dict() if config else config_from_dict({}).to_dict()
    base["model"] = _asdict(m)
    base["data"].update(_tokenizer_section(hf_dir, save, conf))
    base["parallel"] = config_from_dict({}).to_dict()["parallel"]
    cfg = config_from_dict(base)

    model = _build_native_model(cfg, m.vocab_size, eod)
    params = {**dict(model.named_buffers()), **dict(model.named_parameters())}  # buffers: MoE expert biases
    with torch.no_grad():
        for name in progress(mapping.native_shapes(m, m.vocab_size), desc="import-hf", unit="tensor"):
            target = params.get(name)
            if target is None:
                raise CliError(f"internal: native model has no parameter {name}")
            target.copy_(native_tensor(name, hf, m).to(target.dtype))

    from megatron.core import dist_checkpointing

    iteration = 0
    tmp = os.path.join(save, f".tmp_iter_{iteration:07d}")
    final = os.path.join(save, f"iter_{iteration:07d}")
    os.makedirs(tmp)
    opt = cfg.optimizer
    state = {
        "model": model.sharded_state_dict(prefix="model."),
        "iteration": iteration,
        "consumed_train_samples": 0,
        "nonfinite_skipped": 0,
        "scheduler": {
            "max_lr": opt.lr,
            "lr_warmup_steps": 0,
            "num_steps": 0,
            "lr_decay_style": opt.lr_decay_style,
            "lr_decay_steps": 1,
            "min_lr": opt.min_lr,
            "start_wd": opt.weight_decay,
            "end_wd": opt.weight_decay,
            "wd_incr_style": "constant",
            "wd_incr_steps": 1,
        },
        "curriculum": {"depth": m.core_depth},
        "layout": {"tp": 1, "pp": 1, "ep": 1, "dp": 1, "world": 1},
        "format_version": 1,
    }
    dist_checkpointing.save(state, tmp)
    out = cfg.to_dict()
    out["checkpoint"] = {
        "iteration": iteration,
        "consumed_train_samples": 0,
        "padded_vocab_size": m.vocab_size,
        "tokenizer": {
            "type": cfg.data.tokenizer_type,
            "tokenizer_model": cfg.data.tokenizer_model,
            "copied_files": {},
            "eod_id": eod,
        },
        "layout": state["layout"],
        "key_prefix": "model.",
        "format": "torch_dist",
        "format_version": 1,
        "imported_from": os.path.abspath(hf_dir),
    }
    with open(os.path.join(tmp, "run_config.yaml"), "w") as f:
        yaml.safe_dump(out, f, sort_keys=False)
    os.replace(tmp, final)
    with open(os.path.join(save, TRACKER + ".tmp"), "w") as f:
        f.write(f"{iteration}\n")
    os.replace(os.path.join(save, TRACKER + ".tmp"), os.path.join(save, TRACKER))
    return {
        "path": final,
        "num_layers": m.n_prelude + m.execution_plan().num_stored_blocks + m.n_coda,
        "n_prelude": m.n_prelude,
        "core_layers": m.execution_plan().num_stored_blocks,
        "n_coda": m.n_coda,
        "vocab_size": m.vocab_size,
    }


def _asdict(m: ModelConfig) -> dict:
    return m.to_dict()


def _build_native_model(cfg, vocab: int, eod):
    """A single-process ``LoLGPTModel`` (megatron-core needs a world of one to build and save it)."""
    from megatron_lol.platform import init_distributed, setup_platform

    setup_platform()
    init_distributed()
    from megatron.core import parallel_state, tensor_parallel

    if not parallel_state.model_parallel_is_initialized():
        parallel_state.initialize_model_parallel(1, 1)
    elif (
        parallel_state.get_tensor_model_parallel_world_size() * parallel_state.get_pipeline_model_parallel_world_size()
        != 1
    ):
        raise CliError("import-hf runs in one process (found a model-parallel state)")
    tensor_parallel.model_parallel_cuda_manual_seed(cfg.training.seed)
    from megatron_lol.model.lol_model import LoLGPTModel

    return LoLGPTModel(cfg.model, vocab, eod, max_sequence_length=cfg.training.seq_length).eval()
