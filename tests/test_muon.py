"""Muon for the block matrices, AdamW for the rest, through megatron-core's optimizer.

* which parameters get Muon and which AdamW, by name, for LoL, Foil, Accordion
  and dense, and that megatron-core's built optimizer holds exactly those
  (one training step of each);
* megatron-core's ``TensorParallelMuon`` (run with the installed
  emerging-optimizers through ``muon_compat``) performs its definition, also
  for a zero gradient (a block unused at a step), and in the trainer under the
  growing depth;
* parallel layouts equal one process: TP=2 ``duplicated`` within 1e-4 relative
  loss over 3 steps at megatron-core's default Newton-Schulz precision
  (``medium`` = bf16 matmuls); at ``highest`` precision every layout
  (``duplicated``, ``distributed``, TP+SP, EP=2 of the library, PP=2, DP=2,
  DP=2 with the layer-wise distributed optimizer, Foil EP=2) within 1e-6;
  ``blockwise`` orthogonalises each TP shard on its own, a different update:
  measured 2.4e-3 relative after 3 steps, asserted below 1e-2;
* kill -9 and resume with Muon state is bit-identical; a 1-process checkpoint
  resumes at TP=2 (optimizer state resharded); a DP=2 checkpoint of the
  layer-wise distributed optimizer resumes on one process;
* one-line errors (bad values, missing package, a checkpoint of another
  optimizer); the benchmark runs.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from distributed import run_distributed
from test_parallel_lol import SEQ, SyntheticTokens, TinyTokenizer

REPO = Path(__file__).resolve().parents[1]
MODEL = dict(
    hidden_size=32,
    num_attention_heads=4,
    ffn_hidden_size=64,
    n_prelude=1,
    n_coda=1,
    num_blocks=3,
    routed_depth=4,
    window_size=8,
    window_shift=4,
    vocab_size=128,
)
PLANS = {
    "lol": dict(film="depth", input_injection=True, moe_layers="fixed", num_experts=4, moe_ffn_hidden_size=32),
    "dense": dict(plan="dense"),
    "foil": dict(
        plan="looped",
        num_blocks=1,
        routed_depth=2,
        untie_attention=True,
        moe_layers="all",
        num_experts=4,
        moe_ffn_hidden_size=32,
    ),
    "accordion": dict(
        plan="accordion",
        num_blocks=2,
        loop_budgets=[0, 1, 2],
        num_query_groups=2,
        moe_layers="all",
        num_experts=4,
        moe_ffn_hidden_size=16,
        moe_shared_expert_intermediate_size=16,
        second_pass_router="separate",
    ),
}
# the hidden matrices, written out independently of megatron_lol.training.optimizer's rule
HIDDEN_MATRIX = re.compile(
    r"(prelude|coda|core\.blocks|core\.pass_attention)\.\w+\."
    r"(self_attention\.linear_(qkv|proj)|mlp\.(linear_fc[12]|experts\.local_experts\.\d+\.linear_fc[12]"
    r"|shared_experts\.linear_fc[12]))\.weight"
)
MUST_BE_MUON = {
    "lol": [
        "core.blocks.0.self_attention.linear_qkv.weight",
        "core.blocks.2.mlp.linear_fc2.weight",
        "prelude.0.self_attention.linear_proj.weight",
        "prelude.0.mlp.experts.local_experts.3.linear_fc1.weight",
        "coda.0.mlp.experts.local_experts.0.linear_fc2.weight",
    ],
    "dense": ["core.blocks.1.mlp.linear_fc1.weight", "prelude.0.mlp.linear_fc1.weight", "coda.0.mlp.linear_fc2.weight"],
    "foil": [
        "core.blocks.0.mlp.experts.local_experts.1.linear_fc1.weight",
        "core.pass_attention.0_1.self_attention.linear_qkv.weight",
    ],
    "accordion": [
        "core.blocks.1.mlp.shared_experts.linear_fc1.weight",
        "prelude.0.mlp.shared_experts.linear_fc2.weight",
        "core.blocks.0.mlp.experts.local_experts.2.linear_fc2.weight",
    ],
}
MUST_BE_ADAMW = {
    "lol": [
        "embedding.word_embeddings.weight",
        "output_layer.weight",
        "final_norm.weight",
        "core.blocks.0.input_layernorm.weight",
        "core.depth_vectors",
        "core.routers.0.logits.weight",
        "core.routers.0.logits.bias",
        "core.routers.0.noise_scale.weight",
        "core.film_gamma",
        "core.film_beta",
        "core.injection_logit",
        "prelude.0.mlp.router.weight",
    ],
    "dense": ["embedding.word_embeddings.weight", "output_layer.weight", "core.blocks.0.pre_mlp_layernorm.weight"],
    "foil": ["core.blocks.0.mlp.router.weight", "core.pass_attention.0_1.input_layernorm.weight"],
    "accordion": ["core.loop_gates", "core.second_pass_routers.0.weight", "core.blocks.0.mlp.router.weight"],
}


def _config(model: dict, parallel: dict = None, **optimizer):
    from megatron_lol.config import config_from_dict

    return config_from_dict(
        {
            "model": dict(MODEL, **model),
            "parallel": parallel or {},
            "training": {
                "train_iters": 3,
                "micro_batch_size": 1,
                "global_batch_size": 2,
                "seq_length": SEQ,
                "log_interval": 100,
                "eval_interval": 100,
                "eval_iters": 0,
                "seed": 7,
            },
            "optimizer": dict({"name": "muon", "lr": 1e-2, "min_lr": 1e-3, "lr_warmup_iters": 0}, **optimizer),
        }
    )


def _trainer(cfg):
    from megatron_lol.training.trainer import Trainer

    return Trainer(cfg, tokenizer=TinyTokenizer(), datasets=(SyntheticTokens(16, 0), None, None)).setup()


# ------------------------------------------------------------------ which parameters get Muon
@pytest.mark.parametrize("plan", sorted(PLANS))
def test_parameter_split_by_name_and_in_the_built_optimizer(megatron_env, plan):
    from megatron_lol.training.optimizer import muon_parameters, split_parameters

    trainer = _trainer(_config(PLANS[plan], muon_fp32_matmul_prec="highest"))
    model = trainer.model
    muon, adamw = split_parameters(model)
    names = [n for n, p in model.named_parameters()]
    assert sorted(muon + adamw) == sorted(names)
    assert set(muon) == {n for n in names if HIDDEN_MATRIX.fullmatch(n)}, plan
    assert set(MUST_BE_MUON[plan]) <= set(muon) and set(MUST_BE_ADAMW[plan]) <= set(adamw)
    assert all(
        n.endswith((".bias", "norm.weight"))
        or n in MUST_BE_ADAMW[plan]
        or "router" in n
        or n in ("embedding.word_embeddings.weight", "output_layer.weight")
        for n in adamw
    ), adamw
    # megatron-core's optimizer holds exactly these: Muon for the matrices, its AdamW for the rest
    by_name = dict(model.named_parameters())
    held_by_muon = {id(p) for p in muon_parameters(trainer.optimizer)}
    assert held_by_muon == {id(by_name[n]) for n in muon}
    adam = [
        sub.optimizer for sub in trainer.optimizer.chained_optimizers if isinstance(sub.optimizer, torch.optim.AdamW)
    ]
    assert {id(p) for opt in adam for g in opt.param_groups for p in g["params"]} == {id(by_name[n]) for n in adamw}
    # the temporary AdamW marking that steers megatron-core's split is removed after the build
    assert not any(
        getattr(by_name[n], "is_embedding_or_output_parameter", False)
        for n in names
        if n not in ("embedding.word_embeddings.weight", "output_layer.weight")
    )
    # one step trains every part (experts under Muon included)
    before = {n: p.detach().clone() for n, p in by_name.items()}
    res = trainer.train_step(trainer.data_iterator(trainer.train_ds, 0))
    assert res.loss > 0 and not res.skipped
    moved = {n for n, p in by_name.items() if not torch.equal(p.detach(), before[n])}
    assert set(MUST_BE_MUON[plan]) <= moved


def test_muon_learning_rate_split_and_adam_unchanged(megatron_env):
    cfg = _config({}, muon_adam_lr=2e-3, muon_adam_min_lr=1e-4)
    trainer = _trainer(cfg)
    from megatron_lol.training.optimizer import muon_parameters

    muon_ids = {id(p) for p in muon_parameters(trainer.optimizer)}
    for group in trainer.optimizer.param_groups:
        if not group["params"]:
            continue
        on_muon = {id(p) in muon_ids for p in group["params"]}
        assert len(on_muon) == 1
        expected = (1e-2, 1e-3, 1e-2) if on_muon.pop() else (2e-3, 1e-4, 2e-3)
        assert (group["max_lr"], group["min_lr"], group["lr"]) == pytest.approx(expected, rel=1e-12)
    adam = _trainer(_config({}, name="adam"))
    assert not muon_parameters(adam.optimizer)
    assert all(isinstance(sub.optimizer, torch.optim.AdamW) for sub in adam.optimizer.chained_optimizers)


# ------------------------------------------------------------------ Muon's definition, zero gradients
def _reference_update(p, momentum, grad, lr, wd, beta, nesterov):
    """One step of Muon as megatron-core defines it (decoupled weight decay, EMA momentum,
    quintic Newton-Schulz, spectral scale sqrt(max(rows, cols)))."""
    from emerging_optimizers.orthogonalized_optimizers.muon_utils import newton_schulz

    p = p.add(p, alpha=-wd * lr)
    momentum = momentum.lerp(grad, 1 - beta)
    direction = grad.lerp(momentum, beta) if nesterov else momentum
    update = newton_schulz(direction, 5, "quintic") * max(p.shape) ** 0.5
    return p.add(update, alpha=-lr), momentum


@pytest.mark.parametrize("nesterov", [False, True])
def test_megatron_muon_step_and_zero_gradient(megatron_env, nesterov):
    from megatron_lol.training.muon_compat import load_megatron_muon

    muon = load_megatron_muon()
    gen = torch.Generator().manual_seed(0)
    p = torch.nn.Parameter(torch.randn(12, 5, generator=gen))
    lr, wd, beta = 0.05, 0.1, 0.9
    opt = muon.TensorParallelMuon(
        [p], lr=lr, momentum_beta=beta, use_nesterov=nesterov, weight_decay=wd, fp32_matmul_prec="highest"
    )
    ref_p, ref_m = p.detach().clone(), torch.zeros_like(p)
    grads = [torch.randn(12, 5, generator=gen), torch.zeros(12, 5), torch.zeros(12, 5)]
    for grad in grads:
        p.grad = grad.clone()
        opt.step()
        ref_p, ref_m = _reference_update(ref_p, ref_m, grad, lr, wd, beta, nesterov)
        torch.testing.assert_close(opt.state[p]["momentum_buffer"], ref_m, rtol=0, atol=0)
        torch.testing.assert_close(p.detach(), ref_p, rtol=1e-6, atol=1e-6)
    # unused after step 1: the momentum decays by beta per step and the weight still moves along it
    first = grads[0].mul(1 - beta)
    torch.testing.assert_close(opt.state[p]["momentum_buffer"], first * beta * beta, rtol=1e-6, atol=0)
    # never used: momentum stays zero, only the decoupled weight decay acts
    q = torch.nn.Parameter(torch.randn(4, 6, generator=gen))
    q0 = q.detach().clone()
    opt2 = muon.TensorParallelMuon([q], lr=lr, momentum_beta=beta, weight_decay=wd, fp32_matmul_prec="highest")
    q.grad = torch.zeros_like(q)
    opt2.step()
    assert torch.equal(opt2.state[q]["momentum_buffer"], torch.zeros_like(q))
    assert torch.equal(q.detach(), q0.add(q0, alpha=-wd * lr))


def test_growing_depth_blocks_not_yet_run_get_zero_momentum(megatron_env):
    """Dense core of 3 blocks growing from depth 1: at step 1 blocks 1 and 2 do not run; their
    gradients are zero, Muon leaves their momentum at zero and only decays their weights."""
    cfg = _config(dict(plan="dense"), muon_fp32_matmul_prec="highest", weight_decay=0.1)
    cfg.curriculum.initial_depth = 1
    trainer = _trainer(cfg)
    assert trainer.depth_at(0) == 1
    from megatron_lol.training.optimizer import muon_parameters

    params = dict(trainer.model.named_parameters())
    before = {n: p.detach().clone() for n, p in params.items()}
    trainer.train_step(trainer.data_iterator(trainer.train_ds, 0))
    state = {id(p): s for sub in trainer.optimizer.chained_optimizers for p, s in sub.optimizer.state.items()}
    on_muon = {id(p) for p in muon_parameters(trainer.optimizer)}
    lr, wd = cfg.optimizer.lr, cfg.optimizer.weight_decay
    for name, p in params.items():
        if not name.startswith("core.blocks.") or id(p) not in on_muon:
            continue
        momentum = state[id(p)]["momentum_buffer"]
        if name.startswith("core.blocks.0."):
            assert momentum.abs().sum() > 0 and not torch.equal(p.detach(), before[name])
        else:
            assert torch.equal(momentum, torch.zeros_like(p)), name
            assert torch.equal(p.detach(), before[name].add(before[name], alpha=-wd * lr)), name


# ------------------------------------------------------------------ the compatibility shim
def test_compat_shim_and_install_pin():
    import importlib.util
    import typing

    from megatron_lol.training import muon_compat

    module = muon_compat.load_megatron_muon()
    assert module.HAVE_EMERGING_OPTIMIZERS and muon_compat.unavailable_reason() is None
    assert muon_compat.installed_version() == muon_compat.PINNED_VERSION
    assert hasattr(typing, "override")
    import emerging_optimizers.triton_kernels as kernels

    if importlib.util.find_spec("triton") is None:
        assert kernels.HAS_TRITON_340 is False and "Stand-in" in kernels.__doc__
    # megatron-core's loop that moves expert groups out of the Muon groups, on our list
    groups = muon_compat._GroupList(
        [{"is_expert_parallel": e, "params": [torch.zeros(2), torch.ones(2)]} for e in (False, True, True, False)]
    )
    moved = []
    for group in groups:
        if group["is_expert_parallel"]:
            moved.append(group)
            groups.remove(group)
    assert [g["is_expert_parallel"] for g in groups] == [False, False] and len(moved) == 2
    pin = (REPO / "tools" / "requirements-muon.txt").read_text()
    assert re.search(r"^emerging-optimizers==0\.3\.0 --hash=sha256:[0-9a-f]{64}$", pin, re.M)
    assert "requirements-muon.txt" in (REPO / "tools" / "setup_env.sh").read_text()


def test_missing_or_placeholder_package_is_a_one_line_error(monkeypatch):
    from megatron_lol.errors import CliError
    from megatron_lol.training import muon_compat

    monkeypatch.setattr(muon_compat, "_LOADED", None)
    monkeypatch.setattr(muon_compat, "installed_version", lambda: None)
    with pytest.raises(CliError, match=r"not installed \(bash tools/setup_env.sh") as err:
        muon_compat.load_megatron_muon()
    assert "\n" not in str(err.value)
    monkeypatch.setattr(muon_compat, "installed_version", lambda: "999.9.9")
    with pytest.raises(CliError, match="placeholder, not the project"):
        muon_compat.load_megatron_muon()


# ------------------------------------------------------------------ flags and errors
def test_flags_and_one_line_errors(tmp_path):
    import argparse

    from megatron_lol.config import add_config_arguments, config_from_args
    from megatron_lol.errors import ConfigError

    config = tmp_path / "c.yaml"
    config.write_text("model:\n  hidden_size: 32\n")

    def parse(*flags):
        parser = argparse.ArgumentParser()
        add_config_arguments(parser)
        return config_from_args(parser.parse_args(["--config", str(config), *flags]), check_data=False)

    o = parse(
        "--optimizer",
        "muon",
        "--muon-momentum",
        "0.9",
        "--muon-tp-mode",
        "duplicated",
        "--muon-use-nesterov",
        "--muon-no-split-qkv",
        "--muon-num-ns-steps",
        "6",
        "--muon-scale-mode",
        "unit_rms_norm",
        "--muon-extra-scale-factor",
        "0.2",
        "--muon-fp32-matmul-prec",
        "highest",
        "--muon-adam-lr",
        "1e-3",
        "--adam-beta2",
        "0.99",
    ).optimizer
    assert (
        o.name,
        o.muon_momentum,
        o.muon_tp_mode,
        o.muon_use_nesterov,
        o.muon_split_qkv,
        o.muon_num_ns_steps,
        o.muon_scale_mode,
        o.muon_extra_scale_factor,
        o.muon_fp32_matmul_prec,
        o.muon_adam_lr,
        o.adam_beta2,
    ) == ("muon", 0.9, "duplicated", True, False, 6, "unit_rms_norm", 0.2, "highest", 1e-3, 0.99)
    assert parse().optimizer.name == "adam"
    for flags, message in [
        (("--optimizer", "sgd"), "optimizer.name: must be one of adam, muon (got 'sgd')"),
        (("--muon-tp-mode", "rowwise"), "optimizer.muon_tp_mode: must be one of blockwise, duplicated"),
        (("--muon-num-ns-steps", "0"), "optimizer.muon_num_ns_steps: must be >= 1"),
        (("--muon-momentum", "1.0"), "optimizer.muon_momentum: must be in [0, 1)"),
        (("--muon-adam-lr", "0"), "optimizer.muon_adam_lr: must be > 0"),
    ]:
        with pytest.raises(ConfigError) as err:
            parse(*flags)
        assert message in str(err.value) and "\n" not in str(err.value)
    proc = subprocess.run(
        [sys.executable, "-m", "megatron_lol", "train", "--config", str(config), "--optimizer", "lion"],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=REPO,
    )
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [
        "megatron-lol train: error: optimizer.name (--optimizer): must be one of adam, muon (got 'lion')"
    ]


# ------------------------------------------------------------------ parallel layouts
FOIL = dict(
    plan="looped",
    num_blocks=2,
    routed_depth=4,
    num_experts=4,
    core_num_experts=4,
    moe_ffn_hidden_size=32,
    moe_router_topk=2,
    moe_layers="all",
    untie_attention=True,
)
HIGHEST = {"muon_fp32_matmul_prec": "highest"}
LAYOUTS = {  # name: (parallel, optimizer, model)
    "tp2_duplicated_medium": ({"tensor_model_parallel_size": 2}, {"muon_tp_mode": "duplicated"}, {}),
    "tp2_duplicated": ({"tensor_model_parallel_size": 2}, dict(HIGHEST, muon_tp_mode="duplicated"), {}),
    "tp2_sp_duplicated": (
        {"tensor_model_parallel_size": 2, "sequence_parallel": True},
        dict(HIGHEST, muon_tp_mode="duplicated"),
        {},
    ),
    "tp2_distributed": ({"tensor_model_parallel_size": 2}, dict(HIGHEST, muon_tp_mode="distributed"), {}),
    "tp2_blockwise": ({"tensor_model_parallel_size": 2}, dict(HIGHEST, muon_tp_mode="blockwise"), {}),
    "ep2": ({"expert_model_parallel_size": 2}, HIGHEST, {}),
    "ep2_layer_wise": ({"expert_model_parallel_size": 2, "use_distributed_optimizer": True}, HIGHEST, {}),
    "pp2": ({"pipeline_model_parallel_size": 2}, HIGHEST, {}),
    "dp2": ({}, HIGHEST, {}),
    "dp2_layer_wise": ({"use_distributed_optimizer": True}, HIGHEST, {}),
    "foil_ep2": ({"expert_model_parallel_size": 2}, HIGHEST, FOIL),
}
REFERENCES = {"lol_medium": ({}, {}), "lol": (HIGHEST, {}), "foil": (HIGHEST, FOIL)}


def _train_steps(parallel: dict, optimizer: dict, model: dict) -> list:
    cfg = _config(dict(dict(routed_depth=6, num_blocks=4), **model), parallel, **optimizer)
    cfg.training.global_batch_size = 4
    trainer = _trainer(cfg)
    data = trainer.data_iterator(trainer.train_ds, 0)
    return [trainer.train_step(data).loss for _ in range(3)]


def _references() -> dict:
    return {name: _train_steps({}, opt, model) for name, (opt, model) in REFERENCES.items()}


def _layouts() -> dict:
    return {name: _train_steps(*spec) for name, spec in LAYOUTS.items()}


def _relative(got: list, ref: list) -> float:
    return max(abs(a - b) / abs(b) for a, b in zip(got, ref))


@pytest.fixture(scope="module")
def references() -> dict:
    """The one-process runs, made by the first test that asks (the one-core test below), so that the
    layouts' test holds the whole machine for its own launch only."""
    return run_distributed(_references, 1, timeout=300)[0]


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_one_process_references_train(references):
    assert references["lol"][0] != references["lol"][-1]
    assert all(references[name][0] != references[name][-1] for name in REFERENCES), references


