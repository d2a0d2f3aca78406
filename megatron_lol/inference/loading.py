"""A training checkpoint as a model to decode and evaluate with, in one process.

``load_model`` reads a ``torch_dist`` checkpoint of any parallel layout (TP, PP,
EP, DP) one global tensor at a time (:class:`~megatron_lol.convert.checkpoint.DistCheckpointReader`),
maps it in memory to the plain-PyTorch LoL model of ``convert/hf_modeling`` with the
same mapping ``convert-hf`` writes to disk, and loads it there. Why that model and
not ``LoLGPTModel``: megatron-core's layers need process groups and a forward over
the whole sequence, while decoding needs the one cache definition of
``hf_modeling/cache_lol.py`` (exact cached decoding of every plan), which the
plain model implements; its logits equal the megatron model's forward (tested in
``tests/test_decoding.py``), and loading needs no process group or GPU.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Iterator, Optional

import torch

from megatron_lol.errors import CliError
from megatron_lol.plan.pass_parts import pass_parts_of

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


@dataclass
class LoadedModel:
    model: object  # LoLForCausalLM, eval mode (None from load_run)
    cfg: object  # ExperimentConfig of the run
    info: dict  # the checkpoint section of run_config.yaml
    path: str  # the iter_ directory read
    iteration: int
    eod_id: Optional[int]
    loop_budget: Optional[int]  # Accordion's budget the model runs with (None for other plans)

    @property
    def seq_length(self) -> int:
        return self.cfg.training.seq_length


def add_model_arguments(parser) -> None:
    """Flags shared by ``generate`` and ``evaluate``."""
    parser.add_argument("--load", required=True, help="checkpoint directory (holds latest_checkpointed_iteration.txt)")
    parser.add_argument("--iteration", type=int, default=None, help="iteration to load (default: the tracker's)")
    parser.add_argument("--config", default=None, help="training YAML, when the checkpoint has no run_config.yaml")
    parser.add_argument(
        "--loop-budget",
        type=int,
        default=None,
        help="plan accordion: the loop budget k (default: the run's model.plan.budget, else the largest)",
    )
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="fp32", help="weight dtype (default fp32)")
    parser.add_argument("--device", default="cpu", help="torch device (cpu, cuda, cuda:1, ...)")
    parser.add_argument(
        "--tokenizer",
        default=None,
        help="tokenizer model file / directory (default: the copy saved with the checkpoint, else "
        "the run's data.tokenizer_model)",
    )
    parser.add_argument("--tokenizer-type", default=None, help="default: the run's data.tokenizer_type")


def load_run(
    load: str, iteration: Optional[int] = None, *, config: Optional[str] = None, loop_budget: Optional[int] = None
) -> LoadedModel:
    """The checkpoint's directory, run config and record, without its weights (``model`` is None)."""
    from megatron_lol.convert.checkpoint import iteration_dir, read_run_config
    from megatron_lol.convert.to_hf import resolve_loop_budget

    path, it = iteration_dir(load, iteration)
    if config is not None:
        from megatron_lol.config import load_config

        cfg, info = load_config(config, check_data=False), {}
    else:
        cfg, info, _ = read_run_config(path, load)
    budget = resolve_loop_budget(cfg.model, loop_budget)
    eod_id = (info.get("tokenizer") or {}).get("eod_id")
    return LoadedModel(model=None, cfg=cfg, info=info, path=path, iteration=it, eod_id=eod_id, loop_budget=budget)


