"""The GPU path on a fake GPU: every plan's forward and backward, the packed (TE) layout, expert-parallel
dispatch and a trainer step, with parameters, inputs and collectives on ``fakegpu`` (see fake_gpu.py).

Run as a script (a fresh process: the fake backend must be registered before the first backward of the
process); prints one JSON object ``{case: {"ok": bool, ...}}``. tests/test_gpu_path.py asserts on it.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import traceback

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from fake_gpu import CpuTensorOnGpuPath, FakeGpuTensor, fake_gpu, fake_gpu_device, to_fake_gpu  # noqa: E402

VOCAB, EOD = 97, 0

PLANS = {
    "dense-full": dict(plan="dense", core_layers=2),
    "dense-sliding": dict(plan="dense", core_layers=2, dense_attention="sliding"),
    "dense-strided": dict(plan="dense", core_layers=2, dense_attention="strided"),
    "looped": dict(plan="looped", loop_layers=2, loop_count=2, film="depth", input_injection=True),
    "lol": dict(plan="lol", film="depth"),
    "lol-aux-moe": dict(
        plan="lol", film="depth_block", balancing="aux_loss", num_experts=4, moe_ffn_hidden_size=32, moe_layers="fixed"
    ),
    "foil": dict(
        plan="foil",
        foil_layers=2,
        foil_loops=2,
        num_experts=4,
        foil_experts=8,
        moe_ffn_hidden_size=32,
        moe_router_topk=2,
        moe_layers="all",
        untie_attention=True,
        moe_z_loss_coeff=1e-3,
    ),
    "accordion": dict(
        plan="accordion",
        loop_window=3,
        num_experts=4,
        moe_ffn_hidden_size=32,
        moe_router_topk=2,
        moe_layers="all",
        moe_shared_expert_intermediate_size=32,
        loop_budgets=[0, 1, 3],
        num_query_groups=2,
        kv_channels=16,
        second_pass_router="separate",
    ),
}
#: forward options per case: LoL runs grown to 2 of 3 depths with truncated backprop (k = 1)
FORWARD = {"lol": dict(depth=2, backprop_depth=1, record=True), "accordion": dict(budget=1)}


def model_config(**model):
    from megatron_lol.config import config_from_dict

    base = dict(hidden_size=32, num_attention_heads=4, window_size=8, window_shift=4, n_prelude=1, n_coda=1)
    base.update(model)
    if base.get("plan", "lol") == "lol":
        base.setdefault("num_blocks", 3)
        base.setdefault("routed_depth", 3)
    return config_from_dict({"model": base}).model


def batch(b: int = 2, s: int = 24):
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(1, VOCAB, (b, s), generator=g)
    tokens[0, 9] = EOD
    tokens[-1, s - 7] = EOD
    return tokens, torch.randint(1, VOCAB, (b, s), generator=g), torch.arange(11, 11 + b)


@contextlib.contextmanager
def attention_calls():
    """Record which attention kernel every call selects: ``F.scaled_dot_product_attention`` (whether with
    an explicit ``attn_mask`` or ``is_causal``), and FlexAttention (``flex_masks.flex_segment_attention``,
    whether its inputs and block mask are on the fake GPU), plus the host syncs of every block mask build
    (the dispatch counter). The calls then run as they would: SDPA on the tensors' values, FlexAttention,
    which cannot run on a ``fakegpu`` device, as ``flex_masks.masked_reference`` (the mask its tables imply)."""
    import torch.nn.functional as F

    from megatron_lol.model import flex_masks
    from megatron_lol.perf.op_count import OpCounter

    seen = {"sdpa_with_mask": 0, "sdpa_causal": 0, "sdpa_other": 0, "flex": 0, "flex_off_device": 0, "mask_syncs": 0}
    real_sdpa, real_flex, real_build = (
        F.scaled_dot_product_attention,
        flex_masks.flex_segment_attention,
        flex_masks.segment_block_mask,
    )

    def sdpa(query, key, value, attn_mask=None, *args, **kwargs):
        if attn_mask is not None:
            seen["sdpa_with_mask"] += 1
        elif kwargs.get("is_causal"):
            seen["sdpa_causal"] += 1
        else:
            seen["sdpa_other"] += 1
        return real_sdpa(query, key, value, attn_mask, *args, **kwargs)

    def flex(q, k, v, block_mask, scale):
        seen["flex"] += 1
        tensors = (q, k, v, block_mask.kv_num_blocks, block_mask.kv_indices, block_mask.full_kv_indices)
        seen["flex_off_device"] += sum(not isinstance(t, FakeGpuTensor) for t in tensors)
        return real_flex(q, k, v, block_mask, scale)

    def build(*args, **kwargs):
        with OpCounter() as count:
            mask = real_build(*args, **kwargs)
        seen["mask_syncs"] += count.syncs
        return mask

    F.scaled_dot_product_attention = sdpa
    flex_masks.flex_segment_attention, flex_masks.segment_block_mask = flex, build
    try:
        yield seen
    finally:
        F.scaled_dot_product_attention = real_sdpa
        flex_masks.flex_segment_attention, flex_masks.segment_block_mask = real_flex, real_build


def attention_dispatch() -> dict:
    """Every mask kind of tests/attention_cases.py with its inputs on the fake GPU, forward and backward
    under :func:`attention_calls`; the values and gradients of the same call on the CPU."""
    from attention_cases import inputs, make_cases, run_case

    out = {}
    for name, (layout, shape, _) in make_cases().items():
        q, k, v, up = inputs(shape)
        results = []
        for on_gpu in (False, True):
            context = fake_gpu() if on_gpu else contextlib.nullcontext(torch.device("cpu"))
            calls = attention_calls() if on_gpu else contextlib.nullcontext({})
            with context as dev, calls as seen:
                args = [t.to(dev).requires_grad_(True) for t in (q, k, v)]
                o = run_case(layout, *args, device=dev)
                grads = torch.autograd.grad(o, args, up.to(dev))
            results.append((o, grads))
        (ref, ref_grads), (o, grads) = results
        out[name] = {
            **seen,
            "on_gpu": isinstance(o, FakeGpuTensor) and all(isinstance(g, FakeGpuTensor) for g in grads),
            "diff": max(
                [float((o.elem - ref).abs().max())]
                + [float((g.elem - r).abs().max()) for g, r in zip(grads, ref_grads)]
            ),
        }
    return out


def run_plan(name: str, packed: bool = False, row_multiple: int = 1) -> dict:
    """Forward + backward on the fake GPU; the same on the CPU (a model built alike) for the values."""
    from megatron_lol.model.lol_model import LoLGPTModel

    cfg = model_config(**PLANS[name])
    tokens, labels, seeds = batch()
    fw = FORWARD.get(name, {})
    results = []
    for on_gpu in (False, True):
        net = LoLGPTModel(cfg, VOCAB, EOD, init_seed=1234, packed_sequences=packed).train()
        if net.core is not None:
            net.core.row_multiple = row_multiple
        context = fake_gpu() if on_gpu else contextlib.nullcontext(torch.device("cpu"))
        calls = attention_calls() if on_gpu else contextlib.nullcontext({})
        if on_gpu:
            to_fake_gpu(net)
        with context as dev, calls as seen:
            loss = net(tokens.to(dev), labels=labels.to(dev), noise_seeds=seeds.to(dev), **fw)
            loss.sum().backward()
        grads = {n: p.grad for n, p in net.named_parameters() if p.grad is not None}
        results.append((loss, grads))
    (ref, ref_grads), (loss, grads) = results
    return {
        "loss_on_gpu": isinstance(loss, FakeGpuTensor),
        "grads_on_gpu": all(isinstance(g, FakeGpuTensor) for g in grads.values()),
        "same_grads": sorted(grads) == sorted(ref_grads) and len(grads) > 5,
        "loss_diff": float((loss.elem - ref).abs().max()),
        "grad_diff": max(float((grads[n].elem - ref_grads[n]).abs().max()) for n in grads),
        "attention": seen,
    }


def grouped_core(expert_exchange: bool = False, per_block: bool = False) -> dict:
    """The routed core with the grouped executor (``per_block``: the per-block executor), host layout shipped
    to the device: forward and backward with the layout, parameters and states on the fake GPU; the values
    of the same run on the CPU.
    ``expert_exchange``: on the GPU the library counts as sharded over an expert-parallel group of one
    (the world), so every depth goes through the exchange of ``model/grouped_exchange.py`` with
    NCCL-strict collectives; the CPU run is the one without it."""
    import torch.distributed as dist

    from megatron_lol.model.core import ForcedPath
    from megatron_lol.model.host_layout import build_host_layout

    cfg = model_config(**PLANS["lol"], input_injection=True)
    tokens, _, seeds = batch()
    layout = build_host_layout(
        tokens, EOD, cfg.plan.windows.size, cfg.plan.windows.shift, [1, 2, 3], 3, seeds
    ).pin_memory()
    forced = ForcedPath(ids=torch.tensor([[-1, 2], [1, -1], [-1, -1]]), gates=torch.full((3, 2), 0.5))
    results = []
    from megatron_lol.model.executors import GroupedGEMMs, PerBlockCalls

    for on_gpu in (False, True):
        net = _train_model(cfg)
        net.core.executor = PerBlockCalls() if per_block else GroupedGEMMs()
        context = fake_gpu() if on_gpu else contextlib.nullcontext(torch.device("cpu"))
        collectives = contextlib.nullcontext([])
        calls = attention_calls() if on_gpu else contextlib.nullcontext({})
        if on_gpu:
            to_fake_gpu(net)
            if expert_exchange:
                net.core.expert_group = lambda: dist.group.WORLD
                collectives = strict_collectives()
        with context as dev, collectives as seen, calls as attention:
            x = torch.randn(24, 2, 32, generator=torch.Generator().manual_seed(1)).to(dev).requires_grad_(True)
            steps = net.core.plan.steps()
            on_dev = layout.to(dev)
            out = net.core(
                x,
                on_dev.document_layout(),
                net.rotary(24),
                steps,
                depth=3,
                forced_path=forced,
                backprop_depth=1,
                record=True,
                layout=on_dev,
            )
            (out.states.square().sum() + out.aux_loss).backward()
        grads = {n: p.grad for n, p in net.core.named_parameters() if p.grad is not None}
        results.append((out.states, x.grad, grads))
    (ref, ref_dx, ref_grads), (states, dx, grads) = results
    return {
        "collectives": sorted(set(seen)),
        "attention": attention,
        "on_gpu": isinstance(states, FakeGpuTensor)
        and isinstance(dx, FakeGpuTensor)
        and all(isinstance(g, FakeGpuTensor) for g in grads.values()),
        "same_grads": sorted(grads) == sorted(ref_grads) and len(grads) > 5,
        "diff": max(
            [float((states.elem - ref).abs().max()), float((dx.elem - ref_dx).abs().max())]
            + [float((grads[n].elem - ref_grads[n]).abs().max()) for n in grads]
        ),
    }


def _train_model(cfg):
    from megatron_lol.model.lol_model import LoLGPTModel

    return LoLGPTModel(cfg, VOCAB, EOD, init_seed=1234).train()


def planted_cpu_tensor() -> dict:
    """A window-mean buffer made without ``device=``: harmless on the CPU, caught on the (fake) GPU."""
    from megatron_lol.model import static_routing, windows
    from megatron_lol.model.lol_model import LoLGPTModel

    def planted(states, first_row, segment_length, max_length):
        sums = torch.zeros(segment_length.shape[0], states.shape[-1], dtype=torch.float32)  # on the CPU
        token_segment = torch.repeat_interleave(
            torch.arange(segment_length.shape[0], device=states.device), segment_length, output_size=states.shape[0]
        )
        sums.index_add_(0, token_segment, states.float())
        return sums / segment_length.unsqueeze(1).to(torch.float32)

    saved = (windows.segment_means, static_routing.segment_means)
    windows.segment_means = static_routing.segment_means = planted
    try:
        cfg = model_config(**PLANS["lol"])
        tokens, labels, seeds = batch()
        cpu = LoLGPTModel(cfg, VOCAB, EOD, init_seed=1234).train()
        cpu_ok = bool(torch.isfinite(cpu(tokens, labels=labels, noise_seeds=seeds)).all())
        net = to_fake_gpu(LoLGPTModel(cfg, VOCAB, EOD, init_seed=1234).train())
        error = None
        try:
            with fake_gpu() as dev:
                net(tokens.to(dev), labels=labels.to(dev), noise_seeds=seeds.to(dev))
        except CpuTensorOnGpuPath as err:
            error = str(err)
        return {"runs_on_cpu": cpu_ok, "caught": error is not None, "error": error}
    finally:
        windows.segment_means, static_routing.segment_means = saved


@contextlib.contextmanager
def strict_collectives():
    """``torch.distributed`` collectives that refuse CPU tensors (as NCCL does) and run gloo on the fake
    GPU tensors' values."""
    import torch.distributed as dist

    names = (
        "all_reduce",
        "all_gather",
        "all_to_all_single",
        "broadcast",
        "reduce_scatter_tensor",
        "all_gather_into_tensor",
        "_all_gather_base",
        "_reduce_scatter_base",
        "reduce_scatter",
    )
    saved = {n: getattr(dist, n) for n in names if hasattr(dist, n)}
    seen = []

    def strict(name, fn):
        def run(*args, **kwargs):
            def unwrap(t):
                if isinstance(t, (list, tuple)):
                    return type(t)(unwrap(x) for x in t)
                if isinstance(t, FakeGpuTensor):
                    return t.elem
                if torch.is_tensor(t):
                    raise CpuTensorOnGpuPath(
                        f"torch.distributed.{name}: a CPU tensor {tuple(t.shape)} (NCCL takes device tensors only)"
                    )
                return t

            seen.append(name)
            return fn(*unwrap(args), **{k: unwrap(v) for k, v in kwargs.items()})

        return run

    for n, fn in saved.items():
        setattr(dist, n, strict(n, fn))
    try:
        yield seen
    finally:
        for n, fn in saved.items():
            setattr(dist, n, fn)