@pytest.mark.slow
@pytest.mark.timeout(900)
@pytest.mark.multiprocess
def test_layouts_equal_one_process(references):
    ref = references
    results = run_distributed(_layouts, 2, timeout=800)
    assert results[0] == results[1]  # every rank reports the same (global) losses
    got = results[0]
    assert _relative(got["tp2_duplicated_medium"], ref["lol_medium"]) < 1e-4
    for name in (
        "tp2_duplicated",
        "tp2_sp_duplicated",
        "tp2_distributed",
        "ep2",
        "ep2_layer_wise",
        "pp2",
        "dp2",
        "dp2_layer_wise",
    ):
        assert _relative(got[name], ref["lol"]) < 1e-6, (name, got[name], ref["lol"])
    assert _relative(got["foil_ep2"], ref["foil"]) < 1e-6, (got["foil_ep2"], ref["foil"])
    assert 1e-5 < _relative(got["tp2_blockwise"], ref["lol"]) < 1e-2, (got["tp2_blockwise"], ref["lol"])


# ------------------------------------------------------------------ checkpoints
@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    from test_checkpointing import make_corpus, write_config

    root = tmp_path_factory.mktemp("muon")
    prefix, tok = make_corpus(root / "data")
    return root, write_config(root / "tiny.yaml", prefix, tok, str(root / "cache"))


