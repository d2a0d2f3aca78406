"""``megatron-lol analyze``: routing analyses of a trained LoL checkpoint.

Subcommands (each writes PNG/JSON files under ``--output``):

``utilisation``  block utilisation per routed depth: heatmap PNG + JSON counts [depth x block]
``paths``        per-example routing-path vectors (one-hot block per depth x window ordinal),
                 PCA scatter coloured by a label field, JSON coordinates
``mode-path``    the mode path of the validation examples (docs/model.md, "Path forcing"):
                 ids/gates JSON (overall and per label); ``--evaluate``: loss routed vs forced;
                 ``--generate PROMPT``: greedy generation routed and under the forced path
``distinct``     distinct blocks per token path: histogram PNG + JSON against E[U]
                 (docs/model.md, "Parameter accounting")
``moe-routing``  looped / Accordion MoE cores (docs/model.md, "Foil"): distinct experts per token U_t,
                 load balance B2 and median margin ratio MMR per pass: JSON + PNG
``budgets``      Accordion (docs/model.md, "Accordion"): loss of the examples at every budget k
                 (JSON + PNG); ``--generate PROMPT``: greedy generation at each budget

Data: ``--data-path PREFIX`` (a Megatron indexed dataset; ``--part valid`` takes the
validation documents of the run's split) or ``--jsonl FILE`` with ``--text-field`` and
``--label-field``, tokenized with the checkpoint's tokenizer.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import time

from megatron_lol.errors import CliError
from megatron_lol.log import add_general_arguments
from megatron_lol.plan.routing import routing_of
from megatron_lol.plan.windows import windows_of

SUBCOMMANDS = ("utilisation", "paths", "mode-path", "distinct", "moe-routing", "budgets")


def _common(p: argparse.ArgumentParser, data_required: bool = True) -> argparse._ArgumentGroup:
    """The options every analysis takes, grouped; returns the group for the analysis's own options."""
    ck = p.add_argument_group("checkpoint")
    ck.add_argument(
        "--load",
        required=True,
        metavar="DIR",
        help="checkpoint directory (a training --save dir or an iter_XXXXXXX dir)",
    )
    ck.add_argument(
        "--iteration", type=int, default=None, metavar="N", help="iteration to read (default: the tracker's)"
    )
    ex = p.add_argument_group("examples")
    src = ex.add_mutually_exclusive_group(required=data_required)
    src.add_argument("--data-path", metavar="PREFIX", help="Megatron indexed dataset prefix (documents are examples)")
    src.add_argument("--jsonl", metavar="FILE", help="JSON-lines file, one example per line")
    ex.add_argument(
        "--text-field", default="text", metavar="KEY", help="--jsonl field holding each example's text (default: text)"
    )
    ex.add_argument(
        "--label-field", default=None, metavar="KEY", help="--jsonl field that labels each example (colours, groups)"
    )
    ex.add_argument(
        "--part",
        default="valid",
        choices=("train", "valid", "test", "all"),
        help="documents of --data-path: this part of the run's split (default valid)",
    )
    ex.add_argument(
        "--max-examples", type=int, default=256, metavar="N", help="read at most this many examples (default 256)"
    )
    ex.add_argument(
        "--seq-length",
        type=int,
        default=None,
        metavar="N",
        help="tokens per example, longer ones are truncated (default: the run's seq_length)",
    )
    ex.add_argument(
        "--rows-per-batch",
        type=int,
        default=8,
        metavar="N",
        help="rows of packed examples per forward pass (default 8; memory vs speed)",
    )
    out = p.add_argument_group("output")
    out.add_argument("--output", required=True, metavar="DIR", help="directory for the PNG/JSON outputs (created)")
    own = p.add_argument_group(f"{p.prog.split()[-1]} options")
    add_general_arguments(p)
    return own


