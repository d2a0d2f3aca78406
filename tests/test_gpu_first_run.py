"""What the first GPU run needs, checked on the CPU (docs/gpu.md): precision defaults and what validation
refuses, FP8 recipes / row alignment / recomputation, fused dense attention, FP32 accumulation of library
gradients, start-up (NCCL device binding, LOCAL_RANK) and the proof script's wheelhouse.

Routing determinism: tests/test_routing_determinism.py; the two-process checks (routing agreement, overlapped
gradient reduction): tests/test_gpu_first_run_distributed.py; what needs a GPU: tests/test_gpu.py.
"""

from __future__ import annotations

import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
import torch

from megatron_lol.config import ConfigError, config_from_dict

REPO = Path(__file__).resolve().parent.parent
PAPER = sorted((REPO / "examples" / "configs" / "paper").glob("*.yaml"))
VOCAB, EOD = 97, 0
LOL = dict(hidden_size=64, num_attention_heads=4, num_blocks=4, routed_depth=4, window_size=8, window_shift=4)


@pytest.fixture
def fake_cuda(monkeypatch):
    """Validation as on a GPU machine with Transformer Engine (nothing here touches a device)."""
    monkeypatch.setattr("megatron_lol.platform.cuda_available", lambda: True)
    monkeypatch.setattr("megatron_lol.platform.has_transformer_engine", lambda: True)


# ---------------------------------------------------------------------------------------- precision
def test_params_dtype_auto_resolves_per_device(monkeypatch):
    cfg = config_from_dict({"model": dict(LOL)})
    assert cfg.model.precision.params_dtype == "fp32"  # CPU
    assert cfg.to_dict()["model"]["precision"]["params_dtype"] == "fp32"  # what run_config.yaml records
    monkeypatch.setattr("megatron_lol.platform.cuda_available", lambda: True)
    gpu = config_from_dict({"model": dict(LOL, use_transformer_engine=False)})
    assert gpu.model.precision.params_dtype == "bf16" and gpu.to_dict()["model"]["precision"]["params_dtype"] == "bf16"
    assert (
        config_from_dict(
            {"model": dict(LOL, params_dtype="fp32", use_transformer_engine=False)}
        ).model.precision.params_dtype
        == "fp32"
    )  # an explicit choice stays
    from megatron_lol.training.console import startup_line

    assert ", params bf16)" in startup_line(gpu, "c.yaml", 8)
    with pytest.raises(
        ConfigError, match=r"^model\.precision\.params_dtype: must be one of auto, fp32, bf16 \(got 'fp64'\)$"
    ):
        config_from_dict({"model": dict(LOL, params_dtype="fp64")})


def test_transformer_engine_spec_refuses_fp32_in_one_line(fake_cuda):
    for te in (True, None):  # asked for, or the default where TE imports
        with pytest.raises(ConfigError) as err:
            config_from_dict({"model": dict(LOL, params_dtype="fp32", use_transformer_engine=te)})
        message = str(err.value)
        assert "\n" not in message and message.startswith(
            "model.precision.params_dtype: fp32 under the Transformer Engine"
        )
        assert "no attention backend" in message and "use bf16 (or auto)" in message
    assert config_from_dict({"model": dict(LOL)}).model.precision.params_dtype == "bf16"  # auto under TE


@pytest.mark.parametrize("path", PAPER, ids=lambda p: p.stem)
def test_paper_configs_run_bf16_on_gpus_without_edits(fake_cuda, path):
    from megatron_lol.config import load_config

    cfg = load_config(path, check_data=False)
    assert cfg.model.precision.params_dtype == "bf16" and cfg.model.uses_transformer_engine()


def test_tf32_for_fp32_on_cuda_only(monkeypatch):
    from megatron_lol.model.precision import enable_tf32

    before = torch.get_float32_matmul_precision()
    try:
        torch.set_float32_matmul_precision("highest")
        assert not enable_tf32(torch.device("cpu"), "fp32")
        assert not enable_tf32(torch.device("cuda", 0), "bf16")
        assert torch.get_float32_matmul_precision() == "highest"
        assert enable_tf32(torch.device("cuda", 0), "fp32")
        assert torch.get_float32_matmul_precision() == "high"  # TF32 tensor-core matmuls
    finally:
        torch.set_float32_matmul_precision(before)