MUON_ARGS = ("--optimizer", "muon", "--set", "optimizer.muon_fp32_matmul_prec=highest")


@pytest.fixture(scope="module")
def muon_reference(corpus):
    """An uninterrupted one-process Muon run with its checkpoints, made by the first test that asks (the
    one-core kill test below), so that the TP=2 reshard holds the whole machine for its own launch only."""
    from test_checkpointing import run

    root, config = corpus
    ref_save, ref_log = root / "ref", root / "ref.log"
    assert run(config, ref_save, *MUON_ARGS, log=ref_log) == 0, ref_log.read_text()[-3000:]
    return ref_save, ref_log


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_kill9_resume_with_muon_state_is_bit_exact(corpus, muon_reference):
    from test_checkpointing import TRAIN_ITERS, assert_same_losses, kill9, launch, metrics, run, tracker, wait_for

    root, config = corpus
    ref_save, ref_log = muon_reference
    assert "megatron-core Muon" in ref_log.read_text()
    ref = metrics(ref_save)
    assert sorted(ref) == list(range(1, TRAIN_ITERS + 1))
    from megatron.core.dist_checkpointing import load_tensors_metadata

    keys = load_tensors_metadata(str(ref_save / "iter_0000004")).keys()
    assert any("momentum_buffer" in k for k in keys) and any("exp_avg" in k for k in keys)
    # kill -9 past the checkpoint of 4, resume: every step bit-identical to the uninterrupted run
    save, log = root / "kill", root / "kill.log"
    proc = launch(config, save, *MUON_ARGS, log=log)
    wait_for(lambda: max(metrics(save), default=0) >= 6, proc, what="step 6")
    kill9(proc)
    assert tracker(save) == 4
    assert run(config, save, *MUON_ARGS, log=log) == 0, log.read_text()[-3000:]
    assert "optimizer loaded" in log.read_text()
    assert_same_losses(metrics(save), ref, range(1, TRAIN_ITERS + 1))