def add_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="analysis", metavar="ANALYSIS", required=True)
    p = sub.add_parser("utilisation", help="block utilisation heatmap per routed depth")
    _common(p)
    p = sub.add_parser("paths", help="routing-path vectors and their PCA, coloured by a label")
    own = _common(p)
    own.add_argument(
        "--max-windows", type=int, default=None, metavar="K", help="window ordinals kept per depth (default: all)"
    )
    p = sub.add_parser("mode-path", help='mode path (docs/model.md, "Path forcing"); evaluate / generate under it')
    own = _common(p, data_required=False)
    own.add_argument(
        "--path-file", default=None, metavar="JSON", help="force this ids/gates JSON instead of computing a mode path"
    )
    own.add_argument("--label", default=None, help="use the mode path of this label (with --label-field)")
    own.add_argument("--evaluate", action="store_true", help="loss of the examples routed vs under the mode path")
    own.add_argument("--generate", default=None, metavar="PROMPT", help="greedy generation routed and forced")
    own.add_argument(
        "--max-new-tokens", type=int, default=32, metavar="N", help="tokens --generate adds at most (default 32)"
    )
    p = sub.add_parser("distinct", help="distinct blocks per routing path vs E[U]")
    _common(p)
    p = sub.add_parser("moe-routing", help="U_t, B2 and MMR per pass of a looped MoE core (Foil)")
    own = _common(p)
    own.add_argument("--budget", type=int, default=None, help="Accordion: the budget to run (default: the largest)")
    p = sub.add_parser("budgets", help="Accordion: loss (and generation) at every budget")
    own = _common(p, data_required=False)
    own.add_argument("--generate", default=None, metavar="PROMPT", help="greedy generation at every budget")
    own.add_argument(
        "--max-new-tokens", type=int, default=32, metavar="N", help="tokens --generate adds at most (default 32)"
    )


# ------------------------------------------------------------------ helpers
def _load(args):
    from megatron_lol.analysis.loading import load_checkpoint

    ckpt = load_checkpoint(args.load, args.iteration)
    m, plan = ckpt.cfg.model, ckpt.model.plan
    has_budgets = plan.has_budgets
    if args.analysis == "moe-routing":
        if plan.routed or plan.core_experts is None:
            raise CliError(
                f"{ckpt.path}: moe-routing needs a looped, foil or accordion plan with MoE blocks "
                f"(model.moe.layers: all); this model is plan {m.plan.kind!r}, moe_layers {m.moe.layers!r}"
            )
    elif args.analysis == "budgets":
        if not has_budgets:
            raise CliError(f"{ckpt.path}: budgets needs plan: accordion (this model is plan {m.plan.kind!r})")
    elif not plan.routed:
        raise CliError(f"{ckpt.path}: the model's plan is {m.plan.kind!r}; routing analyses need plan: lol")
    budget = getattr(args, "budget", None)
    if budget is not None and budget not in plan.budgets:
        raise CliError(
            f"--budget: {budget} is not one of the model's budgets "
            f"{plan.budgets if has_budgets else '(not an accordion model)'}"
        )
    return ckpt


def _examples(args, ckpt) -> tuple:
    from megatron_lol.analysis.loading import read_indexed, read_jsonl

    if args.data_path:
        if args.label_field:
            raise CliError("--label-field needs --jsonl (an indexed dataset has no labels)")
        toks = read_indexed(args.data_path, args.part, ckpt.cfg.data.split, args.max_examples)
        labels = None
    elif args.jsonl:
        toks, labels = read_jsonl(args.jsonl, ckpt.tokenizer, args.text_field, args.label_field, args.max_examples)
    else:
        return [], None
    keep = [i for i, t in enumerate(toks) if any(int(x) != ckpt.eod_id for x in t)]
    toks = [toks[i] for i in keep]
    labels = [labels[i] for i in keep] if labels is not None else None
    if not toks:
        raise CliError("no non-empty example in the data")
    return toks, labels


def _seq_length(args, ckpt) -> int:
    return int(args.seq_length or ckpt.cfg.training.seq_length)


def _write_json(path: str, obj) -> None:
    with open(path, "w") as f:
        json.dump(obj, f, indent=1)


