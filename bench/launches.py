#!/usr/bin/env python
"""Kernel launches and host synchronisations per micro-batch: the routed core's two executors, vs dense.

What a GPU step pays on the CPU, counted on the CPU (``megatron_lol.perf.op_count``):
ATen operations (about one kernel launch each) and operations that force the
host to wait for the device (``.item()``, ``.tolist()``, ``.cpu()``,
``nonzero``, ``bincount``, boolean-mask indexing, ...), in the forward and the
backward of one training micro-batch, for ``L`` = 2, 4, 8, 16 blocks at ``D``
routed depths and for a dense model of the same executed layers
(``n_prelude + D + n_coda``). Counted with the CPU backend off
(``MEGATRON_LOL_CPU_BACKEND=0``: the path a GPU runs), on the local ``[s, b, h]``
layout and the packed (THD) layout.

Rows:

  core ref       the routed core (``Core.forward``) with the per-block executor
                 (``executors.PerBlockCalls``: one layer call per block and depth),
                 given the prelude's output and the micro-batch's host-built
                 layout (``host_layout``; its host-side work is not counted, as it
                 happens where the batch is built);
  core grouped   the same core with the grouped executor (``executors.GroupedGEMMs``);
  model ref      the whole LoL model (embedding, prelude, core, coda, loss) with
                 the per-block executor, given the layout as the trainer gives it;
  model grouped  the whole model with the grouped executor (prelude and coda unchanged);
  dense          ``plan: dense`` with ``D`` core layers (full causal attention), given its
                 host layout (the documents) as the LoL models are.

``--film depth`` (or ``depth_block``): the LoL models with FiLM; with ``depth``, the dense model too
(FiLM per depth is a dense plan's option as well; per block has no dense counterpart).

CPU time: median over ``--reps`` of one forward + backward (process CPU time),
with the CPU backend off and on (``cpu ms``: the reference with the CPU backend,
what CPU training runs), the runs interleaved; then the ratio grouped /
reference-with-backend paired per repetition.

``--what expert-parallel``: the core's counts under expert parallelism (EP = 2,
two gloo processes, each holding half of the library and routing its own
tokens), the reference and the grouped core, on rank 0.

``--what stacking``: the cost of stacking the library's weights per micro-batch
(``grouped_blocks.stack_library``, forward and backward) against one grouped
depth's forward + backward, at the quickstart shape and the 360M shape.

    python bench/launches.py                          # counts, L = 2,4,8,16, D = 8
    python bench/launches.py --hidden 128 --heads 4 --ffn 384 --blocks 4 --depth 4 --window 32 --shift 16 \\
        --batch 8 --seq 256 --layouts local --reps 10   # CPU time at the quickstart shape
    python bench/launches.py --what stacking
    python bench/launches.py --what expert-parallel
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch
from _shared import add_threads_arg, setup_megatron  # bench/ is sys.path[0]

BACKEND_ENV = "MEGATRON_LOL_CPU_BACKEND"


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--hidden", type=int, default=32)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--ffn", type=int, default=None, help="default: the model's (64 * ceil(8h/3/64))")
    p.add_argument("--blocks", default="2,4,8,16", help="L values")
    p.add_argument("--depth", type=int, default=8, help="D")
    p.add_argument("--prelude", type=int, default=1)
    p.add_argument("--coda", type=int, default=1)
    p.add_argument("--window", type=int, default=8, help="W")
    p.add_argument("--shift", type=int, default=4, help="S")
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--seq", type=int, default=64)
    p.add_argument("--vocab", type=int, default=97)
    p.add_argument("--docs-per-row", type=int, default=2, help="EOD-separated documents per row")
    p.add_argument("--film", default="off", help="model.plan.film of the LoL models: off, depth, depth_block")
    p.add_argument("--layouts", default="local,packed")
    p.add_argument(
        "--reps", type=int, default=3, help="timed forward+backward repetitions (median; 0: counts only, no CPU times)"
    )
    p.add_argument(
        "--what", default="counts", help="counts, stacking, expert-parallel (comma-separated; default counts)"
    )
    p.add_argument("--stacking-shapes", default="quickstart,360M", help="shapes of the stacking measurement")
    add_threads_arg(p)
    return p.parse_args(argv)


def model_config(args, blocks, plan=None):
    """The benched model: a LoL plan of ``blocks`` blocks at ``args.depth`` depths, or ``plan`` (a plan section)."""
    from megatron_lol.config import config_from_dict

    m = dict(
        plan=plan or dict(kind="lol", num_blocks=blocks, routed_depth=args.depth),
        hidden_size=args.hidden,
        num_attention_heads=args.heads,
        n_prelude=args.prelude,
        n_coda=args.coda,
    )
    m["plan"] = dict(m["plan"])
    if m["plan"]["kind"] == "lol":
        m["plan"].update(windows={"size": args.window, "shift": args.shift}, film=args.film)
    elif args.film == "depth":  # the dense model of equal executed layers does the same FiLM per depth
        m["plan"].update(film="depth")
    if args.ffn:
        m["ffn_hidden_size"] = args.ffn
    return config_from_dict({"model": m}).model


def build(args, blocks, packed, parallel=None, plan=None):
    from megatron_lol.model.lol_model import LoLGPTModel

    net = LoLGPTModel(
        model_config(args, blocks, plan),
        args.vocab,
        0,
        parallel=parallel,
        init_seed=1234,
        max_sequence_length=args.seq,
        packed_sequences=packed,
    )
    if getattr(net.core, "routers", None) is not None:
        gen = torch.Generator().manual_seed(7)  # routes spread over the blocks (zero routers tie everywhere)
        with torch.no_grad():
            for router in net.core.routers:
                router.logits.weight.copy_(torch.randn(router.logits.weight.shape, generator=gen))
    return net.train()


def make_batch(args, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    tokens = torch.randint(1, args.vocab, (args.batch, args.seq), generator=gen)
    for k in range(1, args.docs_per_row):
        tokens[:, k * args.seq // args.docs_per_row - 1] = 0  # EOD
    labels = torch.roll(tokens, -1, dims=1)
    seeds = torch.arange(args.batch) + 1234 * 1_000_000_007
    return tokens, labels, seeds


def host_layout(args, net, tokens, seeds):
    """The micro-batch's layout as the trainer builds it with the batch (the dense plan: documents only)."""
    from megatron_lol.model.host_layout import build_host_layout, routed_depths

    plan = net.core.plan
    return build_host_layout(
        tokens, 0, args.window, args.shift, routed_depths(plan), plan.num_stored_blocks, seeds if plan.routed else None
    )