@pytest.mark.slow
@pytest.mark.timeout(900)
@pytest.mark.multiprocess
def test_muon_checkpoint_of_one_process_resumes_at_tp2(corpus, muon_reference):
    """The 1-process checkpoint of 4 resumed at TP=2 (duplicated Newton-Schulz = the 1-process update)."""
    from test_checkpointing import TRAIN_ITERS, metrics, run

    root, config = corpus
    ref_save, _ = muon_reference
    ref = metrics(ref_save)
    save, log = root / "to_tp2", root / "to_tp2.log"
    save.mkdir()
    shutil.copytree(ref_save / "iter_0000004", save / "iter_0000004")
    (save / "latest_checkpointed_iteration.txt").write_text("4\n")
    assert (
        run(
            config,
            save,
            *MUON_ARGS,
            "--tensor-model-parallel-size",
            "2",
            "--muon-tp-mode",
            "duplicated",
            log=log,
            nproc=2,
        )
        == 0
    ), log.read_text()[-3000:]
    assert "optimizer loaded" in log.read_text() and "parallel layout changed" in log.read_text()
    got = metrics(save)
    assert sorted(got) == list(range(5, TRAIN_ITERS + 1))
    for s in got:
        assert abs(got[s]["loss"] - ref[s]["loss"]) < 1e-5 * ref[s]["loss"], (s, got[s]["loss"], ref[s]["loss"])


