#!/usr/bin/env python
"""Decoding speed and cache memory of LoL, dense and Accordion exports: cached vs recomputed.

Models (same width, heads, FFN, vocabulary; each executes 6 layers per token, built the
way ``megatron-lol convert-hf`` exports them, from real configs, with random weights):

  lol        the remote-code LoL model: prelude 1, L blocks, D routed depths, coda 1
             (the routers' weights are spread so that windows route to every block);
  dense      a stock transformers ``LlamaForCausalLM`` of n_prelude + D + n_coda layers
             (convert-hf writes a plain dense stack as Llama): the baseline;
  accordion  the remote-code Accordion: prelude 1, a loop window of D - 1 layers, its
             first layer again (loop budget 1), coda 1.

For each model, batch size and number of new tokens, ``generate`` runs greedily with
``min_new_tokens = max_new_tokens`` from a random prompt with the cache (``use_cache=True``:
LoLCache for the remote-code models, DynamicCache for Llama; the fastest of ``--repeats``
runs, the models alternating so that load from other processes hits them alike) and
recomputing the whole prefix at every step (``use_cache=False``, one run) up to
``--recompute-limit`` new tokens. Recomputation is quadratic in the length (batch 8 at
1,024 new tokens takes most of an hour per model on 2 cores), so for every length it is
also *estimated* from timed forwards: step ``t`` of ``generate(use_cache=False)`` is one
forward of the ``prompt + t`` tokens (last logits only), timed at ``--estimate-points``
lengths (the fastest of ``--repeats``) and summed over the steps with the trapezoid rule.
The estimate leaves out ``generate``'s own per-step work, so it overstates recomputation's
speed and understates the speed-up; where both exist the table shows both. Reported:
tokens/s (all rows), the speed-up of the cache, layer executions per second of the cached
run and its ratio to the dense model's, and the cache's memory after the run: for LoLCache,
the windowed core steps (LoL's routed depths: one window per row and depth, flat) apart
from the rest (prelude, coda, full-attention steps, which grow with the context).

    python bench/decode.py                                   # defaults: about half an hour on 2 cores
    python bench/decode.py --new-tokens 64,256 --batch 1 --json out.json
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from _shared import add_layer_size_args, add_threads_arg  # noqa: E402 (bench/ is sys.path[0])

MODELS = ("lol", "dense", "accordion")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
    add_layer_size_args(p)
    p.set_defaults(hidden=128, ffn=384)
    p.add_argument("--blocks", type=int, default=4, help="L of the LoL model")
    p.add_argument("--depth", type=int, default=4, help="D: routed depths (dense: D core layers)")
    p.add_argument("--window", type=int, default=32, help="W")
    p.add_argument("--shift", type=int, default=16, help="S")
    p.add_argument("--vocab", type=int, default=8192)
    p.add_argument("--seq-length", type=int, default=256, help="the models' training sequence length")
    p.add_argument("--prompt", type=int, default=32, help="prompt tokens per row")
    p.add_argument("--new-tokens", default="64,256,1024", help="comma-separated numbers of generated tokens")
    p.add_argument("--batch", default="1,8", help="comma-separated batch sizes")
    p.add_argument(
        "--recompute-limit",
        type=int,
        default=256,
        help="run generate(use_cache=False) up to this many new tokens (default 256); estimate it for all",
    )
    p.add_argument("--estimate-points", type=int, default=9, help="timed forwards per recomputation estimate")
    p.add_argument(
        "--repeats",
        type=int,
        default=3,
        help="cached runs (and timed forwards of an estimate) per measurement: the fastest counts",
    )
    p.add_argument("--json", default=None, help="also write the results here")
    add_threads_arg(p)
    return p.parse_args(argv)


def experiment(args, model: dict):
    from megatron_lol.config import config_from_dict

    m = dict(
        hidden_size=args.hidden,
        num_attention_heads=args.heads,
        ffn_hidden_size=args.ffn,
        n_prelude=1,
        n_coda=1,
    )
    m.update(model)
    return config_from_dict({"model": m, "training": {"seq_length": args.seq_length}})


def build_models(args) -> dict:
    """The three exports' models (random weights, fp32, eval mode)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from megatron_lol.convert.hf_modeling.configuration_lol import LoLConfig
    from megatron_lol.convert.hf_modeling.modeling_lol import LoLForCausalLM
    from megatron_lol.convert.to_hf import llama_config_json, lol_config_json

    tokens = {"eod_id": 2, "bos_id": 1, "pad_id": 0}
    configs = {
        "lol": experiment(
            args,
            dict(
                plan=dict(
                    kind="lol",
                    num_blocks=args.blocks,
                    routed_depth=args.depth,
                    windows={"size": args.window, "shift": args.shift},
                )
            ),
        ),
        "dense": experiment(args, dict(plan=dict(kind="dense", layers=args.depth))),
        "accordion": experiment(
            args, dict(plan=dict(kind="accordion", window=args.depth - 1, budgets=[0, 1], budget=1))
        ),
    }
    models = {}
    torch.manual_seed(0)
    for name, cfg in configs.items():
        if name == "dense":
            conf = llama_config_json(cfg, args.vocab, torch.float32, tokens)
            model = LlamaForCausalLM(LlamaConfig(**{k: v for k, v in conf.items() if k != "torch_dtype"}))
        else:
            conf = lol_config_json(cfg, args.vocab, torch.float32, tokens, 1 if name == "accordion" else None)
            for key in ("architectures", "model_type", "auto_map", "torch_dtype"):
                conf.pop(key)
            model = LoLForCausalLM(LoLConfig(**conf))
            routing = getattr(model.model, "routing", None)
            if routing is not None:
                with torch.no_grad():  # windows of different content route to different blocks
                    for router in routing.routers:
                        router.weight.normal_(0.0, 2.0)
                    routing.depth_embeddings.normal_(0.0, 1.0)
        models[name] = model.eval()
    return models