def load_model(
    load: str,
    iteration: Optional[int] = None,
    *,
    config: Optional[str] = None,
    loop_budget: Optional[int] = None,
    dtype: str = "fp32",
    device: str = "cpu",
) -> LoadedModel:
    """The checkpoint's model as a ``LoLForCausalLM`` (eval mode, on ``device``)."""
    from megatron_lol.convert import mapping
    from megatron_lol.convert.checkpoint import DistCheckpointReader
    from megatron_lol.convert.hf_modeling.configuration_lol import LoLConfig
    from megatron_lol.convert.hf_modeling.modeling_lol import LoLForCausalLM
    from megatron_lol.convert.to_hf import hf_tensors, keep_fp32, lol_config_json, validate_checkpoint

    run = load_run(load, iteration, config=config, loop_budget=loop_budget)
    path, it, cfg, info, budget = run.path, run.iteration, run.cfg, run.info, run.loop_budget
    m = cfg.model
    if m.execution_plan().untied_attention_sets() and pass_parts_of(m).film != "off":
        raise CliError(
            f"{path}: model.plan.untie_attention with plan.film={pass_parts_of(m).film} has no inference model "
            f"(FiLM of the per-pass attention norms is not defined)"
        )
    reader = DistCheckpointReader(path)
    keys, vocab = validate_checkpoint(reader, cfg, path)
    eod_id = (info.get("tokenizer") or {}).get("eod_id")
    torch_dtype = DTYPES[dtype]
    conf = lol_config_json(cfg, vocab, torch_dtype, {"eod_id": eod_id}, budget)
    for key in ("architectures", "model_type", "auto_map", "torch_dtype"):
        conf.pop(key)
    lol_config = LoLConfig(**conf)
    d = mapping.Dims.of(m)
    state = {}
    for name in mapping.native_shapes(m, vocab):
        for hf_name, t in hf_tensors(name, reader.read(keys[name]), m, d, llama=False):
            state[hf_name] = t.to(torch.float32 if keep_fp32(hf_name) else torch_dtype)
    if lol_config.tie_word_embeddings:
        state["lm_head.weight"] = state["model.embed_tokens.weight"]
    with torch.device("meta"):  # no initialisation: every parameter comes from the checkpoint
        model = LoLForCausalLM(lol_config)
    model.load_state_dict(state, strict=True, assign=True)
    if lol_config.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
    try:
        model = model.to(device).eval()
    except (RuntimeError, AssertionError) as err:
        raise CliError(f"--device {device}: {err}") from None
    return LoadedModel(model=model, cfg=cfg, info=info, path=path, iteration=it, eod_id=eod_id, loop_budget=budget)


def load_tokenizer(loaded: LoadedModel, tokenizer: Optional[str] = None, tokenizer_type: Optional[str] = None):
    """The run's tokenizer (the copy saved with the checkpoint first); a clear error when its file is gone."""
    from megatron_lol.convert.to_hf import tokenizer_files
    from megatron_lol.data.tokenizers import build_tokenizer

    tok_info = loaded.info.get("tokenizer") or {}
    kind = tokenizer_type or tok_info.get("type") or loaded.cfg.data.tokenizer_type
    files = tokenizer_files(loaded.path, loaded.cfg, loaded.info)
    if tokenizer is not None:
        files["tokenizer_model"] = tokenizer
    needed = ("vocab_file", "merge_file") if kind == "GPT2BPETokenizer" else ("tokenizer_model",)
    for key in needed:
        where = files.get(key)
        if not where or not os.path.exists(where):
            flag = "--tokenizer" if key == "tokenizer_model" else "--config"
            raise CliError(
                f"the tokenizer is missing: {key} {where or '(not set)'} does not exist and the checkpoint "
                f"{loaded.path} holds no copy of it (pass {flag})"
            )
    try:
        tok = build_tokenizer(
            kind,
            tokenizer_model=files["tokenizer_model"],
            vocab_file=files["vocab_file"],
            merge_file=files["merge_file"],
        )
    except (ValueError, OSError, RuntimeError) as err:
        raise CliError(f"cannot build the {kind} tokenizer from {files['tokenizer_model']}: {err}") from None
    if loaded.eod_id is None:
        loaded.eod_id = tok.eod
        if loaded.model is not None:
            loaded.model.config.eod_token_id = tok.eod
    elif tok.eod != loaded.eod_id:
        raise CliError(
            f"the tokenizer's end-of-document id is {tok.eod} but the run trained with "
            f"eod_id={loaded.eod_id}: wrong --tokenizer?"
        )
    return tok


def jsonl_texts(flag: str, path: str, keys: tuple, key_flag: str = "") -> Iterator[tuple]:
    """``(line number, text)`` of each non-blank line of a JSONL file, the text under the first of
    ``keys`` present; a bad line is a one-line :class:`CliError` naming ``flag``, the file and the line
    (and ``key_flag``, the option that chooses the key, where there is one)."""
    try:
        f = open(path, encoding="utf-8")
    except OSError as err:
        raise CliError(f"{flag} {path}: {err.strerror}") from None
    with f:
        for i, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except ValueError:
                raise CliError(f"{flag} {path} line {i}: not a JSON object") from None
            text = next((obj[k] for k in keys if k in obj), None) if isinstance(obj, dict) else None
            if not isinstance(text, str):
                wanted = " (or ".join(repr(k) for k in keys) + ")" * (len(keys) - 1)
                raise CliError(f"{flag} {path} line {i}: no {wanted} string" + (f" ({key_flag})" if key_flag else ""))
            yield i, text