@pytest.mark.slow
@pytest.mark.timeout(900)
@pytest.mark.multiprocess
def test_layer_wise_checkpoint_reshards_over_data_parallel(corpus):
    """DP=2 with the layer-wise distributed optimizer saves; its checkpoint resumes on one
    process; resuming it without the layer-wise optimizer is a one-line error."""
    from test_checkpointing import TRAIN_ITERS, metrics, run

    root, config = corpus
    args = (*MUON_ARGS, "--use-distributed-optimizer")
    save, log = root / "layer_wise", root / "layer_wise.log"
    assert run(config, save, *args, log=log, nproc=2) == 0, log.read_text()[-3000:]
    assert "layer-wise distributed optimizer" in log.read_text()
    ref = metrics(save)
    assert sorted(ref) == list(range(1, TRAIN_ITERS + 1))
    one = root / "layer_wise_to_1"
    one.mkdir()
    shutil.copytree(save / "iter_0000004", one / "iter_0000004")
    (one / "latest_checkpointed_iteration.txt").write_text("4\n")
    assert run(config, one, *args, log=root / "to_1.log") == 0, (root / "to_1.log").read_text()[-3000:]
    assert "optimizer loaded" in (root / "to_1.log").read_text()
    got = metrics(one)
    assert sorted(got) == list(range(5, TRAIN_ITERS + 1))
    for s in got:
        assert abs(got[s]["loss"] - ref[s]["loss"]) < 1e-6 * ref[s]["loss"], (s, got[s]["loss"], ref[s]["loss"])
    # the same checkpoint without the layer-wise optimizer: refused in one line, nothing overwritten
    before = sorted(p.name for p in one.iterdir())
    assert run(config, one, *MUON_ARGS, log=root / "switch.log") == 2
    errors = [line for line in (root / "switch.log").read_text().splitlines() if "error:" in line]
    assert errors == [
        f"megatron-lol train: error: {one / 'iter_0000012'}: holds the optimizer state of muon with the "
        f"layer-wise distributed optimizer, this run uses muon; to switch, start a new --save from "
        f"--load {one} with training.reset_optimizer: true"
    ]
    assert sorted(p.name for p in one.iterdir()) == before


