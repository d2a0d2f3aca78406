"""The optimizer and learning-rate schedule of a run, built by megatron-core.

``optimizer.name: adam``
    megatron-core's ``get_megatron_optimizer``: AdamW over every parameter;
    with ``parallel.use_distributed_optimizer`` its distributed optimizer
    (state sharded over the data-parallel ranks through DDP's buffers).

``optimizer.name: muon``
    megatron-core's ``get_megatron_muon_optimizer``: a chain of its
    ``TensorParallelMuon`` for the hidden matrices (:func:`is_muon_matrix`)
    and its AdamW for everything else. megatron-core refuses Muon with the
    buffer-sharded distributed optimizer, so ``parallel.use_distributed_optimizer``
    selects its layer-wise equivalent instead (``LayerWiseDistributedOptimizer``:
    each data-parallel rank updates whole tensors, then the ranks all-gather
    them; DDP then all-reduces gradients as without a distributed optimizer,
    see :func:`ddp_uses_distributed_optimizer`). Which Muon implementation runs
    and why: :mod:`megatron_lol.training.muon_compat`.

Learning rates under Muon: the Muon matrices follow ``optimizer.lr`` /
``min_lr``; the AdamW part follows ``muon_adam_lr`` / ``muon_adam_min_lr``,
which default to the same values (Megatron-LM's convention, one ``--lr``).
One learning rate suits both when the updates have the same size:
megatron-core's default ``spectral`` scale gives an orthogonalised update a
root-mean-square of about 1, an AdamW update is typically about 0.2, and
``muon_extra_scale_factor: 0.2`` closes that gap (the quickstart and the LoL
paper configs set it; docs/optimizer.md). Both parts follow the same schedule.

A library block's matrix is one parameter whatever the number of depths that
used it: its gradient is the sum over those depths, and Muon orthogonalises
that sum once per step. A block unused at a step has a zero gradient (DDP's
buffers are zeroed, never None): megatron-core's Muon then still decays its
momentum by ``muon_momentum``, applies the decoupled weight decay and steps
along the orthogonalised decayed momentum (zero if it never had one).
"""

from __future__ import annotations

import contextlib
import re
from typing import Iterable, Iterator

import torch

from megatron_lol.config.schema import ExperimentConfig
from megatron_lol.log import log_rank0

# modules whose 2-D weights are Muon's: attention and MLPs (experts and shared experts included)
MUON_MODULES = ("self_attention", "mlp")
_WEIGHT = re.compile(r"weight\d*")  # weight, or TE grouped experts' weight0, weight1, ...


def is_muon_matrix(name: str, param: torch.Tensor) -> bool:
    """Whether parameter ``name`` (a ``named_parameters`` name) is trained by Muon.

    Muon: the 2-D weight matrices of the linear layers inside attention
    (``linear_qkv``, ``linear_proj``) and MLPs (``linear_fc1``, ``linear_fc2``;
    MoE experts and shared experts) of the prelude, the library blocks, Foil's
    per-pass attention and the coda. AdamW: everything else -- embeddings and
    the output head (not inside attention/MLP), norms, biases, MoE routers and
    LoL's window routers, FiLM, input injection, depth vectors, Accordion's
    gates and second-pass routers.
    """
    if param.dim() != 2:
        return False
    parts = name.split(".")
    return (
        bool(_WEIGHT.fullmatch(parts[-1]))
        and "router" not in parts
        and any(part in MUON_MODULES for part in parts[:-1])
    )


def split_parameters(model: torch.nn.Module) -> tuple[list[str], list[str]]:
    """(Muon names, AdamW names) of ``model``'s trainable parameters, in ``named_parameters`` order."""
    muon, adamw = [], []
    for name, param in model.named_parameters():
        if param.requires_grad:
            (muon if is_muon_matrix(name, param) else adamw).append(name)
    return muon, adamw


def ddp_uses_distributed_optimizer(cfg: ExperimentConfig) -> bool:
    """DDP's ``use_distributed_optimizer``: only Adam's distributed optimizer shards DDP's buffers."""
    return cfg.parallel.use_distributed_optimizer and cfg.optimizer.name == "adam"