def executed_layers(model) -> int:
    return (
        model.config.num_hidden_layers
        if not hasattr(model, "model") or not hasattr(model.model, "schedule")
        else model.config.n_prelude + len(model.model.schedule()) + model.config.n_coda
    )


def cache_bytes(cache) -> dict:
    if hasattr(cache, "memory_bytes"):
        return cache.memory_bytes()
    total = sum(
        layer.keys.numel() * layer.keys.element_size() + layer.values.numel() * layer.values.element_size()
        for layer in cache.layers
        if layer.keys is not None
    )
    return {"documents": total, "windows": 0}


def run_generate(model, prompt, new_tokens: int, use_cache: bool) -> tuple:
    start = time.perf_counter()
    with torch.no_grad():
        out = model.generate(
            prompt,
            attention_mask=torch.ones_like(prompt),
            max_new_tokens=new_tokens,
            min_new_tokens=new_tokens,
            do_sample=False,
            use_cache=use_cache,
            pad_token_id=0,
            return_dict_in_generate=True,
        )
    seconds = time.perf_counter() - start
    assert out.sequences.shape[1] == prompt.shape[1] + new_tokens
    return seconds, (cache_bytes(out.cache) if use_cache else None)


def estimate_recompute(model, prompt, new_tokens: int, points: int, repeats: int) -> float:
    """Seconds of ``generate(use_cache=False)`` for ``new_tokens`` steps: forwards of the prompt plus
    ``t`` tokens (last logits only, as generate asks) timed at ``points`` values of ``t`` (the
    fastest of ``repeats``), summed over ``t = 0 .. new_tokens - 1`` with the trapezoid rule."""
    b, p = prompt.shape
    gen = torch.Generator().manual_seed(2)
    longest = torch.cat([prompt, torch.randint(3, model.config.vocab_size, (b, new_tokens), generator=gen)], dim=1)
    ts = sorted({round(i * (new_tokens - 1) / max(points - 1, 1)) for i in range(points)})
    cost = {}
    with torch.no_grad():
        for t in ts:
            ids = longest[:, : p + t]
            for _ in range(repeats):
                start = time.perf_counter()
                model(ids, attention_mask=torch.ones_like(ids), logits_to_keep=1)
                cost[t] = min(cost.get(t, float("inf")), time.perf_counter() - start)
    total = 0.0
    for a, c in zip(ts, ts[1:]):  # steps a .. c - 1, the cost interpolated linearly between the timed ones
        total += (c - a) * (cost[a] + cost[c]) / 2
    return total + cost[ts[-1]]


