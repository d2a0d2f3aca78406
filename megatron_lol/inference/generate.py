"""``megatron-lol generate``: text from a training checkpoint, with exact KV-cached decoding.

The checkpoint is loaded as the plain-PyTorch LoL model (:mod:`.loading`) and
decoded with its :class:`~megatron_lol.convert.hf_modeling.cache_lol.LoLCache`
through transformers' ``generate`` (greedy, or sampling with temperature /
top-k / top-p from ``--seed``). Prompts of a batch are left-padded; padding is
its own document, so every row decodes as it would alone. With
``--record-routes`` each output lists the block every routed window chose
(prompt and generated tokens).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time

import torch

from megatron_lol.errors import CliError
from megatron_lol.inference.loading import add_model_arguments, jsonl_texts, load_model, load_tokenizer
from megatron_lol.log import log_rank0


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_model_arguments(parser)
    src = parser.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt", help="one prompt (text)")
    src.add_argument("--prompts", help="JSONL file: one object per line with a 'prompt' (or 'text') string")
    parser.add_argument("--max-new-tokens", type=int, default=64, help="tokens to generate per prompt (default 64)")
    parser.add_argument(
        "--temperature", type=float, default=0.0, help="0 (default): greedy; > 0: sample at this temperature"
    )
    parser.add_argument("--top-k", type=int, default=0, help="sample from the k most likely tokens (0: all)")
    parser.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass (1.0: off)")
    parser.add_argument("--seed", type=int, default=1234, help="random seed of sampling")
    parser.add_argument("--batch-size", type=int, default=8, help="prompts decoded together (default 8)")
    parser.add_argument(
        "--max-prompt-tokens",
        type=int,
        default=None,
        help="longest prompt accepted (default: the run's training.seq_length)",
    )
    parser.add_argument(
        "--ignore-eod",
        action="store_true",
        help="keep generating after an end-of-document token (a new document starts)",
    )
    parser.add_argument(
        "--record-routes", action="store_true", help="list the block each routed window chose (plan lol)"
    )
    parser.add_argument("--json", action="store_true", help="one JSON object per prompt on stdout")


def read_prompts(args) -> list:
    if args.prompt is not None:
        return [("--prompt", args.prompt)]
    prompts = [
        (f"--prompts {args.prompts} line {i}", text)
        for i, text in jsonl_texts("--prompts", args.prompts, ("prompt", "text"))
    ]
    if not prompts:
        raise CliError(f"--prompts {args.prompts}: no prompt in the file")
    return prompts


def check_args(args) -> None:
    if args.max_new_tokens < 1:
        raise CliError(f"--max-new-tokens: must be at least 1 (got {args.max_new_tokens})")
    if args.temperature < 0 or not math.isfinite(args.temperature):
        raise CliError(f"--temperature: must be >= 0 (got {args.temperature})")
    if args.top_k < 0:
        raise CliError(f"--top-k: must be >= 0 (got {args.top_k})")
    if not 0 < args.top_p <= 1:
        raise CliError(f"--top-p: must be in (0, 1] (got {args.top_p})")
    if args.batch_size < 1:
        raise CliError(f"--batch-size: must be at least 1 (got {args.batch_size})")


def encode_prompts(prompts: list, tokenizer, limit: int) -> list:
    out = []
    for where, text in prompts:
        ids = tokenizer.tokenize(text)
        if not ids:
            raise CliError(f"{where}: the prompt is empty (no tokens)")
        if len(ids) > limit:
            raise CliError(
                f"{where}: the prompt has {len(ids)} tokens, more than the model allows ({limit}: "
                f"--max-prompt-tokens, default the run's training.seq_length)"
            )
        out.append(ids)
    return out


def generate_batch(model, prompts: list, args, eod_id: int, loop_budget) -> list:
    """Decode one batch of token-id prompts; returns per prompt (new token ids, routes or None)."""
    from transformers import GenerationConfig

    from megatron_lol.convert.hf_modeling.cache_lol import LoLCache

    width = max(len(p) for p in prompts)
    pad = 0 if eod_id != 0 else 1
    device = model.device
    ids = torch.full((len(prompts), width), pad, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, p in enumerate(prompts):
        ids[i, width - len(p) :] = torch.tensor(p)
        mask[i, width - len(p) :] = 1
    cache = LoLCache(model.config, loop_budget, record_routes=args.record_routes)
    sample = args.temperature > 0
    config = GenerationConfig(
        max_new_tokens=args.max_new_tokens,
        do_sample=sample,
        pad_token_id=pad,
        eos_token_id=None if args.ignore_eod else eod_id,
    )
    if sample:
        config.update(temperature=args.temperature, top_k=args.top_k or None, top_p=args.top_p)
    kwargs = {"loop_budget": loop_budget} if loop_budget is not None else {}
    with torch.no_grad():
        out = model.generate(
            ids.to(device), attention_mask=mask.to(device), generation_config=config, cache=cache, **kwargs
        ).cpu()
    results = []
    for i, p in enumerate(prompts):
        new = out[i, width:].tolist()
        if not args.ignore_eod and eod_id in new:
            new = new[: new.index(eod_id) + 1]
        routes = None
        if cache.routes is not None:
            offset = width - len(p)
            routes = [
                {"depth": d, "document": doc, "window": w, "start": start - offset, "block": blk, "gate": round(g, 6)}
                for row, d, doc, w, start, blk, g in sorted(cache.routes)
                if row == i and start >= offset
            ]
            # the prompt's first document is document 0 (the left padding was the row's first)
            for r in routes:
                r["document"] -= 1 if offset else 0
        results.append((new, routes))
    return results


def run(args: argparse.Namespace) -> int:
    check_args(args)
    prompts = read_prompts(args)
    loaded = load_model(
        args.load,
        args.iteration,
        config=args.config,
        loop_budget=args.loop_budget,
        dtype=args.dtype,
        device=args.device,
    )
    tokenizer = load_tokenizer(loaded, args.tokenizer, args.tokenizer_type)
    limit = args.max_prompt_tokens or loaded.seq_length
    encoded = encode_prompts(prompts, tokenizer, limit)
    if args.record_routes and not any(step["block"] is None for step in loaded.model.config.steps):
        raise CliError(f"--record-routes: plan {loaded.cfg.model.plan.kind} has no routed depths")
    torch.manual_seed(args.seed)
    start, produced = time.perf_counter(), 0
    for first in range(0, len(encoded), args.batch_size):
        batch = encoded[first : first + args.batch_size]
        for j, (new, routes) in enumerate(generate_batch(loaded.model, batch, args, loaded.eod_id, loaded.loop_budget)):
            index = first + j
            produced += len(new)
            ended = loaded.eod_id in new and not args.ignore_eod
            text = tokenizer.detokenize([t for t in new if t != loaded.eod_id] if ended else new)
            if args.json:
                obj = {
                    "index": index,
                    "prompt": prompts[index][1],
                    "completion": text,
                    "prompt_tokens": len(batch[j]),
                    "completion_tokens": len(new),
                    "tokens": new,
                    "stopped_at_eod": ended,
                }
                if routes is not None:
                    obj["routes"] = routes
                print(json.dumps(obj, ensure_ascii=False), flush=True)
            else:
                log_rank0(f"=== {index}: {prompts[index][1]!r}\n{prompts[index][1]}{text}")
                if routes is not None:
                    log_rank0(format_routes(routes))
    seconds = time.perf_counter() - start
    msg = (
        f"generated {produced} tokens for {len(encoded)} prompt(s) in {seconds:.2f} s "
        f"({produced / max(seconds, 1e-9):.1f} tokens/s, plan {loaded.cfg.model.plan.kind}, "
        f"iteration {loaded.iteration})"
    )
    if args.json:
        print(msg, file=sys.stderr)
    else:
        log_rank0(msg)
    return 0


def format_routes(routes: list) -> str:
    """Per depth and document: the blocks of the windows in order (``d1 doc0: 2 0 0 3``)."""
    lines = {}
    for r in routes:
        lines.setdefault((r["depth"], r["document"]), []).append(str(r["block"]))
    return "\n".join(
        f"routes depth {d} document {doc}: {' '.join(blocks)}" for (d, doc), blocks in sorted(lines.items())
    )