def optimizer_state_kind(cfg: ExperimentConfig) -> str:
    """What a checkpoint's optimizer state belongs to; only the same kind resumes it.

    Muon's state is laid out differently with and without the layer-wise
    distributed optimizer (either reshards over TP/PP/EP/DP by itself).
    """
    if cfg.optimizer.name == "muon" and cfg.parallel.use_distributed_optimizer:
        return "muon with the layer-wise distributed optimizer"
    return cfg.optimizer.name


def megatron_optimizer_config(cfg: ExperimentConfig):
    """megatron-core's ``OptimizerConfig`` for ``cfg`` (both optimizers; Muon reads the ``muon_*`` fields)."""
    from megatron.core.optimizer import OptimizerConfig as MegatronOptimizerConfig

    o = cfg.optimizer
    bf16 = cfg.model.precision.params_dtype == "bf16"
    return MegatronOptimizerConfig(
        optimizer="adam",
        lr=o.lr,
        min_lr=o.min_lr,
        weight_decay=o.weight_decay,
        adam_beta1=o.adam_beta1,
        adam_beta2=o.adam_beta2,
        adam_eps=o.adam_eps,
        clip_grad=o.clip_grad,
        bf16=bf16,
        params_dtype=torch.bfloat16 if bf16 else torch.float32,
        use_distributed_optimizer=ddp_uses_distributed_optimizer(cfg),
        muon_momentum=o.muon_momentum,
        muon_split_qkv=o.muon_split_qkv,
        muon_use_nesterov=o.muon_use_nesterov,
        muon_scale_mode=o.muon_scale_mode,
        muon_fp32_matmul_prec=o.muon_fp32_matmul_prec,
        muon_num_ns_steps=o.muon_num_ns_steps,
        muon_tp_mode=o.muon_tp_mode,
        muon_extra_scale_factor=o.muon_extra_scale_factor,
    )


def adamw_learning_rates(cfg: ExperimentConfig) -> tuple[float, float]:
    """(peak, minimum) learning rate of the AdamW part under Muon."""
    o = cfg.optimizer
    peak = o.lr if o.muon_adam_lr is None else o.muon_adam_lr
    if o.muon_adam_min_lr is not None:
        return peak, o.muon_adam_min_lr
    return peak, o.min_lr * peak / o.lr  # the main schedule's ratio


def build_optimizer(cfg: ExperimentConfig, model_chunks: list):
    """megatron-core's optimizer for the (DDP-wrapped) ``model_chunks``; see the module docstring."""
    from megatron.core.optimizer import get_megatron_optimizer

    mcfg = megatron_optimizer_config(cfg)
    if cfg.optimizer.name == "adam":
        return get_megatron_optimizer(mcfg, model_chunks)
    return _build_muon(cfg, mcfg, model_chunks)


def _build_muon(cfg: ExperimentConfig, mcfg, model_chunks: list):
    from megatron.core.optimizer import ParamKey, ParamPredicate, get_standard_config_overrides

    from megatron_lol.training.muon_compat import load_megatron_muon, nest_fp32_member_states

    muon = load_megatron_muon()
    named = [(n, p) for chunk in model_chunks for n, p in chunk.named_parameters() if p.requires_grad]
    on_muon = [p for n, p in named if is_muon_matrix(n, p)]
    on_adamw = [p for n, p in named if not is_muon_matrix(n, p)]
    overrides = get_standard_config_overrides(mcfg)  # no weight decay on biases and 1-D tensors
    peak, low = adamw_learning_rates(cfg)
    if (peak, low) != (mcfg.lr, mcfg.min_lr):
        adamw_ids = frozenset(id(p) for p in on_adamw)
        key = ParamKey(predicate=ParamPredicate(name="megatron_lol_adamw", fn=lambda p: id(p) in adamw_ids))
        overrides[key] = {"max_lr": peak, "min_lr": low}
    layer_wise = cfg.parallel.use_distributed_optimizer
    with _kept_on_adamw(p for p in on_adamw if p.dim() == 2):
        optimizer = muon.get_megatron_muon_optimizer(
            mcfg, model_chunks, config_overrides=overrides, layer_wise_distributed_optimizer=layer_wise
        )
    if layer_wise:
        nest_fp32_member_states(optimizer)
        if _data_parallel_backend() == "gloo":
            # the layer-wise optimizer gathers the updated tensors with one all_gather of unequal
            # sizes per group, which gloo refuses; its own per-tensor broadcasts do the same job
            optimizer.allgather_params = optimizer.broadcast_params
    o = cfg.optimizer
    log_rank0(
        f" optimizer: megatron-core Muon (TensorParallelMuon, tp mode {o.muon_tp_mode}, momentum "
        f"{o.muon_momentum}, {o.muon_num_ns_steps} Newton-Schulz steps, scale {o.muon_scale_mode}) for "
        f"{len(on_muon)} matrices ({_numel(on_muon):,} params), lr {mcfg.lr:g} -> {mcfg.min_lr:g}; AdamW for "
        f"{len(on_adamw)} tensors ({_numel(on_adamw):,} params), lr {peak:g} -> {low:g}"
        + ("; layer-wise distributed optimizer" if layer_wise else "")
        + " (this rank)"
    )
    return optimizer


