"""``megatron-lol params``: total / non-embedding / active parameter counts of a config.

Counts are sums over the model's parameters (:mod:`megatron_lol.model.params`): the
model is built on the ``meta`` device at TP size 1, which allocates nothing, so the
largest configs count as fast as the smallest (importing megatron-core is most of it). The
vocabulary is ``--vocab-size``, else ``model.vocab_size``, else the size of the
config's tokenizer (``data.tokenizer_model`` / ``vocab_file``, as training
derives it); it is padded to a multiple of ``model.make_vocab_size_divisible_by``
as the trainer pads it, at every TP size (``--no-pad-vocab`` to count it as given).

Beyond the headline rows and the breakdown, a looped MoE core (Foil) prints
its accounting (the Foil paper's) ``E_real = E*D``, ``D_eff = D*L``, ``E_eq = E*D*L``,
``E_comp = k*D*L`` and its parameter-table (Table 3) columns; plan ``accordion`` prints
the active parameters per budget. ``--json``
carries the same as ``loop_accounting``, ``seed_columns`` and ``budgets``.

Last, the run: its iterations (``training.train_iters``, or those the FLOP
budget ``training.train_flops`` buys), tokens and training FLOPs by the FLOP
model with the growing depth counted (:mod:`megatron_lol.perf.budget`); JSON
``training``. Matched-compute configs (the four ``math-1b-*``) are compared there.
"""

from __future__ import annotations

import argparse
import json

from megatron_lol.config import add_config_arguments, config_from_args
from megatron_lol.config.loader import PARAMS_GROUPS
from megatron_lol.errors import CliError
from megatron_lol.model.params import count_parameters
from megatron_lol.perf.budget import RunFlops
from megatron_lol.plan.windows import fixed_attention_of


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_config_arguments(parser, groups=PARAMS_GROUPS)
    group = parser.add_argument_group("counting")
    group.add_argument(
        "--vocab-size",
        type=int,
        default=None,
        metavar="N",
        help="vocabulary size (default: model.vocab_size, else the config's tokenizer)",
    )
    group.add_argument(
        "--no-pad-vocab", action="store_true", help="count the vocabulary as given, without the trainer's padding"
    )
    group.add_argument("--json", action="store_true", help="print the counts as one JSON object")