def main(argv=None) -> dict:
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    news = [int(x) for x in args.new_tokens.split(",")]
    batches = [int(x) for x in args.batch.split(",")]
    models = build_models(args)
    gen = torch.Generator().manual_seed(1)
    for model in models.values():  # warm-up
        run_generate(model, torch.randint(3, args.vocab, (1, 8), generator=gen), 4, True)
    rows = []
    for batch in batches:
        prompt = torch.randint(3, args.vocab, (batch, args.prompt), generator=gen)
        for new in news:
            cached = {}
            for _ in range(args.repeats):  # the models alternate: load from other processes hits them alike
                for name, model in models.items():
                    seconds, memory = run_generate(model, prompt, new, True)
                    if seconds < cached.get(name, (float("inf"),))[0]:
                        cached[name] = (seconds, memory)
            for name, model in models.items():
                cached_s, memory = cached[name]
                recompute_s = run_generate(model, prompt, new, False)[0] if new <= args.recompute_limit else None
                estimate_s = estimate_recompute(model, prompt, new, args.estimate_points, args.repeats)
                rows.append(
                    {
                        "model": name,
                        "layers": executed_layers(model),
                        "batch": batch,
                        "new_tokens": new,
                        "cached_tokens_per_s": batch * new / cached_s,
                        "recompute_tokens_per_s": batch * new / recompute_s if recompute_s else None,
                        "recompute_estimate_tokens_per_s": batch * new / estimate_s,
                        "cache_bytes": memory,
                    }
                )
                print(
                    f"  {name} batch {batch} new {new}: cached {cached_s:.2f} s"
                    + (f", recompute {recompute_s:.2f} s" if recompute_s else "")
                    + f", recompute estimate {estimate_s:.2f} s",
                    file=sys.stderr,
                    flush=True,
                )
    print_table(rows, args)
    result = {"args": vars(args), "rows": rows}
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
    return result


def print_table(rows: list, args) -> None:
    dense = {(r["batch"], r["new_tokens"]): r for r in rows if r["model"] == "dense"}
    print(
        f"decoding: width {args.hidden}, heads {args.heads}, FFN {args.ffn}, vocab {args.vocab}, W={args.window}, "
        f"S={args.shift}, prompt {args.prompt} tokens, {args.threads} thread(s); baseline: dense (stock Llama)"
    )
    print(
        f"{'model':<10} {'layers':>6} {'batch':>5} {'new':>5} {'cached tok/s':>12} {'recompute tok/s':>15} "
        f"{'(estimate)':>10} {'speed-up':>9} {'layer-exec/s':>12} {'vs dense':>8} {'cache KiB':>10} "
        f"{'core KiB':>9}"
    )
    for r in rows:
        base = dense[r["batch"], r["new_tokens"]]
        per_layer = r["cached_tokens_per_s"] * r["layers"]
        ratio = per_layer / (base["cached_tokens_per_s"] * base["layers"])
        rec, est = r["recompute_tokens_per_s"], r["recompute_estimate_tokens_per_s"]
        speedup = f"{r['cached_tokens_per_s'] / rec:.1f}" if rec else f"~{r['cached_tokens_per_s'] / est:.1f}"
        mem = r["cache_bytes"]
        print(
            f"{r['model']:<10} {r['layers']:>6} {r['batch']:>5} {r['new_tokens']:>5} "
            f"{r['cached_tokens_per_s']:>12.1f} {f'{rec:.1f}' if rec else '-':>15} {est:>10.1f} {speedup:>9} "
            f"{per_layer:>12.0f} {ratio:>8.2f} {(mem['documents'] + mem['windows']) / 1024:>10.1f} "
            f"{mem['windows'] / 1024:>9.1f}"
        )


if __name__ == "__main__":
    main()
