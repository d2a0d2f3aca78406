"""Reports of ``megatron-lol profile``: per-node rows, merging reports, the printed tables.

A multi-node run gathers one report per rank on rank 0; :func:`node_rows`
folds them into one row per node, :func:`merge_reports` combines the node rows
of several reports (``profile --merge``), :func:`format_report` and
:func:`format_nodes` print them.
"""

from __future__ import annotations

import json
import math
import os
import socket
from typing import Optional

from megatron_lol.errors import CliError

#: the step-time breakdown's sections, in report order ("core.*" are parts of "core")
SECTION_KEYS = (
    "prelude",
    "core",
    "core.blocks",
    "core.dispatch",
    "core.routing",
    "coda_head",
    "forward_other",
    "backward",
    "optimizer",
    "data",
)


def node_identity(env: Optional[dict] = None) -> tuple[int, str]:
    """``(node index, node name)`` of this process.

    The index is Slurm's ``SLURM_NODEID`` (the node's place in the job), else
    torchrun's ``GROUP_RANK``, else ``RANK // LOCAL_WORLD_SIZE``; the name is
    Slurm's ``SLURMD_NODENAME``, else the hostname. Rows are keyed by the
    index: hostnames repeat where nodes are containers or several ``slurmd``
    share a host, and would fold two nodes into one row.
    """
    env = os.environ if env is None else env
    name = env.get("SLURMD_NODENAME") or socket.gethostname()
    for key in ("SLURM_NODEID", "GROUP_RANK"):
        if str(env.get(key, "")).strip().isdigit():
            return int(env[key]), name
    rank = int(env.get("RANK", "0") or 0)
    local = max(1, int(env.get("LOCAL_WORLD_SIZE", "1") or 1))
    return rank // local, name


def node_rows(rank_reports: list) -> list:
    """One row per node (:func:`node_identity`) from per-rank reports."""
    by_node: dict = {}
    for rep in rank_reports:
        by_node.setdefault(rep.get("node", rep["host"]), []).append(rep)
    rows = []
    for node, reps in sorted(by_node.items(), key=lambda kv: min(r["rank"] for r in kv[1])):
        first = min(reps, key=lambda r: r["rank"])
        slowest = max(r["step_time_s"]["median"] for r in reps)
        gpus = [g for r in reps if r.get("gpu") for g in r["gpu"]["gpus"]]
        rows.append(
            {
                "host": first["host"],
                "node": node,
                "ranks": sorted(r["rank"] for r in reps),
                "devices": first["devices_per_node"],
                "step_time_s": slowest,
                "tokens_per_s_per_node": first["tokens_per_s_per_device"]
                * first["devices_per_node"]
                * first["step_time_s"]["median"]
                / slowest,
                "tflops_per_device": first["tflops_per_device"] * first["step_time_s"]["median"] / slowest,
                "mfu": (first["mfu"] * first["step_time_s"]["median"] / slowest) if first["mfu"] is not None else None,
                "peak_memory_bytes": max(r["peak_memory"]["bytes"] for r in reps),
                "gpus": gpus,
            }
        )
    return rows


def merge_reports(reports: list) -> dict:
    """Merge profile reports (each with a ``nodes`` list) into one per-node report.

    The merged report keeps every node row (sorted by host, then node index) and adds
    ``summary``: number of nodes, total tokens/s, mean / min TFLOP/s per device
    and MFU, the slowest node, and the minimum SM clock and utilisation seen
    on any GPU.
    """
    if not reports:
        raise CliError("--merge: no reports given")
    nodes = []
    for rep in reports:
        if "nodes" not in rep:
            raise CliError("--merge: a report without 'nodes' (not written by megatron-lol profile)")
        nodes.extend(rep["nodes"])
    nodes.sort(key=lambda r: (r["host"], r["node"] if isinstance(r.get("node"), int) else -1))
    tfl = [n["tflops_per_device"] for n in nodes]
    mfus = [n["mfu"] for n in nodes if n.get("mfu") is not None]
    gpus = [g for n in nodes for g in n.get("gpus", []) if g.get("samples")]
    slow = max(nodes, key=lambda n: n["step_time_s"])
    summary = {
        "nodes": len(nodes),
        "tokens_per_s_total": sum(n["tokens_per_s_per_node"] for n in nodes),
        "tflops_per_device_mean": sum(tfl) / len(tfl),
        "tflops_per_device_min": min(tfl),
        "mfu_mean": sum(mfus) / len(mfus) if mfus else None,
        "mfu_min": min(mfus) if mfus else None,
        "slowest_node": node_label(slow, nodes),
        "slowest_step_time_s": slow["step_time_s"],
        "gpu_sm_clock_mhz_min": min((g["sm_clock_mhz"]["min"] for g in gpus), default=None),
        "gpu_utilization_pct_min": min((g["utilization_pct"]["min"] for g in gpus), default=None),
    }
    return {"merged_from": len(reports), "nodes": nodes, "summary": summary}