def _meta(ckpt, args, n: int) -> dict:
    m, plan = ckpt.cfg.model, ckpt.model.plan
    return {
        "checkpoint": ckpt.path,
        "iteration": ckpt.iteration,
        "examples": n,
        "num_blocks": plan.num_stored_blocks,
        "depth": plan.depth,
        "window_size": windows_of(m).size,
        "window_shift": windows_of(m).shift,
        "router_tied": routing_of(m).router_tied,
        "router_input": routing_of(m).router_input,
        "data": args.data_path or args.jsonl,
        "part": args.part if args.data_path else None,
    }


@contextlib.contextmanager
def output_dir(path: str):
    """Create ``--output`` (and missing parents) for the analysis inside; if it fails, remove the
    directories created here, so a failed analysis leaves nothing behind (files it wrote into a
    directory that existed before stay: they may sit beside the user's own)."""
    created, parent = None, os.path.abspath(path)
    while not os.path.exists(parent):
        created, parent = parent, os.path.dirname(parent)
    try:
        os.makedirs(path, exist_ok=True)
    except OSError as err:
        raise CliError(f"--output: cannot create {path}: {err.strerror or err}") from None
    if not os.access(path, os.W_OK | os.X_OK):
        raise CliError(f"--output: {path} is not a writable directory")
    try:
        yield
    except BaseException:
        if created is not None:
            shutil.rmtree(created, ignore_errors=True)
        raise


# ------------------------------------------------------------------ subcommands
def run_utilisation(args, ckpt, toks, labels) -> dict:
    from megatron_lol.analysis import plots
    from megatron_lol.analysis.routing import collect_routes, utilisation_counts

    plan = ckpt.model.plan
    routes = collect_routes(ckpt.model, toks, _seq_length(args, ckpt), ckpt.eod_id, args.rows_per_batch)
    counts = utilisation_counts(routes, plan.depth, plan.num_stored_blocks)
    share = counts.double() / counts.sum(1, keepdim=True).clamp(min=1)
    png = os.path.join(args.output, "utilisation.png")
    plots.utilisation_heatmap(counts, png, f"block utilisation, {os.path.basename(ckpt.path)} ({len(routes)} examples)")
    out = dict(
        _meta(ckpt, args, len(routes)),
        counts=counts.tolist(),
        share=[[round(v, 6) for v in row] for row in share.tolist()],
        top_block_share=[round(v, 6) for v in share.max(1).values.tolist()],
    )
    _write_json(os.path.join(args.output, "utilisation.json"), out)
    print(
        f"utilisation: {counts.sum().item()} windows over {plan.depth} depths x {plan.num_stored_blocks} blocks; "
        f"busiest block per depth {[f'{100 * v:.0f}%' for v in out['top_block_share']]}"
    )
    return {"png": png, "json": os.path.join(args.output, "utilisation.json")}


def run_paths(args, ckpt, toks, labels) -> dict:
    import torch

    from megatron_lol.analysis import plots
    from megatron_lol.analysis.routing import collect_routes, nearest_centroid_accuracy, path_vectors, pca

    plan = ckpt.model.plan
    routes = collect_routes(ckpt.model, toks, _seq_length(args, ckpt), ckpt.eod_id, args.rows_per_batch)
    vec = path_vectors(routes, plan.depth, plan.num_stored_blocks, args.max_windows)
    coords, ratio = pca(vec, 2)
    labs = labels if labels is not None else ["all"] * len(routes)
    acc = nearest_centroid_accuracy(vec, labs)
    png = os.path.join(args.output, "paths_pca.png")
    distinct = int(torch.unique(vec, dim=0).shape[0]) if len(routes) else 0
    plots.pca_scatter(
        coords, labs, png, ratio, f"routing paths, PCA ({len(routes)} examples, {distinct} distinct paths)"
    )
    out = dict(
        _meta(ckpt, args, len(routes)),
        label_field=args.label_field,
        vector_size=int(vec.shape[1]),
        distinct_paths=distinct,
        explained_variance_ratio=ratio.tolist(),
        nearest_centroid_accuracy=acc,
        labels=sorted(set(labs), key=str),
        examples=[
            {
                "index": i,
                "label": labs[i],
                "pc": [round(float(c), 6) for c in coords[i]],
                "path": [r.choice.tolist() for r in routes[i].records],
            }
            for i in range(len(routes))
        ],
    )
    _write_json(os.path.join(args.output, "paths.json"), out)
    torch_save_vectors(os.path.join(args.output, "path_vectors.pt"), vec, labs)
    print(
        f"paths: {len(routes)} vectors of size {vec.shape[1]} ({distinct} distinct), PC1/PC2 explain "
        f"{100 * float(ratio[0]):.1f}% / {100 * float(ratio[1]):.1f}%"
        + (f", nearest-centroid label accuracy {100 * acc:.1f}%" if acc is not None else "")
    )
    return {"png": png, "json": os.path.join(args.output, "paths.json")}


