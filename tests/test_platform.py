"""Tests for megatron_lol.platform (single process) and the multi-process
equivalence of megatron-core parallel layouts on CPU/gloo (see tests/distributed.py)."""

from __future__ import annotations

import subprocess
import sys
import threading
import time
import types

import pytest
import torch
from distributed import model_parallel, run_distributed

from megatron_lol import platform as plat


@pytest.fixture(scope="module")
def single_process():
    """setup_platform + a world-size-1 process group + TP=PP=1 parallel state (left in place)."""
    kind = plat.setup_platform()
    plat.init_distributed()
    from megatron.core import parallel_state as ps

    # Shared with other test modules in the same session: initialise once, never tear down.
    if not ps.model_parallel_is_initialized():
        ps.initialize_model_parallel(1, 1)
    assert ps.get_tensor_model_parallel_world_size() == 1
    return kind


def test_import_is_cheap():
    code = "import sys, megatron_lol.platform; print(any(m.startswith('megatron.core') for m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_setup_platform_idempotent(single_process):
    kind = plat.setup_platform()
    assert kind == single_process
    assert kind == ("cuda" if torch.cuda.is_available() else "cpu")
    before = plat.applied_patches()
    assert plat.setup_platform() == kind
    assert plat.applied_patches() == before
    assert plat.device().type == kind
    if kind == "cpu":
        assert not plat.has_transformer_engine()
        for name in ("cuda_device_api", "cuda_rng", "moe_split_sizes", "gloo_batched_p2p", "cuda_tensors"):
            assert name in before


def test_cpu_emulation_is_installed_in_one_place_and_listed_with_why(single_process):
    """Every CPU-only patch is in cpu_patches.CPU_PATCHES, named in its docstring's table, and its install
    function is called from nowhere else in the package (the model never installs or asks for one)."""
    from pathlib import Path

    from megatron_lol.platform import cpu_patches

    doc = cpu_patches.__doc__
    pkg = Path(plat.__file__).resolve().parents[1]
    for patch in cpu_patches.CPU_PATCHES:
        assert f"``{patch.name}``" in doc and patch.why, patch.name
        callers = [
            p.relative_to(pkg).as_posix()
            for p in pkg.rglob("*.py")
            if f"{patch.install.__name__}(" in p.read_text() and p.name != "cpu_patches.py"
        ]
        # the defining module (def line) and, for the device mode, the re-entry of setup_platform in a new thread
        assert set(callers) <= {f"platform/{patch.install.__module__.rsplit('.', 1)[1]}.py", "platform/__init__.py"}
    if single_process == "cpu":
        t = torch.ones(2)
        assert t.cuda() is t and torch.zeros(1, device="cuda").device.type == "cpu"
        marked = [p.name for p in cpu_patches.CPU_PATCHES if p.name != "cuda_device_mode"]
        assert set(marked) <= set(plat.applied_patches())