def pad_vocab(vocab: int, divisible_by: int) -> int:
    """The trainer's padding (``lol_model.padded_vocab_size``, which imports megatron-core)."""
    return ((vocab + divisible_by - 1) // divisible_by) * divisible_by


def tokenizer_vocab(cfg) -> int | None:
    """The vocabulary of the config's tokenizer (None when the config names no tokenizer file)."""
    import os

    d = cfg.data
    named = (
        ("data.tokenizer_model", d.tokenizer_model),
        ("data.vocab_file", d.vocab_file),
        ("data.merge_file", d.merge_file),
    )
    files = [(key, path) for key, path in named if path]
    if not files:
        return None
    for key, path in files:
        if not os.path.exists(path) and not (key == "data.tokenizer_model" and d.tokenizer_on_hub()):
            hint = (
                " (the quickstart's tokenizer is built by `megatron-lol prepare-quickstart`)"
                if "quickstart" in path
                else ""
            )
            raise CliError(
                f"model.vocab_size: not set, and {key} {path} does not exist{hint}; "
                f"set model.vocab_size or pass --vocab-size N"
            )
    from megatron_lol.data.tokenizers import build_tokenizer

    try:
        tok = build_tokenizer(
            d.tokenizer_type, tokenizer_model=d.tokenizer_model, vocab_file=d.vocab_file, merge_file=d.merge_file
        )
    except (ValueError, OSError, RuntimeError) as err:
        raise CliError(
            f"data.tokenizer_type {d.tokenizer_type}: cannot read the tokenizer ({err}); "
            f"set model.vocab_size or pass --vocab-size N"
        ) from None
    return int(tok.vocab_size)


def padded_vocab(cfg) -> int | None:
    """The vocabulary rows training builds (before a checkpoint's record): ``model.vocab_size``, else the
    tokenizer's padded to ``model.make_vocab_size_divisible_by``; None when the config names neither."""
    if cfg.model.vocab_size is not None:
        return cfg.model.vocab_size
    vocab = tokenizer_vocab(cfg)
    return None if vocab is None else pad_vocab(vocab, cfg.model.make_vocab_size_divisible_by)


def training_section(cfg, vocab: int) -> dict | None:
    """The run's length and training FLOPs (FLOP model, growth included: :mod:`megatron_lol.perf.budget`);
    None without ``training.global_batch_size`` (the step's size would depend on the launch)."""
    tr = cfg.training
    if tr.global_batch_size is None:
        return None
    run = RunFlops(cfg, vocab)
    iters = run.iterations_for(tr.train_flops) if tr.train_flops is not None else tr.train_iters
    return {
        "train_iters": iters,
        "train_flops_budget": tr.train_flops,
        "global_batch_size": run.batch,
        "seq_length": run.seq,
        "tokens": iters * run.batch * run.seq,
        "training_flops": run(iters),
        "steps_per_depth": {str(d): n for d, n in run.depths(iters).items() if d is not None},
    }


def format_training(section: dict | None, width: int) -> list:
    if section is None:
        return ["", "  training FLOPs: set training.global_batch_size to count them"]
    how = (
        f"from the budget training.train_flops {section['train_flops_budget']:.4g}"
        if section["train_flops_budget"] is not None
        else "training.train_iters"
    )
    rows = [
        ("iterations (" + how + ")", f"{section['train_iters']:,}"),
        ("tokens", f"{section['tokens']:,}"),
        (
            "training FLOPs (FLOP model, growth included)",
            f"{section['training_flops']:.6g} = {section['training_flops'] / 1e18:,.2f} EFLOP",
        ),
    ]
    width = max(width, max(len(r[0]) for r in rows) + 2)
    out = ["", f"  training run (global batch {section['global_batch_size']} x {section['seq_length']} tokens)"]
    out += [f"    {name:<{width - 2}}{value:>30}" for name, value in rows]
    return out


def resolve_vocab(args, cfg) -> tuple[int, int]:
    """(vocabulary as given, vocabulary the model is built with)."""
    vocab = args.vocab_size if args.vocab_size is not None else cfg.model.vocab_size
    if vocab is None:
        vocab = tokenizer_vocab(cfg)
    if vocab is None:
        raise CliError(
            "model.vocab_size: not set in the config (and no data.tokenizer_model to take it from); "
            "set it or pass --vocab-size N"
        )
    if vocab <= 0:
        raise CliError(f"--vocab-size: must be > 0 (got {vocab})")
    if args.no_pad_vocab:
        return vocab, vocab
    return vocab, pad_vocab(vocab, cfg.model.make_vocab_size_divisible_by)


def _m(n: int) -> str:
    return f"{n / 1e6:,.2f}M"


def format_table(counts, cfg, config_path: str, vocab: int, training: dict | None = None) -> str:
    m = cfg.model
    plan = m.execution_plan()
    shape = f"plan {plan.name}, width {m.hidden_size}, {m.n_prelude}+{m.n_coda} fixed layers, {plan.describe()}"
    if not plan.routed:
        shape += f" ({fixed_attention_of(m)} attention)"
    if m.moe.layers != "none":
        experts = str(m.moe.num_experts)
        if m.core_experts is not None and m.core_experts != m.moe.num_experts:
            experts = f"{m.moe.num_experts} fixed / {m.core_experts} core"
        shape += f", MoE ({m.moe.layers}: {experts} experts, top-{m.moe.router_topk}"
        if m.moe.shared_expert_intermediate_size:
            shape += f", 1 shared expert of {m.moe.shared_expert_intermediate_size}"
        shape += ")"
    vocab_note = f"vocab {counts.vocab_size:,}" + (f" (padded from {vocab:,})" if vocab != counts.vocab_size else "")
    accordion = plan.has_budgets
    rows = [
        ("total", counts.total),
        ("non-embedding", counts.non_embedding),
        (
            "active per token (non-embedding, unlooped k=0 pass)"
            if accordion
            else "active per token (non-embedding, stored once)",
            counts.active_per_token,
        ),
        (
            f"active per token (non-embedding, per execution, k={max(plan.budgets) if accordion else 0})"
            if accordion
            else "active per token (non-embedding, per execution)",
            counts.active_compute,
        ),
        ("active per token incl. embedding + head", counts.active_with_embedding),
        ("linear weights, stored (paper convention)", counts.linear_total),
        ("linear weights, active (paper convention)", counts.linear_active),
        ("linear weights, active per execution", counts.linear_active_compute),
    ]
    breakdown = [(k.replace("_", " "), v) for k, v in counts.breakdown.items() if v]
    block = counts.block
    per_block = [
        ("one block: attention", block.attention),
        ("one block: MLP / experts", block.mlp + block.experts),
    ]
    if block.shared_expert:
        per_block.append(("one block: shared expert", block.shared_expert))
    if block.moe_router:
        per_block.append((f"one block: MoE router ({block.num_experts} experts)", block.moe_router))
    per_block.append(("one block: linear", block.linear))
    if counts.pass_attention_sets:
        per_block.append(
            (
                f"one pass attention set (norm + attention), x{counts.pass_attention_sets}",
                counts.pass_attention // counts.pass_attention_sets,
            )
        )
    if counts.num_routers:
        per_block.append((f"one router (d*L + L^2 + 2L), x{counts.num_routers}", counts.router_each))
    width = max(len(r[0]) for r in rows + breakdown + per_block) + 2
    out = [f"{config_path}: {shape}; {vocab_note}", ""]
    out += [f"  {name:<{width}}{n:>16,}  {_m(n):>10}" for name, n in rows]
    out += ["", "  breakdown"]
    out += [f"    {name:<{width - 2}}{n:>16,}  {_m(n):>10}" for name, n in breakdown]
    out += ["", "  per block"]
    out += [f"    {name:<{width - 2}}{n:>16,}  {_m(n):>10}" for name, n in per_block]
    acc = counts.loop_accounting
    if acc is not None:
        out += [
            "",
            f"  looped MoE core (Foil paper accounting): (E, D, L) = {acc['shape']}, k = {acc['k']}, "
            f"attention {'untied' if acc['untie_attention'] else 'shared'} across passes",
        ]
        out += [
            f"    {name:<{width - 2}}{acc[key]:>16,}"
            for name, key in (
                ("E_real = E*D (distinct core experts)", "E_real"),
                ("D_eff = D*L (core layer executions)", "D_eff"),
                ("E_eq = E*D*L (unrolled experts)", "E_eq"),
                ("E_comp = k*D*L (expert calls per token)", "E_comp"),
            )
        ]
        out += ["", "  Foil paper Table 3 columns"]
        names = {
            "core_experts_and_routers": "loop block: experts incl. routers",
            "core_attention": "loop block: attention",
            "head_and_tail": "head + tail layers",
            "other": "other (embedding + output)",
        }
        out += [f"    {names[k]:<{width - 2}}{n:>16,}  {_m(n):>10}" for k, n in counts.seed_columns.items()]
    if counts.budgets:
        out += ["", "  budgets (active per token, non-embedding, every execution counted)"]
        for b in counts.budgets:
            name = f"k={b['k']}: {b['layer_executions']} layer executions"
            out.append(f"    {name:<{width - 2}}{b['active_compute']:>16,}  {_m(b['active_compute']):>10}")
    out += format_training(training, width)
    return "\n".join(out)


def run(args) -> int:
    cfg = config_from_args(args, check_data=False)
    vocab, padded = resolve_vocab(args, cfg)
    counts = count_parameters(cfg.model, padded)
    training = training_section(cfg, padded)
    from megatron_lol.perf.memory import layout_given, per_rank_section

    per_rank = per_rank_section(cfg, padded) if layout_given(cfg) else None  # the layout flags' answer
    if args.json:
        payload = {"config": args.config, "vocab_size_given": vocab, **counts.to_dict(), "training": training}
        if per_rank:
            payload["per_rank"] = per_rank[1]
        print(json.dumps(payload, indent=None, sort_keys=False))
    else:
        print(format_table(counts, cfg, args.config, vocab, training) + (per_rank[0] if per_rank else ""))
    return 0