def torch_save_vectors(path: str, vec, labels) -> None:
    import torch

    torch.save({"vectors": vec, "labels": list(labels)}, path)


def run_distinct(args, ckpt, toks, labels) -> dict:
    from megatron_lol.analysis import plots
    from megatron_lol.analysis.routing import collect_routes, distinct_summary

    m, plan = ckpt.cfg.model, ckpt.model.plan
    routes = collect_routes(ckpt.model, toks, _seq_length(args, ckpt), ckpt.eod_id, args.rows_per_batch)
    summary = distinct_summary(routes, plan.depth, plan.num_stored_blocks, windows_of(m).size, windows_of(m).shift)
    png = os.path.join(args.output, "distinct.png")
    plots.distinct_histogram(
        summary["histogram"],
        summary["expected_distinct_uniform"],
        summary["mean_distinct"],
        png,
        f"distinct blocks per token path (L={plan.num_stored_blocks}, D={plan.depth})",
    )
    out = dict(_meta(ckpt, args, len(routes)), **summary)
    _write_json(os.path.join(args.output, "distinct.json"), out)
    print(
        f"distinct: mean {summary['mean_distinct']:.2f} distinct blocks per token path "
        f"(uniform independent routing: E[U] = {summary['expected_distinct_uniform']:.2f}); "
        f"{summary['unique_paths']} unique paths over {summary['tokens']} tokens"
    )
    return {"png": png, "json": os.path.join(args.output, "distinct.json")}


def run_moe_routing(args, ckpt, toks, labels) -> dict:
    from megatron_lol.analysis import plots
    from megatron_lol.analysis.routing import collect_moe_records
    from megatron_lol.model.moe_metrics import summarise

    m, plan = ckpt.cfg.model, ckpt.model.plan
    kw = {"budget": args.budget} if plan.has_budgets else {}
    batches = collect_moe_records(ckpt.model, toks, _seq_length(args, ckpt), ckpt.eod_id, args.rows_per_batch, **kw)
    records = [r for batch in batches for r in batch]
    if not records:
        raise CliError("moe-routing: no example was long enough to route (see --seq-length / --max-examples)")
    E, D, passes, k = plan.core_experts, plan.num_stored_blocks, plan.loop_passes, m.moe.router_topk
    summary = summarise(records, E, k)
    shape = {
        "E": E,
        "D": D,
        "L": passes,
        "k": k,
        "E_real": E * D,
        "D_eff": D * passes,
        "E_eq": E * D * passes,
        "E_comp": k * D * passes,
    }
    png = os.path.join(args.output, "moe_routing.png")
    plots.per_pass_metrics(
        summary["by_pass"],
        png,
        f"(E, D, L) = ({shape['E']}, {shape['D']}, {shape['L']}), {os.path.basename(ckpt.path)}",
    )
    out = dict(_meta(ckpt, args, len(toks)), shape=shape, **summary)
    if kw:
        out["budget"] = plan.resolve_budget(args.budget)
    _write_json(os.path.join(args.output, "moe_routing.json"), out)
    print(
        f"moe-routing: U_t {summary['distinct_experts_per_token']:.2f} of at most {summary['distinct_experts_cap']} "
        f"| B2 {summary['b2']:.3f} | MMR {summary['mmr']:.3f} | per pass MMR "
        f"{[round(p['mmr'], 3) for p in summary['by_pass']]}"
    )
    return {"png": png, "json": os.path.join(args.output, "moe_routing.json")}