def use_executor(net, impl):
    """The executor a model built with ``parallel.routed_core: grouped`` (``impl == "grouped"``) or
    ``reference`` has."""
    from megatron_lol.model.executors import GroupedGEMMs, PerBlockCalls

    if net.core is not None and net.core.plan.routed:
        net.core.executor = GroupedGEMMs() if impl == "grouped" else PerBlockCalls()


def core_runner(net, impl, layout, seeds, args):
    """A closure: one core forward from fixed prelude-like states, returning a scalar loss."""
    core, b, s = net.core, args.batch, args.seq
    docs = layout.document_layout()
    rope = net.rotary(s)
    steps = core.plan.steps()
    shape = (b * s, 1, args.hidden) if net.packed else (s, b, args.hidden)
    x0 = torch.randn(shape, generator=torch.Generator().manual_seed(1))

    def run():
        use_executor(net, impl)
        x = x0.clone().requires_grad_(True)
        out = core(x, docs, rope, steps, depth=len(steps), layout=layout)
        return out.states.float().square().mean() + out.aux_loss

    return run


def model_runner(net, impl, layout, tokens, labels, seeds):
    """One training forward of the whole model with either executor, on the micro-batch's host-built layout
    as the trainer passes it (``parallel.routed_core: grouped`` or ``reference``)."""

    def run():
        use_executor(net, impl)
        out = net(tokens, labels=labels, layout=layout, noise_seeds=seeds)
        return out.float().mean()

    return run


def count(run) -> dict:
    from megatron_lol.perf.op_count import OpCounter

    with OpCounter() as fwd:
        loss = run()
    with OpCounter() as bwd:
        loss.backward()
    return {
        "fwd_ops": fwd.ops,
        "bwd_ops": bwd.ops,
        "fwd_syncs": fwd.syncs,
        "bwd_syncs": bwd.syncs,
        "sync_names": dict(fwd.sync_names + bwd.sync_names),
    }


def cpu_times(runs: dict, reps: int) -> dict:
    """``{(name, backend on): [CPU ms per forward + backward]}``, the runs interleaved rep by rep so that
    load from other processes hits them alike (after one warm-up each)."""
    times = {key: [] for key in runs}
    if reps <= 0:
        return times
    for key, run in runs.items():
        with_backend(key[1], lambda: run().backward())
    for _ in range(reps):
        for key, run in runs.items():

            def once():
                t0 = time.process_time()
                run().backward()
                return time.process_time() - t0

            times[key].append(1e3 * with_backend(key[1], once))
    return times