def expert_parallel_dispatch() -> dict:
    """The per-block executor behind the expert-parallel exchange: collectives and index tensors on the
    device (EP group of one), the values of the CPU run."""
    return grouped_core(expert_exchange=True, per_block=True)


def trainer_step() -> dict:
    """Trainer.setup + two train steps on the fake GPU: the model moved before DDP, batches moved,
    loss / load / balancing reductions and DDP's gradient reduction through NCCL-strict collectives."""
    from megatron_lol.config import config_from_dict
    from megatron_lol.training.trainer import Trainer

    class Tokens:
        def __init__(self):
            g = torch.Generator().manual_seed(3)
            self.rows = torch.randint(1, VOCAB, (16, 33), generator=g)
            self.rows[:, 13] = EOD

        def __len__(self):
            return len(self.rows)

        def __getitem__(self, i):
            r = self.rows[i]
            return {"tokens": r[:-1], "labels": r[1:], "loss_mask": torch.ones(32)}

    class Tok:
        vocab_size, eod = VOCAB, EOD

    results = {}
    for name, model in (
        ("lol", dict(plan="lol", num_blocks=3, routed_depth=3, film="depth")),
        ("accordion", PLANS["accordion"]),
    ):
        base = dict(
            hidden_size=32, num_attention_heads=4, window_size=8, window_shift=4, n_prelude=1, n_coda=1, vocab_size=128
        )
        base.update(model)
        cfg = config_from_dict(
            {
                "model": base,
                "training": {
                    "train_iters": 2,
                    "micro_batch_size": 2,
                    "global_batch_size": 4,
                    "seq_length": 32,
                    "log_interval": 1,
                    "eval_interval": 100,
                    "eval_iters": 0,
                    "seed": 5,
                },
                "optimizer": {"lr": 1e-2},
            }
        )
        cpu = Trainer(cfg, tokenizer=Tok(), datasets=(Tokens(), None, None)).setup()
        data = cpu.data_iterator(cpu.train_ds, 0)
        cpu_steps = [cpu.train_step(data) for _ in range(2)]
        with fake_gpu(), strict_collectives() as seen:
            trainer = Trainer(cfg, tokenizer=Tok(), datasets=(Tokens(), None, None)).setup()
            on_gpu = all(isinstance(p, FakeGpuTensor) for p in trainer.model.parameters())
            data = trainer.data_iterator(trainer.train_ds, 0)
            steps = [trainer.train_step(data) for _ in range(2)]
            buffers = [b for b in trainer.model.buffers() if b.dim() > 0]
        results[name] = {
            "device": str(trainer.device),
            "params_on_gpu": on_gpu,
            "buffers_on_gpu": all(isinstance(b, FakeGpuTensor) for b in buffers),
            "losses": [s.loss for s in steps],
            "cpu_losses": [s.loss for s in cpu_steps],
            "grad_norms": [s.grad_norm for s in steps],
            "cpu_grad_norms": [s.grad_norm for s in cpu_steps],
            "collectives": sorted(set(seen)),
        }
    return results