def test_gradient_norm_stand_in_equals_megatron_core_and_reads_nothing_back(single_process, monkeypatch):
    """Without TE's or apex's multi-tensor kernels, megatron-core's clipping computes the gradient norm with
    ``local_multi_tensor_l2_norm`` (one host read per parameter); setup_platform puts the ``_foreach_norm``
    stand-in in its place: the same norm within FP32 rounding, over the gradients clip_grads keeps of
    TP-sharded, TP-duplicated and shared parameters, reduced over the ranks by megatron-core as before."""
    from megatron.core import tensor_parallel, utils
    from megatron.core.optimizer import clip_grads
    from megatron.core.transformer.module import param_is_not_shared

    from megatron_lol.perf.op_count import OpCounter
    from megatron_lol.platform.no_te import foreach_l2_norm

    if not (plat.has_transformer_engine() or plat.has_apex()):  # their fused kernels are used where they import
        assert clip_grads.l2_norm_impl is foreach_l2_norm
        assert "grad_norm_without_host_reads" in plat.applied_patches()
    g = torch.Generator().manual_seed(0)
    params = []
    for shape, kind in (((64, 32), "tp"), ((32,), "dup"), ((128, 16), "tp"), ((7, 3, 5), "dup"), ((32, 32), "shared")):
        p = torch.nn.Parameter(torch.empty(shape))
        p.grad = torch.randn(shape, generator=g) * torch.rand(1, generator=g).item() * 10
        if kind == "tp":
            tensor_parallel.set_tensor_model_parallel_attributes(p, True, 0, 1)
        p.shared = kind == "shared"
        params.append((p, kind))

    def kept(tp_rank: int) -> list:  # what MegatronOptimizer.get_main_grads_for_grad_norm keeps on a TP rank
        group = types.SimpleNamespace(rank=lambda: tp_rank)
        return [
            p.grad
            for p, _ in params
            if param_is_not_shared(p) and tensor_parallel.param_is_not_tensor_parallel_duplicate(p, group)
        ]

    assert len(kept(0)) == 4 and len(kept(1)) == 2  # the duplicates count on TP rank 0 only
    for grads in (kept(0), kept(1)):
        flag = torch.zeros(1, dtype=torch.int)
        with OpCounter() as theirs:
            ref, _ = utils.local_multi_tensor_l2_norm(2048 * 32, flag, [grads], False)
        with OpCounter() as ours:
            out, none = foreach_l2_norm(2048 * 32, flag, [grads], False)
        assert none is None and out.shape == (1,) and out.dtype == torch.float32
        assert out.item() == pytest.approx(ref.item(), rel=2e-7)
        assert ours.syncs == 0, ours.sync_names
        assert theirs.sync_names["tensor (from tensors)"] == len(grads)  # one read per parameter
        # megatron-core's get_grad_norm_fp32, reduction over the (world) group included, with either norm
        total = clip_grads.get_grad_norm_fp32(grads, grad_stats_parallel_group=torch.distributed.group.WORLD)
        monkeypatch.setattr(clip_grads, "l2_norm_impl", utils.local_multi_tensor_l2_norm)
        total_ref = clip_grads.get_grad_norm_fp32(grads, grad_stats_parallel_group=torch.distributed.group.WORLD)
        monkeypatch.setattr(clip_grads, "l2_norm_impl", foreach_l2_norm)
        exact = torch.linalg.vector_norm(torch.cat([t.double().reshape(-1) for t in grads])).item()
        assert total == pytest.approx(total_ref, rel=2e-7) and total == pytest.approx(exact, rel=1e-6)


def test_init_distributed_idempotent(single_process):
    import torch.distributed as dist

    assert dist.is_initialized()
    plat.init_distributed()
    assert dist.get_world_size() >= 1


def test_require_fails_loudly():
    fake = types.ModuleType("megatron.core.fake_module")
    with pytest.raises(plat.PlatformPatchError, match=r"megatron\.core\.fake_module\._moved_name.*0\.16\.1"):
        plat._require(fake, "_moved_name", "some_patch")


@pytest.mark.skipif(torch.cuda.is_available(), reason="CPU patches only")
def test_cuda_api_on_cpu(single_process):
    x = torch.zeros(3, device="cuda")
    assert x.device.type == "cpu"
    y = torch.empty(2, device=torch.cuda.current_device())
    assert y.device.type == "cpu"
    assert x.to("cuda").device.type == "cpu"
    assert x.cuda() is x
    assert x.type() == "torch.cuda.FloatTensor"
    assert x.half().type() == "torch.cuda.HalfTensor"
    torch.cuda.synchronize()
    s = torch.cuda.Stream()
    with torch.cuda.stream(s):
        torch.cuda.current_stream().wait_stream(s)
    e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    e0.record()
    e1.record()
    assert e0.elapsed_time(e1) >= 0
    x.record_stream(torch.cuda.current_stream())
    torch.cuda.nvtx.range_push("x")
    torch.cuda.nvtx.range_pop()

    # The device mode is thread-local: a new thread needs cpu_device_mode().
    box = {}

    def worker():
        try:
            torch.zeros(1, device="cuda")
            box["bare"] = "ok"
        except Exception as exc:  # noqa: BLE001
            box["bare"] = type(exc).__name__
        with plat.cpu_device_mode():
            box["mode"] = torch.zeros(1, device="cuda").device.type

    t = threading.Thread(target=worker)
    t.start()
    t.join()
    assert box["bare"] != "ok"
    assert box["mode"] == "cpu"