# --------------------------------------------------------------------------------------------- FP8
def test_fp8_recipes_for_plans_that_run_layers_repeatedly(fake_cuda):
    fp8 = dict(LOL, fp8="hybrid")
    training = {"seq_length": 64, "micro_batch_size": 2}
    assert config_from_dict({"model": fp8, "training": training}).model.precision.fp8_recipe == "tensorwise"
    dense = dict(plan="dense", core_layers=2, hidden_size=64, num_attention_heads=4, fp8="hybrid")
    assert (
        config_from_dict({"model": dense, "training": training}).model.precision.fp8_recipe == "delayed"
    )  # Megatron-LM's
    looped = dict(plan="looped", loop_layers=2, loop_count=2, hidden_size=64, num_attention_heads=4, fp8="e4m3")
    for model in (fp8, looped):
        with pytest.raises(ConfigError) as err:
            config_from_dict({"model": dict(model, fp8_recipe="delayed"), "training": training})
        assert str(err.value).startswith(
            "model.precision.fp8_recipe: delayed scaling needs every FP8 layer to run once per forward on every rank"
        ) and "\n" not in str(err.value)
    assert config_from_dict({"model": dict(dense, fp8_recipe="delayed"), "training": training})


def test_mxfp8_rows_align_to_32(fake_cuda, monkeypatch):
    from types import SimpleNamespace

    from megatron.core.fp8_utils import get_fp8_align_size

    from megatron_lol.config.schema import FP8_RECIPES, fp8_row_multiple
    from megatron_lol.model.precision import row_multiple

    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (10, 0))
    for recipe in FP8_RECIPES:  # validation's restatement is megatron-core's function; the model pads by it
        assert fp8_row_multiple(recipe) == get_fp8_align_size(recipe)
        assert row_multiple(SimpleNamespace(fp8="e4m3", fp8_recipe=recipe)) == get_fp8_align_size(recipe)
    assert row_multiple(SimpleNamespace(fp8="e4m3", fp8_recipe="mxfp8")) == 32
    assert row_multiple(SimpleNamespace(fp8=None, fp8_recipe="mxfp8")) == 1
    mx = dict(LOL, fp8="e4m3", fp8_recipe="mxfp8")
    with pytest.raises(
        ConfigError,
        match=r"^training\.seq_length: FP8 GEMMs \(mxfp8\) need micro_batch_size x "
        r"seq_length = 48 tokens in multiples of 32$",
    ):
        config_from_dict({"model": mx, "training": {"seq_length": 24, "micro_batch_size": 2}})
    assert config_from_dict({"model": mx, "training": {"seq_length": 32, "micro_batch_size": 2}})


def test_full_recompute_under_fp8_uses_transformer_engines_checkpoint(megatron_env, monkeypatch):
    """megatron-core's TransformerBlock recomputes FP8 layers with te_checkpoint; so does every LoL layer call
    (TE itself is absent here: its checkpoint is replaced by a recorder that runs megatron-core's)."""
    from megatron.core import tensor_parallel
    from megatron.core.extensions import transformer_engine as te_ext

    from megatron_lol.model.attention import SegmentMask
    from megatron_lol.model.block_call import call_block
    from megatron_lol.model.lol_model import LoLGPTModel

    calls = []

    def recorder(function, distribute, tracker, group, *args):
        calls.append((distribute, tracker is tensor_parallel.random.get_cuda_rng_tracker))
        return tensor_parallel.checkpoint(function, distribute, *args)

    monkeypatch.setattr(te_ext, "te_checkpoint", recorder)
    dense = dict(plan="dense", core_layers=1, hidden_size=64, num_attention_heads=4)
    net = LoLGPTModel(config_from_dict({"model": dense}).model, VOCAB, EOD).train()
    layer = net.core.block(0)
    x = torch.randn(6, 2, 64, requires_grad=True)
    rope = net.rotary(6)
    for fp8 in (None, "hybrid"):
        layer.config.fp8 = fp8
        out, _ = call_block(layer, x, SegmentMask(), rope, recompute=True)
        out.sum().backward()
    layer.config.fp8 = None
    assert calls == [(False, True)]  # only the FP8 call, with megatron's RNG tracker


# -------------------------------------------------------------------------------- fused attention
FUSED_CASES = {
    "dense-full": (dict(plan="dense", core_layers=2), False),
    "dense-sliding": (dict(plan="dense", core_layers=2, dense_attention="sliding"), False),
    "dense-strided": (dict(plan="dense", core_layers=2, dense_attention="strided"), False),
    "lol": (dict(plan="lol", num_blocks=3, routed_depth=3, film="depth"), False),
    "packed-lol": (dict(plan="lol", num_blocks=3, routed_depth=3), True),
    "packed-sliding": (dict(plan="dense", core_layers=2, dense_attention="sliding"), True),
}


def _grads_of(net, tokens, labels, fused):
    from megatron_lol.model.attention import SegmentCausalAttention

    saved = SegmentCausalAttention.fused
    SegmentCausalAttention.fused = fused
    try:
        loss = net(tokens, labels=labels, noise_seeds=torch.tensor([3, 4, 5]))
        loss.sum().backward()
    finally:
        SegmentCausalAttention.fused = saved
    grads = {n: p.grad.clone() for n, p in net.named_parameters() if p.grad is not None}
    net.zero_grad(set_to_none=True)
    return loss.detach(), grads