def run_budgets(args, ckpt, toks, labels) -> dict:
    from megatron_lol.analysis import plots
    from megatron_lol.analysis.routing import greedy_generate, lm_loss

    budgets = ckpt.model.plan.budgets
    if not toks and args.generate is None:
        raise CliError("budgets: give examples (--data-path / --jsonl) and/or --generate PROMPT")
    prompt = _prompt_ids(args, ckpt) if args.generate is not None else None
    out = dict(_meta(ckpt, args, len(toks) if toks else 0), budgets=list(budgets))
    if toks:
        losses = {
            str(k): lm_loss(ckpt.model, toks, _seq_length(args, ckpt), ckpt.eod_id, args.rows_per_batch, budget=k)
            for k in budgets
        }
        out["loss_by_budget"] = losses
        plots.loss_by_budget(
            losses, os.path.join(args.output, "budgets.png"), f"loss per budget, {os.path.basename(ckpt.path)}"
        )
        print("budgets: loss " + " ".join(f"k={k}: {v:.4f}" for k, v in losses.items()))
    if prompt is not None:
        gens = {}
        for k in budgets:
            ids = greedy_generate(ckpt.model, prompt, args.max_new_tokens, ckpt.eod_id, budget=k)
            gens[str(k)] = ckpt.tokenizer.detokenize(ids)
            print(f"budgets: k={k}: {args.generate!r} -> {gens[str(k)]!r}")
        out["generation"] = {"prompt": args.generate, "by_budget": gens}
    _write_json(os.path.join(args.output, "budgets.json"), out)
    return {"json": os.path.join(args.output, "budgets.json")}


def _prompt_ids(args, ckpt) -> list:
    """``--generate PROMPT`` as token ids, with the run's tokenizer."""
    if ckpt.tokenizer is None:
        raise CliError(f"{ckpt.path}: --generate needs the run's tokenizer (none recorded in its run_config)")
    prompt = ckpt.tokenizer.tokenize(args.generate)
    if not prompt:
        raise CliError("--generate: the prompt tokenizes to nothing")
    return prompt


def _read_path_file(path: str):
    import torch

    try:
        obj = json.load(open(path))
        return torch.tensor(obj["ids"], dtype=torch.long), torch.tensor(obj["gates"], dtype=torch.float32)
    except (OSError, ValueError, KeyError, TypeError) as err:
        raise CliError(f"--path-file {path}: expected a JSON object with 'ids' and 'gates': {err}") from None