def test_rng_tracker_fork_switches_streams(single_process):
    """The silent failure of platform patch 2 (CUDA RNG): fork() must really switch RNG streams."""
    from megatron.core import tensor_parallel

    seed = 1234
    tensor_parallel.model_parallel_cuda_manual_seed(seed)
    tracker = tensor_parallel.get_cuda_rng_tracker()
    default_state = torch.cuda.get_rng_state().clone()

    with tracker.fork():
        a = torch.rand(8, device=plat.device())
    assert torch.equal(torch.cuda.get_rng_state(), default_state), "default stream not restored"
    with tracker.fork():
        b = torch.rand(8, device=plat.device())
    assert torch.equal(torch.cuda.get_rng_state(), default_state), "default stream not restored"
    assert not torch.equal(a, b), "two forks gave the same numbers: the tracker state did not advance"

    # The first fork drew from the model-parallel stream: seed + 2718 + tp_rank.
    if not torch.cuda.is_available():
        expected = torch.rand(8, generator=torch.Generator().manual_seed(seed + 2718))
        assert torch.equal(a, expected)
    # And the default stream is untouched by the forks.
    c = torch.rand(8, device=plat.device())
    torch.cuda.set_rng_state(default_state)
    assert torch.equal(c, torch.rand(8, device=plat.device()))
    assert not torch.equal(c, a)

    # Named streams differ from one another.
    with tracker.fork(tensor_parallel.random.get_data_parallel_rng_tracker_name()):
        d = torch.rand(8, device=plat.device())
    assert not torch.equal(d, a) and not torch.equal(d, b)


def test_gpt_forward_backward(single_process):
    from megatron.core import tensor_parallel
    from tiny_gpt import build_gpt, gpt_batch

    tensor_parallel.model_parallel_cuda_manual_seed(7)
    model = build_gpt(dropout=0.1)
    model.train()
    tokens, position_ids, labels = gpt_batch(batch=2, seq=16, vocab=64, seed=0)
    losses = model(tokens.to(plat.device()), position_ids.to(plat.device()), None, labels=labels.to(plat.device()))
    assert losses.shape == (2, 16)
    loss = losses.float().mean()
    assert torch.isfinite(loss)
    loss.backward()
    grads = [p.grad for p in model.parameters() if p.requires_grad]
    assert grads and all(g is not None and torch.isfinite(g).all() for g in grads)
    assert sum(float(g.norm()) for g in grads) > 0


# ---------------------------------------------------------------------------
# Parallel layouts vs one process, in one 2-process gloo launch.
#
# TP=2, TP=2+SP, PP=2 (1F1B) and PP=2+VPP=2 (interleaved) run the same tiny
# GPTModel as the reference without model parallelism. Weights are identical in
# every layout (tiny_gpt.deterministic_init), so losses must agree to float32
# round-off; PP=2+VPP=2 also catches the silent gloo batched-p2p cross-matching
# (platform patch 4): without it the grad norm^2 is 226 instead of 1.57.
# ---------------------------------------------------------------------------

NUM_MICROBATCHES = 4
MICRO_BATCH = 2

LAYOUTS = {
    "tp2": dict(tp=2),
    "tp2_sp": dict(tp=2, sp=True),
    "pp2": dict(pp=2),
    "pp2_vpp2": dict(pp=2, vpp=2),
}


def _microbatches():
    from tiny_gpt import gpt_batch

    return [gpt_batch(batch=MICRO_BATCH, seed=100 + i) for i in range(NUM_MICROBATCHES)]


