"""What ``megatron-lol plan-layout`` prints: the proposals' table, the first one's changes and flags."""

from __future__ import annotations

from megatron_lol.perf.planner import USABLE_FRACTION, Proposal, Target


def flags_for(p: Proposal) -> list:
    """The ``megatron-lol train`` arguments that apply ``p``'s changes (Megatron-LM's flags where they
    exist, ``--set key=value`` otherwise)."""
    from megatron_lol.config.loader import BOOL_FLAGS, MEGATRON_FLAGS, flag_for_key

    out = []
    for key, (_, new) in p.changes.items():
        flag = flag_for_key(key)
        if isinstance(new, bool):
            if new and flag in BOOL_FLAGS:
                out.append(flag)
            else:
                out += ["--set", f"{key}={'true' if new else 'false'}"]
        elif new is None:
            out += ["--set", f"{key}=null"]
        elif flag in MEGATRON_FLAGS:
            out += [flag, str(new)]
        else:
            out += ["--set", f"{key}={new}"]
    return out


def _gib(x: float) -> str:
    return f"{x / 2**30:.1f} GiB"


def _layout(p: Proposal) -> str:
    return (
        f"TP {p.tp} x PP {p.pp}"
        + (f" (virtual {p.vpp})" if p.vpp else "")
        + f" x DP {p.dp}"
        + (f", EP {p.ep}" if p.ep > 1 else "")
    )


def describe_changes(p: Proposal, seq: int) -> list:
    """One line per changed setting; the batch and the run's length say what they do to the tokens."""
    lines = []
    for key, (old, new) in p.changes.items():
        line = f"  {key}: {old} -> {new}"
        if key == "training.global_batch_size" and old:
            line += (
                f" (tokens per step {old * seq:,} -> {new * seq:,}, {100 * (new - old) / old:+.2f}%; "
                f"the learning rate is the config's)"
            )
        if key == "training.train_iters" and p.config_tokens:
            line += (
                f" (total tokens {p.config_tokens:,} -> {p.tokens:,}, {100 * (p.tokens / p.config_tokens - 1):+.3f}%)"
            )
        lines.append(line)
    if "training.train_iters" not in p.changes and p.config_tokens and p.tokens != p.config_tokens:
        lines.append(
            f"  iterations from the FLOP budget (training.train_flops): {p.train_iters:,}; total tokens "
            f"{p.config_tokens:,} -> {p.tokens:,} ({100 * (p.tokens / p.config_tokens - 1):+.3f}%)"
        )
    return lines or ["  nothing: the config runs as written"]


def format_plan(config: str, cfg, target: Target, error, proposals: list, config_memory=None) -> str:
    seq = cfg.training.seq_length
    par, tr = cfg.parallel, cfg.training
    lines = [
        f"plan-layout: {config} on {target.nodes} node(s) x {target.gpus_per_node} = {target.world} devices of "
        f"{target.device_bytes / 2**30:g} GiB (proposals fill at most {USABLE_FRACTION:.0%}), "
        f"{cfg.model.precision.params_dtype}; step times at MFU {target.mfu:g} of {target.peak_tflops:g} TFLOP/s",
        f"config as written: TP {par.tensor_model_parallel_size} x PP {par.pipeline_model_parallel_size}, "
        f"micro-batch {tr.micro_batch_size}, global batch {tr.global_batch_size}: "
        + (
            f"does not run here ({error})"
            if error is not None
            else "runs at this world size"
            + ("" if config_memory is None else f", {_gib(config_memory)} per GPU estimated")
        ),
    ]
    if not proposals:
        lines.append("no layout the trainer accepts was found for this allocation")
        return "\n".join(lines)
    header = (
        f"  {'#':>2}  {'layout':<28}{'micro':>6}{'global':>7}{'tokens/step':>13}  {'recompute':<10}"
        f"{'dist-opt':<9}{'memory/GPU':>11}{'step':>9}{'tokens/s/GPU':>14}"
    )
    lines += ["", header]
    for i, p in enumerate(proposals, 1):
        lines.append(
            f"  {i:>2}  {_layout(p) + (', SP' if p.sequence_parallel else ''):<28}{p.micro_batch:>6}{p.global_batch:>7}"
            f"{p.global_batch * seq:>13,}  {p.recompute or '-':<10}{'yes' if p.distributed_optimizer else 'no':<9}"
            f"{_gib(p.memory_bytes):>11}{p.step_seconds:>8.2f}s{p.tokens_per_s_per_gpu:>14,.0f}"
            + ("" if p.fits else "  (does not fit)")
        )
    first = proposals[0]
    lines += ["", "proposal 1 changes:"] + describe_changes(first, seq)
    flags = flags_for(first)
    lines += ["", "flags: " + (" ".join(flags) if flags else "(none)")]
    if not first.fits:
        lines.append("note: no layout fits the device memory; the one with the smallest estimate is shown first")
    return "\n".join(lines)