def profile_host_syncs() -> dict:
    """``profile``'s counted steps on the fake GPU (dense, and LoL on the grouped core): reads of device
    values per step, CPU tensors (the data loader's, torch.optim's step counters) left out."""
    from megatron_lol.config import config_from_dict
    from megatron_lol.training.profile import build_trainer, profile_trainer

    out = {}
    for name, plan in (
        ("dense", dict(plan="dense", core_layers=2, dense_attention="full")),
        ("lol", dict(plan="lol", num_blocks=3, routed_depth=4, window_size=8, window_shift=4)),
    ):
        model = dict(hidden_size=32, num_attention_heads=4, ffn_hidden_size=64, n_prelude=1, n_coda=1, vocab_size=128)
        cfg = config_from_dict(
            {
                "model": {**model, **plan},
                "parallel": {"routed_core": "grouped" if name == "lol" else "auto"},
                "training": {"train_iters": 6, "micro_batch_size": 2, "global_batch_size": 4, "seq_length": 32},
                "optimizer": {"clip_grad": 1.0},
            }
        )
        with fake_gpu(), strict_collectives():
            trainer = build_trainer(cfg, synthetic=True)
            rep = profile_trainer(trainer, 1, 1, breakdown=False, count_steps=2, routing_steps=0)
        out[name] = {"device": str(trainer.device), **rep["host_syncs"]}
    return out