def _run_layout(tp=1, pp=1, vpp=None, sp=False):
    """One forward/backward step of the tiny GPT in the current layout.

    Returns (mean microbatch loss or None if this rank is not a last stage,
    squared grad norm of this rank's share of the model)."""
    import torch
    from megatron.core import parallel_state as ps
    from megatron.core.pipeline_parallel import get_forward_backward_func
    from tiny_gpt import SEQ, build_gpt, deterministic_init, gpt_config

    from megatron_lol.platform import device

    extra = {}
    if vpp:
        extra["virtual_pipeline_model_parallel_size"] = vpp
    cfg = gpt_config(
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp,
        sequence_parallel=sp,
        **extra,
    )
    chunks = []
    for vp_stage in range(vpp or 1):
        stage = vp_stage if vpp else None
        m = build_gpt(
            cfg,
            pre_process=ps.is_pipeline_first_stage(ignore_virtual=False, vp_stage=stage),
            post_process=ps.is_pipeline_last_stage(ignore_virtual=False, vp_stage=stage),
            vp_stage=stage,
        )
        deterministic_init(m, seed=0)
        m.to(device())
        chunks.append(m)

    def forward_step(data_iterator, model):
        tokens, position_ids, labels = (t.to(device()) for t in next(data_iterator))
        out = model(tokens, position_ids, None, labels=labels)

        def loss_func(output_tensor):
            loss = output_tensor.float().mean()
            return loss, {"lm loss": loss.detach().clone()}

        return out, loss_func

    mbs = _microbatches()
    data = [iter(mbs) for _ in chunks] if vpp else iter(mbs)
    fwd_bwd = get_forward_backward_func()
    losses = fwd_bwd(
        forward_step_func=forward_step,
        data_iterator=data,
        model=chunks if vpp else chunks[0],
        num_microbatches=NUM_MICROBATCHES,
        seq_length=SEQ,
        micro_batch_size=MICRO_BATCH,
        forward_only=False,
    )
    loss = None
    if ps.is_pipeline_last_stage(ignore_virtual=True):
        loss = float(torch.stack([d["lm loss"] for d in losses]).mean())

    # Squared grad norm of the whole model, counting each parameter once.
    tp_group = ps.get_tensor_model_parallel_group()
    tp_rank = ps.get_tensor_model_parallel_rank()
    sq = torch.zeros((), dtype=torch.float64)
    for m in chunks:
        for p in m.parameters():
            g = p.grad
            assert g is not None
            g = g.double()
            if getattr(p, "sequence_parallel", False) and tp > 1:
                g = g.clone()
                torch.distributed.all_reduce(g, group=tp_group)
            if getattr(p, "tensor_model_parallel", False) or tp_rank == 0:
                sq += (g * g).sum()
    return loss, float(sq)


def _layouts_check():
    """Runs on every rank: the reference (no model parallelism) then each layout."""
    import torch

    results = {}
    timings = {}
    with model_parallel(tp=1, pp=1, seed=1):
        t = time.perf_counter()
        results["ref"] = _run_layout()
        timings["ref"] = time.perf_counter() - t
    for name, layout in LAYOUTS.items():
        kw = dict(layout)
        sp = kw.pop("sp", False)
        with model_parallel(seed=1, **kw):
            t = time.perf_counter()
            loss, sq = _run_layout(sp=sp, **kw)
            # Model-parallel group == world here (DP=1): sum the grad shares.
            sq_t = torch.tensor(sq, dtype=torch.float64)
            torch.distributed.all_reduce(sq_t)
            results[name] = (loss, float(sq_t))
            timings[name] = time.perf_counter() - t
    return results, timings


@pytest.mark.slow
@pytest.mark.multiprocess
def test_layouts_match_single_process():
    t0 = time.perf_counter()
    per_rank = run_distributed(_layouts_check, 2, timeout=150)
    elapsed = time.perf_counter() - t0
    ref_loss, ref_sq = per_rank[0][0]["ref"]
    assert per_rank[1][0]["ref"][0] == pytest.approx(ref_loss, rel=1e-6)
    failures = []
    for name in LAYOUTS:
        losses = [r[0][name][0] for r in per_rank if r[0][name][0] is not None]
        assert losses, f"{name}: no rank reported a loss"
        sq = per_rank[0][0][name][1]
        for loss in losses:
            if abs(loss - ref_loss) > 1e-5 * abs(ref_loss):
                failures.append(f"{name}: loss {loss!r} vs single process {ref_loss!r}")
        if abs(sq - ref_sq) > 1e-4 * abs(ref_sq):
            failures.append(f"{name}: grad norm^2 {sq!r} vs single process {ref_sq!r}")
    timings = per_rank[0][1]
    print(f"2-process launch: {elapsed:.1f}s; per layout: " + ", ".join(f"{k} {v:.2f}s" for k, v in timings.items()))
    assert not failures, "\n".join(failures)


# ---------------------------------------------------------------------------
# Item 6b: distributed-optimizer checkpoint with the torch Adam fallback.
# ---------------------------------------------------------------------------