def _fmt_s(x: float) -> str:
    return f"{x * 1e3:9.1f} ms"


def median_or_none(values: list) -> Optional[float]:
    """The median of the values that are not None (None without any)."""
    known = sorted(v for v in values if v is not None)
    if not known:
        return None
    mid = len(known) // 2
    return known[mid] if len(known) % 2 else (known[mid - 1] + known[mid]) / 2


def stragglers(ranks: list) -> Optional[dict]:
    """The slowest and fastest of the rank rows (``rank``, ``host``, ``compute_time_s``: a rank's median time
    to its gradient reduction), or None with fewer than two timed ranks."""
    timed = [r for r in ranks if r.get("compute_time_s") is not None]
    if len(timed) < 2:
        return None
    slow = max(timed, key=lambda r: r["compute_time_s"])
    fast = min(timed, key=lambda r: r["compute_time_s"])
    return {
        "slowest": {k: slow[k] for k in ("rank", "host", "compute_time_s")},
        "fastest": {k: fast[k] for k in ("rank", "host", "compute_time_s")},
    }


def format_report(rep: dict) -> str:
    lines = []
    c = rep["config"]
    lines.append(
        f"profile: plan {c['plan']}, width {c['hidden_size']}, L={c['num_blocks']}, depth {c['depth']}"
        f"/{c['core_depth']}, W={c['window_size']}, S={c['window_shift']}, "
        f"{c['global_batch_size']} x {c['seq_length']} tokens per step, {rep['world_size']} device(s) "
        f"[{rep['device']['name']}], {rep['steps']} steps"
    )
    st = rep["step_time_s"]
    lines.append(
        f"  step time        median {st['median'] * 1e3:.1f} ms  (mean {st['mean'] * 1e3:.1f}, "
        f"min {st['min'] * 1e3:.1f}, max {st['max'] * 1e3:.1f})"
    )
    lines.append(
        f"  tokens/s         {rep['tokens_per_s_per_device']:,.0f} per device, "
        f"{rep['tokens_per_s_per_node']:,.0f} per node"
    )
    lines.append(
        f"  TFLOP/s/device   {rep['tflops_per_device']:.4g} model (allowed pairs), "
        f"{rep['tflops_per_device_executed']:.4g} executed"
    )
    if rep["mfu"] is not None:
        lines.append(
            f"  MFU              {100 * rep['mfu']:.1f}% of {rep['peak_tflops']:.0f} TFLOP/s ({rep['precision']})"
        )
    else:
        lines.append("  MFU              - (no peak for this device; --peak-tflops sets one)")
    timing = rep.get("timing") or {}
    b = rep["breakdown_s"]
    if b is None:
        lines.append(f"  timing           whole steps ({timing.get('steps', '?')}), no section timers")
    else:
        synced = " synchronised at every timed module" if timing.get("synchronised_sections") else ""
        lines.append(f"  breakdown per step (section timers{synced}; read throughput from a --no-breakdown run):")
        for key in SECTION_KEYS:
            label = ("    " + key.split(".", 1)[1]) if "." in key else key
            lines.append(f"    {label:16s}{_fmt_s(b[key])}  {100 * b[key] / max(st['mean'], 1e-12):5.1f}%")
    sg = rep.get("stragglers")
    if sg:
        slow, fast = sg["slowest"], sg["fastest"]
        lines.append(
            f"  slowest rank     {slow['rank']} (host {slow['host']}): {slow['compute_time_s'] * 1e3:.1f} "
            f"ms to the gradient reduction per step; fastest rank {fast['rank']} (host {fast['host']}): "
            f"{fast['compute_time_s'] * 1e3:.1f} ms"
        )
    m = rep["peak_memory"]
    lines.append(
        f"  peak memory      {m['bytes'] / 2**20:,.0f} MiB ({m['kind']}); model estimate "
        f"{rep['memory_model_bytes']['total'] / 2**20:,.0f} MiB"
    )
    hs = rep.get("host_syncs")
    if hs and hs.get("error"):
        lines.append(f"  host syncs/step  not counted: {hs['error']}")
    elif hs:
        names = ", ".join(f"{k} {v:g}" for k, v in hs["by_name"].items()) or "none"
        lines.append(
            f"  host syncs/step  {hs['per_step']:g} ({names}); {hs['ops_per_step']:,.0f} ATen ops/step "
            f"(counted in {hs['steps']} untimed steps after the timed ones)"
        )
    r = rep.get("routing")
    if r:
        lines.append(f"  routing          from {r.get('steps', '?')} untimed step(s) of its own (not the timed steps)")
        lines.append(
            f"  distinct blocks per path {r['distinct_blocks_per_path']:.2f} "
            f"(uniform routing: {r['distinct_blocks_uniform_expectation']:.2f})"
        )
        for d, row in enumerate(r["block_utilisation"], 1):
            lines.append(f"    depth {d:2d} utilisation " + " ".join(f"{x:.2f}" for x in row))
    g = rep.get("gpu")
    if g:
        for gpu in g["gpus"]:
            if not gpu.get("samples"):
                continue
            lines.append(
                f"  GPU {gpu['index']} {gpu['name']}: util {gpu['utilization_pct']['mean']:.0f}% "
                f"(min {gpu['utilization_pct']['min']:.0f}), power {gpu['power_w']['mean']:.0f} W "
                f"(min {gpu['power_w']['min']:.0f}), SM clock {gpu['sm_clock_mhz']['mean']:.0f} MHz "
                f"(min {gpu['sm_clock_mhz']['min']:.0f}), memory "
                f"{gpu['memory_used_bytes']['max'] / 2**30:.1f} GiB, throttle "
                f"{gpu['throttle_reasons'] or 'none'}"
            )
    return "\n".join(lines)