@pytest.mark.parametrize("case", list(FUSED_CASES))
def test_fused_attention_equals_the_explicit_path(megatron_env, case):
    """The GPU's attention algorithm (``SegmentCausalAttention.fused = True``: FlexAttention block masks,
    here run as the softmax under the mask their tables and ``mask_mod`` imply, since FlexAttention has no
    CPU backward) against the CPU's explicit algorithms, whole models: document, sliding, strided and
    routed-window masks, unpacked and packed, values and gradients."""
    from megatron_lol.model.lol_model import LoLGPTModel

    model, packed = FUSED_CASES[case]
    cfg = config_from_dict(
        {
            "model": dict(
                hidden_size=32, num_attention_heads=4, num_query_groups=2, window_size=8, window_shift=3, **model
            )
        }
    ).model
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(1, VOCAB, (3, 40), generator=g)
    tokens[0, 9] = tokens[1, 30] = tokens[2, 4] = EOD
    labels = torch.randint(1, VOCAB, (3, 40), generator=g)
    net = LoLGPTModel(cfg, VOCAB, EOD, init_seed=7, packed_sequences=packed).train()
    l0, g0 = _grads_of(net, tokens, labels, False)
    l1, g1 = _grads_of(net, tokens, labels, True)
    torch.testing.assert_close(l1, l0, rtol=1e-5, atol=1e-5)
    assert g0.keys() == g1.keys() and len(g0) > 8
    for name in g0:
        torch.testing.assert_close(g1[name], g0[name], rtol=1e-4, atol=1e-5, msg=name)


# ------------------------------------------------------------------------- FP32 gradient accumulation
def test_bf16_library_gradients_accumulate_in_fp32(megatron_env):
    """A block used at 16 depths: its fc1 weight gradient (fused accumulation into DDP's FP32 main_grad) against
    the float64 sum of the same 16 calls' gradients is at least as close as FP32 sums of the calls' BF16
    gradients, and closer than autograd's BF16 sum (the layer built without fused accumulation)."""
    from grad_accumulation_check import errors

    e = errors()
    print(
        f"fc1 weight gradient, relative error vs float64: fused FP32 {e['fused']:.2e}, FP32 sum of BF16 calls "
        f"{e['fp32_sum']:.2e}, BF16 sum (autograd) {e['bf16_sum']:.2e}"
    )
    assert e["calls"] == 16
    assert e["fused"] <= e["fp32_sum"] and e["fused"] < e["bf16_sum"] / 10
    # the norm weights (LocalRMSNorm) go the same way: equal to the unfused sum up to its BF16 rounding
    assert e["fused_norm"].dtype == torch.float32
    torch.testing.assert_close(e["fused_norm"], e["unfused_norm"], rtol=3e-2, atol=3e-2)
    assert not torch.equal(e["fused_norm"], e["unfused_norm"])


def test_bf16_library_gradients_of_the_grouped_core_accumulate_in_fp32(megatron_env):
    """The grouped core (the library stacked once per micro-batch) under fused accumulation: each depth's
    gradient of a block's weight goes into FP32 main_grad, so a block used at 16 depths is as close to the
    float64 sum as FP32 sums of the depths' BF16 gradients, and closer than autograd's BF16 sum over them."""
    from grad_accumulation_check import grouped_errors

    e = grouped_errors()
    print(
        f"grouped core, fc1 weight gradient, relative error vs float64: fused FP32 {e['fused']:.2e}, "
        f"FP32 sum of BF16 depths {e['fp32_sum']:.2e}, BF16 sum (autograd) {e['bf16_sum']:.2e}"
    )
    assert e["calls"] == 16
    assert e["fused"] <= 1.01 * e["fp32_sum"] and e["fused"] < e["bf16_sum"] / 3