def main() -> int:
    torch.set_num_threads(1)
    fake_gpu_device()  # before any backward of the process (the autograd engine sizes its device queues once)
    from conftest import ensure_megatron

    ensure_megatron()
    cases = {name: (run_plan, (name,)) for name in PLANS}
    cases["packed-lol-fp8-rows"] = (run_plan, ("lol", True, 16))
    cases["packed-dense-sliding"] = (run_plan, ("dense-sliding", True))
    cases["packed-foil"] = (run_plan, ("foil", True))
    cases["grouped-core"] = (grouped_core, ())
    cases["grouped-core-expert-exchange"] = (grouped_core, (True,))
    cases["planted-cpu-tensor"] = (planted_cpu_tensor, ())
    cases["expert-parallel-dispatch"] = (expert_parallel_dispatch, ())
    cases["trainer"] = (trainer_step, ())
    cases["attention-dispatch"] = (attention_dispatch, ())
    cases["profile-host-syncs"] = (profile_host_syncs, ())
    from megatron.core.transformer.moe.moe_utils import MoEAuxLossAutoScaler

    only = set(sys.argv[1:])
    out = {}
    for name, (fn, args) in cases.items():
        if only and name not in only:
            continue
        # megatron-core's process-global MoE aux-loss scale: a backward outside its schedules (the plan
        # cases) leaves a 0-dim one that the schedule's set_loss_scale cannot copy its [1] into
        MoEAuxLossAutoScaler.main_loss_backward_scale = None
        try:
            out[name] = {"ok": True, **fn(*args)}
        except Exception as err:  # reported, asserted by the test
            out[name] = {
                "ok": False,
                "error": f"{type(err).__name__}: {str(err)[:300]}",
                "traceback": traceback.format_exc(limit=-12).split("Error: ")[0][-4000:],
            }
    print("FAKE_GPU_RESULTS " + json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