def with_backend(enabled: bool, fn):
    old = os.environ.get(BACKEND_ENV)
    os.environ[BACKEND_ENV] = "1" if enabled else "0"
    try:
        return fn()
    finally:
        if old is None:
            del os.environ[BACKEND_ENV]
        else:
            os.environ[BACKEND_ENV] = old


def measure_counts(args):
    tokens, labels, seeds = make_batch(args)
    rows, paired = [], []
    for layout_name in args.layouts.split(","):
        packed = layout_name == "packed"
        dense = build(args, 0, packed, plan=dict(kind="dense", layers=args.depth))
        for blocks in [int(x) for x in args.blocks.split(",")]:
            torch.manual_seed(0)
            net = build(args, blocks, packed)
            layout = host_layout(args, net, tokens, seeds)
            runs = {
                "core ref": core_runner(net, "ref", layout, seeds, args),
                "core grouped": core_runner(net, "grouped", layout, seeds, args),
                "model ref": model_runner(net, "ref", layout, tokens, labels, seeds),
                "model grouped": model_runner(net, "grouped", layout, tokens, labels, seeds),
            }
            if blocks == max(int(x) for x in args.blocks.split(",")):
                runs["dense"] = model_runner(
                    dense, "ref", host_layout(args, dense, tokens, seeds), tokens, labels, seeds
                )
            timed = {
                (name, on): run
                for name, run in runs.items()
                for on in (False, True)
                if on is False or name.endswith("ref") or name == "dense"
            }
            times = cpu_times(timed, args.reps)
            for name, run in runs.items():
                row = with_backend(False, lambda: count(run))
                for on, key in ((False, "ms_off"), (True, "ms_on")):
                    t = times.get((name, on))
                    row[key] = statistics.median(t) if t else None
                rows.append((layout_name, args.depth if name == "dense" else blocks, name, row))
            for what in ("core", "model"):
                pairs = sorted(g / r for g, r in zip(times[(f"{what} grouped", False)], times[(f"{what} ref", True)]))
                if pairs:
                    paired.append((layout_name, blocks, what, statistics.median(pairs), pairs[0], pairs[-1]))
    return rows, paired


def print_counts(args, rows, paired):
    print(
        f"per micro-batch: {args.batch} x {args.seq} tokens ({args.docs_per_row} documents per row), "
        f"width {args.hidden}, D={args.depth}, W={args.window}, S={args.shift}, prelude {args.prelude}, "
        f"coda {args.coda}, FiLM {args.film}; {torch.get_num_threads()} thread(s); counts with {BACKEND_ENV}=0"
    )
    print(
        f"{'layout':7s} {'L':>3s} {'path':14s} {'syncs fwd':>9s} {'syncs bwd':>9s} {'ops fwd':>8s} {'ops bwd':>8s}"
        f" {'ops total':>9s} {'cpu ms':>8s} {'ms off':>8s}  syncs by op"
    )
    for layout_name, blocks, name, r in rows:
        label = "-" if name == "dense" else str(blocks)
        on = f"{r['ms_on']:8.1f}" if r["ms_on"] is not None else f"{'-':>8s}"
        off = f"{r['ms_off']:8.1f}" if r["ms_off"] is not None else f"{'-':>8s}"
        names = ", ".join(f"{k} {v}" for k, v in sorted(r["sync_names"].items()))
        print(
            f"{layout_name:7s} {label:>3s} {name:14s} {r['fwd_syncs']:9d} {r['bwd_syncs']:9d} {r['fwd_ops']:8d}"
            f" {r['bwd_ops']:8d} {r['fwd_ops'] + r['bwd_ops']:9d} {on} {off}  {names}"
        )
    print(
        "cpu ms: forward + backward with the CPU backend (the reference as CPU training runs it); "
        "ms off: without it (the path a GPU runs)"
    )
    for layout_name in args.layouts.split(","):
        total = {(b, n): r["fwd_ops"] + r["bwd_ops"] for l, b, n, r in rows if l == layout_name}
        dense = total[(args.depth, "dense")]
        ls = sorted({b for b, n in total if n != "dense"})
        for name in ("model ref", "model grouped", "core ref", "core grouped"):
            growth = total[(ls[-1], name)] / total[(ls[0], name)]
            line = f"{layout_name}: {name:13s} ops L={ls[-1]} / L={ls[0]} = {growth:.2f}"
            if name.startswith("model") and 4 in ls:
                line += f";  L=4 / dense = {total[(4, name)] / dense:.2f}"
            print(line)
    if paired:
        print("CPU time, grouped / reference with the CPU backend, paired per repetition (median, min, max):")
        for layout_name, blocks, what, med, lo, hi in paired:
            print(f"{layout_name}: L={blocks} {what:5s} {med:.3f} ({lo:.3f} .. {hi:.3f})")