# ---------------------------------------------------------------------------------------- start-up
def test_init_distributed_binds_nccl_to_the_local_gpu_and_needs_local_rank(monkeypatch):
    import torch.distributed as dist

    import megatron_lol.platform as plat
    from megatron_lol.errors import CliError

    seen = {}
    monkeypatch.setattr(dist, "is_initialized", lambda: False)
    monkeypatch.setattr(dist, "init_process_group", lambda **kw: seen.update(kw))
    monkeypatch.setattr(plat, "cuda_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "set_device", lambda d: seen.setdefault("current", d))
    env = {"RANK": "5", "WORLD_SIZE": "8", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "1"}
    with monkeypatch.context() as m:
        for k, v in env.items():
            m.setenv(k, v)
        m.delenv("LOCAL_RANK", raising=False)
        with pytest.raises(CliError, match=r"^LOCAL_RANK is not set, but RANK=5 is: launch with torchrun"):
            plat.init_distributed()
        m.setenv("LOCAL_RANK", "1")
        plat.init_distributed()
    assert seen["backend"] == "nccl" and seen["device_id"] == torch.device("cuda", 1)
    assert seen["current"] == torch.device("cuda", 1) and seen["rank"] == 5


def test_pinned_batches_keep_their_values(megatron_env):
    """Batches for a GPU are stacked into page-locked memory (a CPU build cannot pin: the platform's device
    mode makes the request a no-op here; tests/test_gpu.py checks ``is_pinned`` on a GPU)."""
    from megatron_lol.training.trainer import stack_batch

    rows = [torch.arange(5) + i for i in range(3)]
    assert torch.equal(stack_batch(rows, True), torch.stack(rows))
    assert torch.equal(stack_batch(rows, False), torch.stack(rows))


# ----------------------------------------------------------------------------------- the proof script
def test_step_timer_reads_cuda_events_once_after_the_steps():
    """Whole-step times from event pairs (what ``megatron-lol profile`` and the GPTModel baseline use on GPUs):
    recorded around each step, their elapsed times read only when asked, after the last step."""
    from megatron_lol.perf.timing import StepTimer

    clock, reads = [0.0], []

    class Event:
        def record(self):
            self.at = clock[0]

        def elapsed_time(self, end):
            reads.append(clock[0])
            return (end.at - self.at) * 1e3  # milliseconds, as CUDA events report

    timer = StepTimer(True, event=Event)
    for seconds in (0.5, 0.25):
        timer.start()
        clock[0] += seconds
        timer.stop()
        clock[0] += 1.0  # between steps: not counted
    assert reads == [] and timer.method == "cuda_events"
    assert timer.seconds() == pytest.approx([0.5, 0.25]) and len(reads) == 2
    wall = StepTimer(False)
    wall.start()
    wall.stop()
    assert wall.method == "wall_clock" and len(wall.seconds()) == 1


def test_wheelhouse_holds_what_the_profiled_configs_import():
    """Every distribution the proof script's runs need (megatron-lol's own requirements for Python 3.12, the
    profiled config's optimizer, the test runner) is in bench/gpu/wheelhouse.txt, the list build_wheelhouse.sh
    downloads, or is one the GPU machine provides."""
    sys.path.insert(0, str(REPO / "bench" / "gpu"))
    try:
        import run_all
    finally:
        sys.path.pop(0)
    listed = run_all.wheelhouse_list()
    assert "emerging-optimizers" in listed and "absl-py" in listed and "megatron-core" in listed
    assert "wheelhouse.txt" in (REPO / "bench" / "gpu" / "build_wheelhouse.sh").read_text()
    check = run_all.wheelhouse_check()
    assert check["missing"] == [] and check["configs"] == [run_all.LOL_CONFIG]
    assert {"emerging-optimizers", "absl-py"} <= set(check["needed"])


def test_wheelhouse_installs_without_ensurepip(tmp_path):
    """The proof script's fallback where ``python -m venv`` cannot bootstrap pip: the wheels are unpacked
    into a directory put on PYTHONPATH, and they import from there."""
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    with zipfile.ZipFile(wheels / "tinypkg-1.0-py3-none-any.whl", "w") as whl:
        whl.writestr("tinypkg/__init__.py", "VALUE = 42\n")
        whl.writestr("tinypkg-1.0.dist-info/METADATA", "Metadata-Version: 2.1\nName: tinypkg\nVersion: 1.0\n")
        whl.writestr("tinypkg-1.0.data/purelib/tinyextra.py", "EXTRA = 7\n")
    (tmp_path / "req.txt").write_text("tinypkg==1.0\n")
    site = tmp_path / "site"
    proc = subprocess.run(
        [
            sys.executable,
            str(REPO / "bench" / "gpu" / "install_wheelhouse.py"),
            "--wheels",
            str(wheels),
            "--requirements",
            str(tmp_path / "req.txt"),
            "--target",
            str(site),
            "--method",
            "unpack",
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip().splitlines()[-1] == f"PYTHONPATH={site}"
    out = subprocess.run(
        [sys.executable, "-c", "import tinypkg, tinyextra; print(tinypkg.VALUE + tinyextra.EXTRA)"],
        env=dict(os.environ, PYTHONPATH=str(site)),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.stdout.strip() == "49", out.stderr
    (tmp_path / "req.txt").write_text("tinypkg==1.0\nabsent-pkg==2.0\n")
    proc = subprocess.run(
        [
            sys.executable,
            str(REPO / "bench" / "gpu" / "install_wheelhouse.py"),
            "--wheels",
            str(wheels),
            "--requirements",
            str(tmp_path / "req.txt"),
            "--target",
            str(site),
            "--method",
            "unpack",
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 2 and "absent-pkg==2.0" in proc.stderr and "\n" not in proc.stderr.strip()