@contextlib.contextmanager
def _kept_on_adamw(matrices: Iterable[torch.Tensor]) -> Iterator[None]:
    """2-D tensors that are not hidden matrices stay on AdamW inside ``get_megatron_muon_optimizer``.

    megatron-core gives Muon every 2-D parameter not marked
    ``is_embedding_or_output_parameter`` (its marking of the embedding and the
    output head); routers, depth vectors and, in this model, the embedding
    and output head themselves are 2-D too. They carry that mark while the
    optimizer is built, and only then (elsewhere the mark selects
    ``decoupled_lr``, which this package does not use).
    """
    marked = [p for p in matrices if not getattr(p, "is_embedding_or_output_parameter", False)]
    for p in marked:
        p.is_embedding_or_output_parameter = True
    try:
        yield
    finally:
        for p in marked:
            del p.is_embedding_or_output_parameter


def _data_parallel_backend() -> str:
    from megatron.core import parallel_state

    return torch.distributed.get_backend(parallel_state.get_data_parallel_group(with_context_parallel=True))


def _numel(params: list) -> int:
    return sum(p.numel() for p in params)


def muon_parameters(optimizer) -> list:
    """The parameters held by the ``TensorParallelMuon`` optimizers inside a megatron optimizer chain
    (the main copies: with bf16 these are the fp32 master weights)."""
    from megatron_lol.training.muon_compat import load_megatron_muon

    cls = load_megatron_muon().TensorParallelMuon
    out = []
    for sub in getattr(optimizer, "chained_optimizers", [optimizer]):
        inner = getattr(sub, "optimizer", None)
        if isinstance(inner, cls):
            out.extend(p for group in inner.param_groups for p in group["params"])
    return out


def build_scheduler(cfg: ExperimentConfig, optimizer):
    """megatron-core's ``OptimizerParamScheduler``: warmup, then cosine / WSD / linear / constant decay.

    Each parameter group follows its own ``max_lr`` / ``min_lr`` (the AdamW part under Muon may differ).
    """
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    o, tr = cfg.optimizer, cfg.training
    wsd = o.lr_wsd_decay_iters if o.lr_decay_style == "WSD" else None
    if o.lr_decay_style == "WSD" and wsd is None:
        wsd = max(1, tr.train_iters // 5)
    decay_steps = tr.train_iters
    if o.lr_warmup_iters >= tr.train_iters:
        # a smoke run of a long config: the run ends inside the warm-up (megatron-core's scheduler needs
        # the decay to end after the warm-up; no step of this run reaches it)
        decay_steps = o.lr_warmup_iters + 1
        log_rank0(
            f"note: optimizer.lr_warmup_iters (--lr-warmup-iters) {o.lr_warmup_iters} is not smaller than "
            f"training.train_iters (--train-iters) {tr.train_iters}: the run ends inside the warm-up, at lr "
            f"{o.lr * tr.train_iters / o.lr_warmup_iters:.3g} of {o.lr:g}"
        )
    return OptimizerParamScheduler(
        optimizer,
        init_lr=0.0 if o.lr_warmup_iters else o.lr,
        max_lr=o.lr,
        min_lr=o.min_lr,
        lr_warmup_steps=o.lr_warmup_iters,
        lr_decay_steps=decay_steps,
        lr_decay_style=o.lr_decay_style,
        start_wd=o.weight_decay,
        end_wd=o.weight_decay,
        wd_incr_steps=tr.train_iters,
        wd_incr_style="constant",
        wsd_decay_steps=wsd,
        lr_wsd_decay_style=o.lr_wsd_decay_style,
    )
