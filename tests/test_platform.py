"""Tests for megatron_lol.platform (single process) and the multi-process
equivalence of megatron-core parallel layouts on CPU/gloo (see tests/distributed.py)."""

from __future__ import annotations

import subprocess
import sys
import threading
import types

import pytest
import torch

from megatron_lol import platform as plat


@pytest.fixture(scope="module")
def single_process():
    """setup_platform + a world-size-1 process group + TP=PP=1 parallel state."""
    kind = plat.setup_platform()
    plat.init_distributed()
    from megatron.core import parallel_state as ps

    ps.destroy_model_parallel()
    ps.initialize_model_parallel(1, 1)
    yield kind
    ps.destroy_model_parallel()


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
    """The silent failure (note item 2): fork() must really switch RNG streams."""
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
    from tiny_gpt import build_gpt, gpt_batch

    from megatron.core import tensor_parallel

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