def _dist_opt_model():
    from megatron.core import tensor_parallel
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from tiny_gpt import build_gpt, deterministic_init, gpt_config

    tensor_parallel.model_parallel_cuda_manual_seed(1)
    cfg = gpt_config(num_layers=2)
    model = build_gpt(cfg)
    deterministic_init(model)
    ddp = DistributedDataParallel(
        cfg, DistributedDataParallelConfig(use_distributed_optimizer=True, grad_reduce_in_fp32=True), model
    )
    opt = get_megatron_optimizer(
        OptimizerConfig(optimizer="adam", lr=1e-2, weight_decay=0.1, use_distributed_optimizer=True), [ddp]
    )
    return model, ddp, opt


def _train_step(ddp, opt, i):
    from tiny_gpt import gpt_batch

    ddp.zero_grad_buffer()
    opt.zero_grad()
    tokens, position_ids, labels = gpt_batch(seed=i)
    loss = ddp(tokens, position_ids, None, labels=labels).float().mean()
    loss.backward()
    ddp.finish_grad_sync()
    opt.step()
    return float(loss)


@pytest.mark.skipif(plat.has_apex(), reason="torch Adam fallback only")
@pytest.mark.parametrize("sharding", ["fully_reshardable", "dp_reshardable"])
@pytest.mark.multiprocess
def test_distrib_optimizer_checkpoint_resumes_adam_step(single_process, tmp_path, sharding):
    from megatron.core import dist_checkpointing

    _, ddp, opt = _dist_opt_model()
    uninterrupted = [_train_step(ddp, opt, i) for i in range(4)]

    model, ddp, opt = _dist_opt_model()
    for i in range(2):
        _train_step(ddp, opt, i)
    md = {"distrib_optim_sharding_type": sharding}
    sd = {"model": model.sharded_state_dict()}
    sd["optimizer"] = opt.sharded_state_dict(sd["model"], metadata=md)
    dist_checkpointing.save(sd, str(tmp_path))

    model, ddp, opt = _dist_opt_model()
    sd = {"model": model.sharded_state_dict()}
    sd["optimizer"] = opt.sharded_state_dict(sd["model"], is_loading=True, metadata=md)
    loaded = dist_checkpointing.load(sd, str(tmp_path))
    model.load_state_dict(loaded["model"])
    opt.load_state_dict(loaded["optimizer"])
    inner = [o.optimizer for o in getattr(opt, "chained_optimizers", [opt])]
    steps = [s["step"] for o in inner for s in o.state.values()]
    assert steps and all(float(s) == 2.0 for s in steps)
    assert len({id(s) for s in steps}) == len(steps), "parameters share one step tensor"
    resumed = [_train_step(ddp, opt, i) for i in range(2, 4)]
    assert resumed == uninterrupted[2:]


def _fail_on_rank_one():
    import torch.distributed as dist

    if dist.get_rank() == 1:
        raise ValueError("boom on rank one")
    return dist.get_rank()


@pytest.mark.slow
@pytest.mark.multiprocess
def test_run_distributed_reports_failing_rank():
    from distributed import DistributedTestError

    with pytest.raises(DistributedTestError, match="boom on rank one") as info:
        run_distributed(_fail_on_rank_one, 2, timeout=120)
    assert info.value.rank == 1
    assert "ValueError" in info.value.remote_traceback


def test_moe_aux_loss_scale_survives_a_backward_outside_the_schedules(single_process):
    """A MoE backward outside megatron's schedules (a plain ``loss.backward()``) leaves a 0-dim
    aux-loss scale; the schedules' ``[1]`` scale must still be settable afterwards."""
    from megatron.core.transformer.moe.moe_utils import MoEAuxLossAutoScaler

    saved = MoEAuxLossAutoScaler.main_loss_backward_scale
    try:
        MoEAuxLossAutoScaler.main_loss_backward_scale = None
        x = torch.ones(2, requires_grad=True)
        MoEAuxLossAutoScaler.apply(x, torch.tensor(0.5, requires_grad=True)).sum().backward()
        assert MoEAuxLossAutoScaler.main_loss_backward_scale.shape == ()  # megatron-core's own default
        MoEAuxLossAutoScaler.set_loss_scale(torch.ones(1) / 4)  # what the schedules do
        assert MoEAuxLossAutoScaler.main_loss_backward_scale.tolist() == [0.25]
        MoEAuxLossAutoScaler.set_loss_scale(torch.ones(1) / 2)
        assert MoEAuxLossAutoScaler.main_loss_backward_scale.tolist() == [0.5]
    finally:
        MoEAuxLossAutoScaler.main_loss_backward_scale = saved