# ------------------------------------------------------------------ benchmark
@pytest.mark.slow
@pytest.mark.timeout(600)
def test_benchmark_runs_and_prints_both_optimizers(corpus, tmp_path):
    root, config = corpus
    out_json = tmp_path / "bench.json"
    proc = subprocess.run(
        [
            sys.executable,
            str(REPO / "bench" / "optimizer.py"),
            "--config",
            str(config),
            "--train-iters",
            "3",
            "--set",
            "optimizer.lr_warmup_iters=1",
            "--big-steps",
            "1",
            "--big-warmup",
            "1",
            "--big-hidden",
            "32",
            "--big-heads",
            "4",
            "--big-ffn",
            "64",
            "--json",
            str(out_json),
        ],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=REPO,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(out_json.read_text())
    for model in ("tiny", "big"):
        assert set(result[model]) == {"adam", "muon"}
        for row in result[model].values():
            assert row["step_cpu_s"] and row["optimizer_cpu_s"] and row["step_wall_s"] and row["params"] > 0
    tiny = result["tiny"]
    assert tiny["adam"]["eval_start"] == tiny["muon"]["eval_start"]  # same initial model
    assert tiny["adam"]["eval_end"] != tiny["muon"]["eval_end"]
    rows = [line.split() for line in proc.stdout.splitlines() if line.split()[:1] in (["tiny"], ["big"])]
    assert [(r[0], r[2]) for r in rows] == [("tiny", "adam"), ("tiny", "muon"), ("big", "adam"), ("big", "muon")]