def run_mode_path(args, ckpt, toks, labels) -> dict:
    import torch

    from megatron_lol.analysis.routing import (
        collect_routes,
        forced_path,
        greedy_generate,
        group_by_label,
        lm_loss,
        mode_path,
    )

    plan = ckpt.model.plan
    seq = _seq_length(args, ckpt)
    out = dict(_meta(ckpt, args, len(toks)))
    per_label = {}
    if args.path_file:
        ids, gates = _read_path_file(args.path_file)
        out["source"] = args.path_file
    else:
        if not toks:
            raise CliError("mode-path needs --data-path or --jsonl (or --path-file)")
        routes = collect_routes(ckpt.model, toks, seq, ckpt.eod_id, args.rows_per_batch)
        ids, gates = mode_path(routes)
        out["source"] = "mode path of the examples"
        if labels is not None:
            for lab, rs in sorted(group_by_label(labels, routes).items(), key=lambda kv: str(kv[0])):
                lids, lgates = mode_path(rs)
                per_label[lab] = {"examples": len(rs), "ids": lids.tolist(), "gates": lgates.tolist()}
            if args.label is not None:
                if args.label not in per_label:
                    raise CliError(f"--label {args.label!r}: not a label of the data ({sorted(per_label)})")
                ids = torch.tensor(per_label[args.label]["ids"])
                gates = torch.tensor(per_label[args.label]["gates"])
                out["source"] = f"mode path of label {args.label!r}"
    if ids.dim() not in (2, 3) or ids.shape[0] != plan.depth:
        raise CliError(f"path ids of shape {tuple(ids.shape)}: expected [{plan.depth}, K] (one row per routed depth)")
    if int(ids.max()) >= plan.num_stored_blocks:
        raise CliError(f"path names block {int(ids.max())} but the library has {plan.num_stored_blocks}")
    out.update(
        ids=ids.tolist(),
        gates=[[round(float(g), 6) for g in row] for row in gates.reshape(ids.shape[0], -1)]
        if ids.dim() == 2
        else gates.tolist(),
    )
    if per_label:
        out["per_label"] = per_label
    forced = forced_path(ids, gates)
    if args.evaluate:
        if not toks:
            raise CliError("--evaluate needs --data-path or --jsonl")
        routed, routed_ex = lm_loss(ckpt.model, toks, seq, ckpt.eod_id, args.rows_per_batch, per_example=True)
        forced_l, forced_ex = lm_loss(
            ckpt.model, toks, seq, ckpt.eod_id, args.rows_per_batch, forced=forced, per_example=True
        )
        ev = {"routed_loss": routed, "forced_loss": forced_l, "forced_minus_routed": forced_l - routed}
        if per_label:
            by = {}
            for lab, info in per_label.items():
                idx = [i for i, lb in enumerate(labels) if lb == lab]
                sub = [toks[i] for i in idx]
                own = forced_path(torch.tensor(info["ids"]), torch.tensor(info["gates"]))
                by[lab] = {
                    "routed_loss": sum(routed_ex[i] for i in idx) / len(idx),
                    "forced_global_loss": sum(forced_ex[i] for i in idx) / len(idx),
                    "forced_own_label_loss": lm_loss(
                        ckpt.model, sub, seq, ckpt.eod_id, args.rows_per_batch, forced=own
                    ),
                }
            ev["per_label"] = by
        out["evaluation"] = ev
        print(f"mode-path: loss routed {routed:.4f}, under the forced path {forced_l:.4f} ({forced_l - routed:+.4f})")
    if args.generate is not None:
        prompt = _prompt_ids(args, ckpt)
        gen_r = greedy_generate(ckpt.model, prompt, args.max_new_tokens, ckpt.eod_id)
        gen_f = greedy_generate(ckpt.model, prompt, args.max_new_tokens, ckpt.eod_id, forced=forced)
        out["generation"] = {
            "prompt": args.generate,
            "prompt_ids": prompt,
            "routed_ids": gen_r,
            "routed_text": ckpt.tokenizer.detokenize(gen_r),
            "forced_ids": gen_f,
            "forced_text": ckpt.tokenizer.detokenize(gen_f),
        }
        print(f"routed: {args.generate}{out['generation']['routed_text']!r}")
        print(f"forced: {args.generate}{out['generation']['forced_text']!r}")
    _write_json(os.path.join(args.output, "mode_path.json"), out)
    print(f"mode-path: ids {ids.tolist()} -> {os.path.join(args.output, 'mode_path.json')}")
    return {"json": os.path.join(args.output, "mode_path.json")}


RUNNERS = {
    "utilisation": run_utilisation,
    "paths": run_paths,
    "mode-path": run_mode_path,
    "distinct": run_distinct,
    "moe-routing": run_moe_routing,
    "budgets": run_budgets,
}


def run(args) -> int:
    import torch

    t0 = time.perf_counter()
    if getattr(args, "label", None) is not None and not args.label_field:
        raise CliError("--label needs --label-field")
    if args.max_examples < 1:
        raise CliError("--max-examples must be >= 1")
    from megatron_lol.training.checkpointing.resolve import check_save_dir

    problem = check_save_dir(args.output)  # before the checkpoint is read, not after
    if problem is not None:
        raise CliError(f"--output: {problem}")
    ckpt = _load(args)
    toks, labels = _examples(args, ckpt)
    with output_dir(args.output), torch.no_grad():
        RUNNERS[args.analysis](args, ckpt, toks, labels)
    print(f"analyze {args.analysis}: done in {time.perf_counter() - t0:.1f} s -> {args.output}")
    return 0