def measure_stacking(args):
    """Stacking the library per micro-batch vs one grouped depth's forward + backward."""
    from megatron_lol.config import config_from_dict
    from megatron_lol.model.attention import chunk_bias
    from megatron_lol.model.core import Core
    from megatron_lol.model.grouped_blocks import RowRope, grouped_blocks, stack_library
    from megatron_lol.model.library import block_spec, core_config, transformer_config
    from megatron_lol.model.static_routing import group_tokens

    shapes = {
        "quickstart": dict(
            hidden_size=128,
            num_attention_heads=4,
            ffn_hidden_size=384,
            num_blocks=4,
            routed_depth=4,
            window_size=32,
            window_shift=16,
            batch=8,
            seq=256,
        ),
        "360M": dict(
            hidden_size=1024,
            num_attention_heads=16,
            ffn_hidden_size=2816,
            num_blocks=4,
            routed_depth=16,
            window_size=128,
            window_shift=64,
            batch=1,
            seq=1024,
        ),
    }
    print(
        "stacking the library per micro-batch (torch.stack of each weight, forward + backward) vs one grouped "
        "depth (forward + backward), CPU seconds, median of --reps"
    )
    print(
        f"{'shape':11s} {'L':>2s} {'D':>3s} {'tokens':>7s} {'stack ms':>9s} {'depth ms':>9s}"
        f" {'stack / (D depths)':>19s}"
    )
    for name in args.stacking_shapes.split(","):
        shape = dict(shapes[name])
        batch, seq = shape.pop("batch"), shape.pop("seq")
        plan = dict(kind="lol", num_blocks=shape.pop("num_blocks"), routed_depth=shape.pop("routed_depth"))
        cfg = config_from_dict({"model": dict(plan=plan, n_prelude=1, n_coda=1, **shape)}).model
        tconfig = transformer_config(cfg, num_layers=cfg.execution_plan().num_stored_blocks + 2)
        core = Core(cfg, core_config(tconfig, cfg), block_spec(False), first_layer_number=2, init_seed=1).train()
        blocks = [core.block(i) for i in range(cfg.plan.num_blocks)]
        t = batch * seq
        gen = torch.Generator().manual_seed(0)
        choice = torch.randint(0, cfg.plan.num_blocks, (t // cfg.plan.windows.size + 1,), generator=gen)
        token_window = torch.arange(t) // cfg.plan.windows.size
        grouping = group_tokens(choice.index_select(0, token_window), token_window, cfg.plan.num_blocks)
        mask = chunk_bias(grouping.segments, cfg.plan.windows.size, [0], [t])
        table = torch.randn(seq, 1, 1, cfg.hidden_size // cfg.num_attention_heads, generator=gen)
        rope = RowRope.from_table(table, (torch.arange(t) % seq).index_select(0, grouping.order), torch.float32)
        x0 = torch.randn(t, cfg.hidden_size, generator=gen)

        def stack():
            lib = stack_library(blocks)
            weights = [lib.norm1, lib.qkv, lib.proj, lib.norm2, lib.fc1, lib.fc2]
            torch.autograd.backward(weights, [torch.ones_like(w) for w in weights])

        lib_once = None

        def depth():
            nonlocal lib_once
            lib_once = stack_library(blocks) if lib_once is None else lib_once
            x = x0.clone().requires_grad_(True)
            out = grouped_blocks(lib_once, x, grouping, rope, mask, cfg.plan.windows.size)
            out.sum().backward(retain_graph=True)

        def timed(fn):
            fn()
            times = []
            for _ in range(max(1, args.reps)):
                t0 = time.process_time()
                fn()
                times.append(time.process_time() - t0)
            return 1e3 * statistics.median(times)

        s_ms, d_ms = timed(stack), timed(depth)
        share = s_ms / (cfg.plan.routed_depth * d_ms)
        print(
            f"{name:11s} {cfg.plan.num_blocks:2d} {cfg.plan.routed_depth:3d} {t:7d} "
            f"{s_ms:9.1f} {d_ms:9.1f} {share:19.2%}"
        )
    print(
        "the stacking cost is per micro-batch and does not depend on its tokens; a depth's cost grows with them "
        "(the paper's 360M micro-batch is 26 x 1,024 tokens: 26 times the tokens timed here)"
    )


def _expert_parallel_rank(rank: int, port: int, args, queue) -> None:
    """One of the two ranks of ``--what expert-parallel`` (gloo, EP = 2): its own tokens, half the library."""
    os.environ.update(
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE="2",
        LOCAL_WORLD_SIZE="2",
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
    )
    try:
        import warnings

        warnings.filterwarnings("ignore", category=UserWarning)
        torch.set_num_threads(max(1, args.threads))
        from megatron.core import parallel_state, tensor_parallel

        from megatron_lol.config.schema import ParallelConfig
        from megatron_lol.platform import init_distributed, setup_platform

        setup_platform()
        init_distributed()
        parallel_state.initialize_model_parallel(expert_model_parallel_size=2)
        tensor_parallel.model_parallel_cuda_manual_seed(1234)
        tokens, _, seeds = make_batch(args, seed=rank)
        rows = []
        for layout_name in args.layouts.split(","):
            for blocks in [int(x) for x in args.blocks.split(",")]:
                torch.manual_seed(0)
                net = build(args, blocks, layout_name == "packed", ParallelConfig(expert_model_parallel_size=2))
                layout = host_layout(args, net, tokens, seeds)
                for name, impl in (("core ref", "ref"), ("core grouped", "grouped")):
                    row = with_backend(False, lambda: count(core_runner(net, impl, layout, seeds, args)))
                    rows.append((layout_name, blocks, name, row))
        queue.put((rank, rows))
    except BaseException:  # noqa: BLE001 - the parent reports it
        import traceback

        queue.put((rank, traceback.format_exc()))


def measure_expert_parallel(args):
    """Counts of the core under expert parallelism (2 gloo processes, EP = 2): rank 0's rows."""
    import socket

    import torch.multiprocessing as mp

    if any(int(x) % 2 for x in args.blocks.split(",")):
        raise SystemExit(f"--what expert-parallel: --blocks {args.blocks} must be even (EP = 2 shards the library)")
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    procs = [ctx.Process(target=_expert_parallel_rank, args=(r, port, args, queue), daemon=True) for r in range(2)]
    for proc in procs:
        proc.start()
    results = dict(queue.get(timeout=1200) for _ in procs)
    for proc in procs:
        proc.join(timeout=60)
    for rank, result in sorted(results.items()):
        if isinstance(result, str):
            raise SystemExit(f"--what expert-parallel: rank {rank} failed:\n{result}")
    return results[0]


def print_expert_parallel(args, rows):
    print(
        f"expert parallelism, EP = 2 (2 gloo processes, each half of the library, its own {args.batch} x {args.seq} "
        f"tokens), the core's forward + backward on rank 0, D={args.depth}, width {args.hidden}; "
        f"counts with {BACKEND_ENV}=0"
    )
    print(
        f"{'layout':7s} {'L':>3s} {'path':14s} {'syncs fwd':>9s} {'syncs bwd':>9s} {'ops fwd':>8s} {'ops bwd':>8s}"
        f" {'syncs / depth':>13s}  syncs by op"
    )
    for layout_name, blocks, name, r in rows:
        names = ", ".join(f"{k} {v}" for k, v in sorted(r["sync_names"].items()))
        per_depth = (r["fwd_syncs"] + r["bwd_syncs"]) / args.depth
        print(
            f"{layout_name:7s} {blocks:>3d} {name:14s} {r['fwd_syncs']:9d} {r['bwd_syncs']:9d} {r['fwd_ops']:8d}"
            f" {r['bwd_ops']:8d} {per_depth:13.2f}  {names}"
        )


def main(argv=None) -> int:
    args = parse_args(argv)
    what = set(args.what.split(","))
    if what - {"counts", "stacking", "expert-parallel"}:
        raise SystemExit(f"--what {args.what}: takes counts, stacking, expert-parallel (comma-separated)")
    if "expert-parallel" in what:  # its own processes, before this one initialises megatron-core
        print_expert_parallel(args, measure_expert_parallel(args))
    if not what & {"counts", "stacking"}:
        return 0
    setup_megatron(args.threads)
    if "counts" in what:
        print_counts(args, *measure_counts(args))
    if "stacking" in what:
        measure_stacking(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