def node_label(node: dict, nodes: list) -> str:
    """The node's host name, with ``#index`` when several rows share that name."""
    same = sum(1 for n in nodes if n["host"] == node["host"])
    return node["host"] if same == 1 or "node" not in node else f"{node['host']}#{node['node']}"


def format_nodes(merged: dict) -> str:
    lines = [
        f"{'host':24s} {'step ms':>9s} {'tokens/s/node':>14s} {'TFLOP/s/dev':>12s} {'MFU':>6s} "
        f"{'peak mem MiB':>13s} {'min SM MHz':>11s}"
    ]
    for n in merged["nodes"]:
        mfu_txt = "-" if n["mfu"] is None else f"{100 * n['mfu']:.1f}%"
        clock = min((g["sm_clock_mhz"]["min"] for g in n.get("gpus", []) if g.get("samples")), default=None)
        lines.append(
            f"{node_label(n, merged['nodes'])[:24]:24s} {n['step_time_s'] * 1e3:9.1f} "
            f"{n['tokens_per_s_per_node']:14,.0f} "
            f"{n['tflops_per_device']:12.3f} "
            f"{mfu_txt:>6s} {n['peak_memory_bytes'] / 2**20:13,.0f} "
            f"{'-' if clock is None else format(clock, '.0f'):>11s}"
        )
    s = merged["summary"]
    lines.append(
        f"{s['nodes']} node(s): {s['tokens_per_s_total']:,.0f} tokens/s in all; TFLOP/s per device mean "
        f"{s['tflops_per_device_mean']:.3f}, min {s['tflops_per_device_min']:.3f}; slowest node "
        f"{s['slowest_node']} ({s['slowest_step_time_s'] * 1e3:.1f} ms per step)"
    )
    return "\n".join(lines)


def write_json(path: str, obj: dict) -> None:
    d = os.path.dirname(os.path.abspath(path))
    os.makedirs(d, exist_ok=True)
    with open(path, "w") as f:
        json.dump(obj, f, indent=2, default=_json_default)
    print(f"wrote {path}")


def _json_default(x):
    if isinstance(x, float) and not math.isfinite(x):
        return None
    return str(x)
