"""Typed configuration for every run: model, parallel layout, data, training.

One YAML file maps onto :class:`ExperimentConfig` section by section. Every
field is validated up front (:meth:`ExperimentConfig.validate`) so that a bad
value stops the run with a one-line error naming the key *before* any process
group, dataset or model is built.

Names follow Megatron-LM's arguments where one exists (``hidden_size``,
``num_attention_heads``, ``ffn_hidden_size``, ``micro_batch_size``,
``tensor_model_parallel_size``, ...); LoL-specific knobs use the symbols of the
paper in their docstrings (L, D, W, S).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from fractions import Fraction
from typing import Optional

from megatron_lol.checks import asdict, choice, nonnegative, positive
from megatron_lol.config.model_config import (  # noqa: F401 - the model section, re-exported
    BALANCING,
    FILM_MODES,
    FP8_RECIPES,
    MOE_SCORE_FUNCTIONS,
    PARAMS_DTYPES,
    ROUTER_INPUTS,
    ModelConfig,
    fp8_recipe_default,
    fp8_row_multiple,
    resolve_params_dtype,
    runs_layers_repeatedly,
    typing_hints,
)
from megatron_lol.errors import ConfigError
from megatron_lol.plan.stages import check_pipeline_layout
from megatron_lol.plan.windows import windows_of

ROUTED_CORES = ("auto", "reference", "grouped")


@dataclass
class CurriculumConfig:
    """Growing depth and truncated backprop through depth (docs/model.md, "Growing depth")."""

    initial_depth: Optional[int] = None  # D0; None = no growing, full depth from step 0
    growth_fraction: float = 0.75  # growth period T = growth_fraction * train_iters
    backprop_depth: Optional[int] = None  # k: only the last k routed depths get gradients
    first_window_full_backprop: bool = True

    def validate(self, model: ModelConfig, prefix: str = "curriculum") -> None:
        if self.initial_depth is not None:
            if not 1 <= self.initial_depth <= model.core_depth:
                raise ConfigError(
                    f"{prefix}.initial_depth: must be in [1, {model.core_depth}] (got {self.initial_depth})"
                )
        if not 0 < self.growth_fraction <= 1:
            raise ConfigError(f"{prefix}.growth_fraction: must be in (0, 1] (got {self.growth_fraction})")
        if self.backprop_depth is not None:
            positive(f"{prefix}.backprop_depth", self.backprop_depth)
        plan = model.execution_plan()
        if not plan.growable and (self.initial_depth is not None or self.backprop_depth is not None):
            key = "initial_depth" if self.initial_depth is not None else "backprop_depth"
            raise ConfigError(f"{prefix}.{key}: plan {plan.name} sets its depth by the budget (model.plan.budgets)")


@dataclass
class ParallelConfig:
    """Parallel layout; data parallel size is the rest of the world size."""

    tensor_model_parallel_size: int = 1
    pipeline_model_parallel_size: int = 1
    virtual_pipeline_model_parallel_size: Optional[int] = None
    expert_model_parallel_size: int = 1
    sequence_parallel: bool = False
    use_distributed_optimizer: bool = False
    recompute_granularity: Optional[str] = None  # None | full | selective
    # Megatron-LM's --recompute-method: full recomputation checkpoints every layer execution on its own,
    # which is its "uniform" method with one layer per group (the only one offered)
    recompute_method: Optional[str] = None
    # megatron-core DDP's overlap of the data-parallel gradient reduction with backward (Megatron-LM's
    # --overlap-grad-reduce); the core's buckets start when backward leaves the core (parallel/grad_ready.py)
    overlap_grad_reduce: bool = False
    # how a LoL core's routed depths run their blocks, chosen when the model is built (docs/gpu.md, "The
    # routed depth on a GPU"; the routing and the model are the same either way): "reference" = one call per
    # block (model/executors.py PerBlockCalls); "grouped" = all blocks of a depth as one grouped computation
    # (GroupedGEMMs); "auto" = grouped on CUDA where the model supports it, per block elsewhere (on CPU, with
    # the CPU backend, faster)
    routed_core: str = "auto"

    def validate(self, model: ModelConfig, prefix: str = "parallel") -> None:
        choice(f"{prefix}.routed_core", self.routed_core, ROUTED_CORES)
        for name in ("tensor_model_parallel_size", "pipeline_model_parallel_size", "expert_model_parallel_size"):
            positive(f"{prefix}.{name}", getattr(self, name))
        tp = self.tensor_model_parallel_size
        if model.num_attention_heads % tp:
            raise ConfigError(
                f"{prefix}.tensor_model_parallel_size: {tp} does not divide "
                f"model.num_attention_heads={model.num_attention_heads}"
            )
        plan = model.execution_plan()
        ep = self.expert_model_parallel_size
        if plan.shards_library and plan.num_stored_blocks % ep:
            raise ConfigError(
                f"{prefix}.expert_model_parallel_size: {ep} does not divide the {plan.num_stored_blocks} "
                f"stored blocks of plan {plan.name}"
            )
        if not plan.shards_library and model.moe.layers != "none":
            for key, n in (("num_experts", model.moe.num_experts), ("core experts", plan.core_experts)):
                if n is not None and n % ep:
                    raise ConfigError(f"{prefix}.expert_model_parallel_size: {ep} does not divide model.{key}={n}")
        if plan.shards_library and model.moe.layers == "all" and ep > 1:
            # EP would shard the block library and every block's experts over the same ranks,
            # leaving some (block, expert) pairs on no rank
            raise ConfigError(
                f"{prefix}.expert_model_parallel_size: plan {plan.name} shards its block library "
                f"over EP={ep}; its blocks cannot also be MoE layers (model.moe.layers: all); use "
                f"model.moe.layers: fixed or expert_model_parallel_size: 1"
            )
        if model.moe.layers != "none" and tp > 1:
            # megatron-core refuses to train MoE layers under TP without SP
            if not self.sequence_parallel:
                raise ConfigError(
                    f"{prefix}.sequence_parallel: megatron-core MoE layers with "
                    f"tensor_model_parallel_size={tp} need sequence_parallel: true"
                )
            if model.moe.layers == "all" and plan.gathers_sequence:
                raise ConfigError(
                    f"{prefix}.tensor_model_parallel_size: MoE blocks in a core that gathers the "
                    f"sequence (routed or strided attention) cannot use TP={tp}; use "
                    f"expert_model_parallel_size instead"
                )
        if self.sequence_parallel and tp == 1:
            raise ConfigError(f"{prefix}.sequence_parallel: needs tensor_model_parallel_size > 1")
        if self.overlap_grad_reduce and self.pipeline_model_parallel_size > 1:
            raise ConfigError(
                f"{prefix}.overlap_grad_reduce: not with pipeline_model_parallel_size="
                f"{self.pipeline_model_parallel_size}: the library's copies on several stages are "
                f"summed before the data-parallel reduction (parallel/library_sync.py)"
            )
        if self.recompute_granularity not in (None, "full", "selective"):
            raise ConfigError(
                f"{prefix}.recompute_granularity: must be full or selective (got {self.recompute_granularity!r})"
            )
        if self.recompute_method is not None:
            if self.recompute_method == "block":
                raise ConfigError(
                    f"{prefix}.recompute_method: block is not offered: full recomputation "
                    f"checkpoints every layer execution on its own (uniform)"
                )
            choice(f"{prefix}.recompute_method", self.recompute_method, ("uniform",))
            if self.recompute_granularity != "full":
                raise ConfigError(
                    f"{prefix}.recompute_method: {self.recompute_method} needs "
                    f"recompute_granularity: full (got {self.recompute_granularity})"
                )

    def data_parallel_size(self, world_size: int) -> int:
        model_parallel = self.tensor_model_parallel_size * self.pipeline_model_parallel_size
        if world_size % model_parallel:
            raise ConfigError(
                f"parallel: world size {world_size} is not divisible by "
                f"tensor_model_parallel_size x pipeline_model_parallel_size = {model_parallel}"
            )
        dp = world_size // model_parallel
        if (dp * self.tensor_model_parallel_size) % self.expert_model_parallel_size:
            raise ConfigError(
                f"parallel.expert_model_parallel_size: {self.expert_model_parallel_size} does not "
                f"divide data_parallel x tensor_parallel = {dp * self.tensor_model_parallel_size}"
            )
        return dp


@dataclass
class DataConfig:
    """Where tokens come from (Megatron indexed datasets) and how to read them."""

    paths: list = field(default_factory=list)  # [prefix] or [w1, prefix1, w2, prefix2, ...]
    split: str = "98,1,1"
    tokenizer_type: str = "SentencePieceTokenizer"
    tokenizer_model: Optional[str] = None
    vocab_file: Optional[str] = None
    merge_file: Optional[str] = None
    cache_dir: Optional[str] = None

    def tokenizer_on_hub(self) -> bool:
        """``tokenizer_model`` names a HuggingFace Hub repository (``tokenizer_type: HuggingFaceTokenizer``,
        ``namespace/name``, no such local path): read from the Hub cache when the tokenizer is built, so it is
        not a file that validation can check."""
        from megatron_lol.data.tokenizers import is_hub_name

        return self.tokenizer_type == "HuggingFaceTokenizer" and is_hub_name(self.tokenizer_model)

    def validate(self, prefix: str = "data", check_files: bool = True) -> None:
        import os

        if not self.paths:
            raise ConfigError(f"{prefix}.paths: no data path given (set data.paths or --data-path)")
        prefixes = self.paths[1::2] if len(self.paths) > 1 else self.paths
        if len(self.paths) > 1:
            if len(self.paths) % 2:
                raise ConfigError(f"{prefix}.paths: a blend needs weight/prefix pairs (got {len(self.paths)} items)")
            for w in self.paths[0::2]:
                try:
                    weight = float(w)
                except (TypeError, ValueError):
                    raise ConfigError(f"{prefix}.paths: weight {w!r} is not a number") from None
                if not math.isfinite(weight) or weight < 0:
                    raise ConfigError(f"{prefix}.paths: weight {w!r} must be a finite number >= 0")
            if sum(float(w) for w in self.paths[0::2]) <= 0:
                raise ConfigError(f"{prefix}.paths: the blend weights sum to zero")
        if check_files:
            from megatron_lol.data.indexed import IndexHeader

            for p in prefixes:
                for ext in (".bin", ".idx"):
                    if not os.path.exists(f"{p}{ext}"):
                        raise ConfigError(f"{prefix}.paths: {p}{ext} does not exist")
                try:  # the header only (34 bytes): an empty dataset stops here, not after the start-up
                    header = IndexHeader(f"{p}.idx")
                except (ValueError, OSError) as err:
                    raise ConfigError(f"{prefix}.paths: {err}") from None
                if header.sequence_count == 0 or header.document_count <= 1:
                    raise ConfigError(f"{prefix}.paths: {p}.idx holds no documents (an empty corpus?)")
            if self.tokenizer_model and not os.path.exists(self.tokenizer_model) and not self.tokenizer_on_hub():
                raise ConfigError(f"{prefix}.tokenizer_model: {self.tokenizer_model} does not exist")
        parts = self.split.replace("/", ",").split(",")
        try:
            vals = [float(x) for x in parts]
        except ValueError:
            raise ConfigError(f"{prefix}.split: {self.split!r} is not like '98,1,1'") from None
        if len(vals) != 3 or any(v < 0 for v in vals) or sum(vals) <= 0:
            raise ConfigError(f"{prefix}.split: {self.split!r} is not like '98,1,1'")


OPTIMIZERS = ("adam", "muon")
MUON_SCALE_MODES = ("spectral", "unit_rms_norm", "shape_scaling")
MUON_TP_MODES = ("blockwise", "duplicated", "distributed")
MUON_FP32_MATMUL_PRECISIONS = ("highest", "high", "medium")


@dataclass
class OptimizerConfig:
    """The optimizer and the learning-rate schedule (megatron-core's ``OptimizerConfig`` names).

    ``name``: ``adam`` (AdamW everywhere) or ``muon`` (megatron-core's Muon for
    the attention/MLP matrices, AdamW for the rest; see
    :mod:`megatron_lol.training.optimizer`). The ``muon_*`` fields are read only
    with ``muon``; their defaults are megatron-core's. ``muon_adam_lr`` /
    ``muon_adam_min_lr``: the AdamW part's learning rates under Muon (default:
    ``lr`` / ``min_lr`` scaled alike).
    """

    name: str = "adam"
    lr: float = 3e-3
    min_lr: float = 3e-4
    weight_decay: float = 0.1
    adam_beta1: float = 0.9
    adam_beta2: float = 0.95
    adam_eps: float = 1e-8
    clip_grad: float = 1.0
    lr_decay_style: str = "cosine"  # cosine | WSD | linear | constant
    lr_warmup_iters: int = 0
    lr_wsd_decay_iters: Optional[int] = None
    lr_wsd_decay_style: str = "linear"
    muon_momentum: float = 0.95
    muon_split_qkv: bool = True  # orthogonalise Q, K and V of a fused linear_qkv separately
    muon_use_nesterov: bool = False
    muon_scale_mode: str = "spectral"  # spectral | unit_rms_norm | shape_scaling
    muon_fp32_matmul_prec: str = "medium"  # Newton-Schulz matmuls: medium = bf16
    muon_num_ns_steps: int = 5
    muon_tp_mode: str = "duplicated"  # duplicated (layout-independent) | blockwise | distributed
    muon_extra_scale_factor: float = 1.0
    muon_adam_lr: Optional[float] = None
    muon_adam_min_lr: Optional[float] = None

    def validate(self, prefix: str = "optimizer") -> None:
        choice(f"{prefix}.name", self.name, OPTIMIZERS)
        positive(f"{prefix}.lr", self.lr)
        nonnegative(f"{prefix}.min_lr", self.min_lr)
        if self.min_lr > self.lr:
            raise ConfigError(f"{prefix}.min_lr: {self.min_lr} is above lr={self.lr}")
        nonnegative(f"{prefix}.weight_decay", self.weight_decay)
        nonnegative(f"{prefix}.clip_grad", self.clip_grad)
        nonnegative(f"{prefix}.lr_warmup_iters", self.lr_warmup_iters)
        choice(f"{prefix}.lr_decay_style", self.lr_decay_style, ("cosine", "WSD", "linear", "constant"))
        choice(
            f"{prefix}.lr_wsd_decay_style", self.lr_wsd_decay_style, ("linear", "cosine", "exponential", "minus_sqrt")
        )
        if not (0 <= self.adam_beta1 < 1 and 0 <= self.adam_beta2 < 1):
            raise ConfigError(f"{prefix}.adam_beta1/adam_beta2: must be in [0, 1)")
        if not 0 <= self.muon_momentum < 1:
            raise ConfigError(f"{prefix}.muon_momentum: must be in [0, 1) (got {self.muon_momentum!r})")
        choice(f"{prefix}.muon_scale_mode", self.muon_scale_mode, MUON_SCALE_MODES)
        choice(f"{prefix}.muon_tp_mode", self.muon_tp_mode, MUON_TP_MODES)
        choice(f"{prefix}.muon_fp32_matmul_prec", self.muon_fp32_matmul_prec, MUON_FP32_MATMUL_PRECISIONS)
        if not isinstance(self.muon_num_ns_steps, int) or self.muon_num_ns_steps < 1:
            # megatron-core's TensorParallelMuon refuses fewer than one step
            raise ConfigError(f"{prefix}.muon_num_ns_steps: must be >= 1 (got {self.muon_num_ns_steps!r})")
        positive(f"{prefix}.muon_extra_scale_factor", self.muon_extra_scale_factor)
        if self.muon_adam_lr is not None:
            positive(f"{prefix}.muon_adam_lr", self.muon_adam_lr)
        if self.muon_adam_min_lr is not None:
            nonnegative(f"{prefix}.muon_adam_min_lr", self.muon_adam_min_lr)
            peak = self.lr if self.muon_adam_lr is None else self.muon_adam_lr
            if self.muon_adam_min_lr > peak:
                raise ConfigError(
                    f"{prefix}.muon_adam_min_lr: {self.muon_adam_min_lr} is above the AdamW peak learning rate {peak}"
                )


@dataclass
class TrainingConfig:
    """Loop, batch sizes, checkpoints and logging (Megatron-LM names)."""

    # optimizer steps; default 100 when neither this nor train_flops is given
    train_iters: Optional[int] = None
    # a training budget in FLOPs (e.g. 9.0e19) instead of train_iters: the trainer derives the iterations from
    # the FLOP model, growing depth included (perf/budget.py), and logs them; needs global_batch_size
    train_flops: Optional[float] = None
    micro_batch_size: int = 4
    global_batch_size: Optional[int] = None  # default: micro_batch_size x data parallel size
    seq_length: int = 256
    seed: int = 1234
    log_interval: int = 10
    eval_interval: int = 50
    eval_iters: int = 10
    eval_at_start: bool = False  # also evaluate the initial model (step 0), e.g. for a learning curve
    save: Optional[str] = None
    load: Optional[str] = None
    save_interval: Optional[int] = None
    keep_last: Optional[int] = None
    async_save: bool = False
    resume: bool = True
    exit_duration_in_mins: Optional[float] = None
    skip_nonfinite_steps: int = 0  # how many NaN/Inf steps may be skipped before stopping
    # stage changes (e.g. context extension) loading ``load`` when ``save`` has no checkpoint yet:
    load_iteration: Optional[int] = None  # which iteration of ``load`` (default: its tracker's)
    reset_optimizer: bool = False  # fresh optimizer state (Adam moments) instead of the loaded one
    reset_schedule: bool = False  # iteration, LR schedule and data position restart at 0
    metrics_file: Optional[str] = None  # default: <save>/metrics.jsonl
    # metric sinks beside metrics.jsonl (Megatron-LM's flags; megatron_lol/training/console.py)
    tensorboard_dir: Optional[str] = None  # TensorBoard event files go here
    tensorboard_log_interval: int = 1  # iterations between TensorBoard / W&B points
    wandb_project: Optional[str] = None  # W&B logging on when set (WANDB_MODE=offline: no network)
    wandb_exp_name: Optional[str] = None  # the W&B run name
    wandb_save_dir: Optional[str] = None  # default: <save>/wandb, else ./wandb
    verify_checksums: bool = True  # check checkpoint files against their checksums.json on load
    exit_interval: Optional[int] = None  # save and stop (status 0) at the first iteration divisible by it
    # on resume, a learning-rate / growth schedule that differs from the checkpoint's stops the run
    # unless one of these says which wins (Megatron-LM's flags)
    override_opt_param_scheduler: bool = False  # this run's schedule
    use_checkpoint_opt_param_scheduler: bool = False  # the checkpoint's schedule
    # Megatron-LM's --profile: iterations [profile_step_start, profile_step_end) (0-based) of the
    # ranks in profile_ranks; torch.profiler trace with use_pytorch_profiler (or without CUDA),
    # else an nsys capture range; NVTX ranges on CUDA (megatron_lol/training/tracing.py)
    profile: bool = False
    profile_step_start: int = 10
    profile_step_end: int = 12
    profile_ranks: list = field(default_factory=lambda: [0])
    use_pytorch_profiler: bool = False
    profile_dir: Optional[str] = None  # default: tensorboard_dir, else <save>/profile, else ./profile
    # compare the routing decisions across the tensor-parallel group every N iterations, before each routed
    # depth's blocks run (parallel/routing_agreement.py); None: every log_interval; 0: never
    check_routing_agreement: Optional[int] = None
    # Megatron-LM's --distributed-timeout-minutes: how long a collective waits for a rank that stopped
    # answering before the job stops (torch's own default is also 10 minutes; rank 0's dataset build
    # and a first save run under it, so a cluster with a slow file system raises it)
    distributed_timeout_minutes: int = 10
    # a rank that stops answering (SIGSTOP, a hung mount) ends the job after heartbeat_timeout seconds
    # (default: distributed_timeout_minutes), named in one line on every rank (training/heartbeat.py);
    # each rank beats every heartbeat_interval seconds through the rendezvous store (0: no heartbeat)
    heartbeat_interval: float = 5.0
    heartbeat_timeout: Optional[float] = None
    # a save that failed on any rank (disk full, an I/O error): stop with status 2, or continue training to the
    # next save; either way no rank moves the tracker and the previous checkpoint stays the latest
    on_save_failure: str = "stop"

    def validate(self, prefix: str = "training") -> None:
        if self.train_flops is not None:
            # one budget, as Megatron-LM takes --train-iters or --train-samples but not both: a run cannot be
            # held to a step count and a FLOP count at once
            positive(f"{prefix}.train_flops", self.train_flops)
            if self.train_iters is not None:
                raise ConfigError(
                    f"{prefix}.train_iters: {self.train_iters} cannot be combined with "
                    f"{prefix}.train_flops={self.train_flops:g} (the iterations are derived from "
                    f"the FLOP budget); drop one, e.g. --set {prefix}.train_flops=null"
                )
            if self.global_batch_size is None:
                raise ConfigError(
                    f"{prefix}.train_flops: needs {prefix}.global_batch_size (the iterations a "
                    f"FLOP budget buys would otherwise depend on the data-parallel size)"
                )
        elif self.train_iters is None:
            self.train_iters = 100
        if self.train_iters is not None:
            positive(f"{prefix}.train_iters", self.train_iters)
        positive(f"{prefix}.micro_batch_size", self.micro_batch_size)
        if self.global_batch_size is not None:
            positive(f"{prefix}.global_batch_size", self.global_batch_size)
            if self.global_batch_size % self.micro_batch_size:
                raise ConfigError(
                    f"{prefix}.global_batch_size: {self.global_batch_size} is not a multiple of "
                    f"micro_batch_size={self.micro_batch_size}"
                )
        positive(f"{prefix}.seq_length", self.seq_length)
        positive(f"{prefix}.log_interval", self.log_interval)
        positive(f"{prefix}.tensorboard_log_interval", self.tensorboard_log_interval)
        positive(f"{prefix}.eval_interval", self.eval_interval)
        nonnegative(f"{prefix}.eval_iters", self.eval_iters)
        if self.save_interval is not None:
            positive(f"{prefix}.save_interval", self.save_interval)
        if self.keep_last is not None:
            positive(f"{prefix}.keep_last", self.keep_last)
        nonnegative(f"{prefix}.skip_nonfinite_steps", self.skip_nonfinite_steps)
        if self.load_iteration is not None:
            nonnegative(f"{prefix}.load_iteration", self.load_iteration)
        if self.exit_interval is not None:
            positive(f"{prefix}.exit_interval", self.exit_interval)
        if self.override_opt_param_scheduler and self.use_checkpoint_opt_param_scheduler:
            raise ConfigError(
                f"{prefix}.override_opt_param_scheduler: cannot be combined with "
                f"use_checkpoint_opt_param_scheduler (pick which schedule wins)"
            )
        nonnegative(f"{prefix}.profile_step_start", self.profile_step_start)
        if self.profile_step_end <= self.profile_step_start:
            raise ConfigError(
                f"{prefix}.profile_step_end: {self.profile_step_end} must be larger than "
                f"profile_step_start={self.profile_step_start}"
            )
        if not self.profile_ranks or not all(
            isinstance(r, int) and not isinstance(r, bool) and r >= 0 for r in self.profile_ranks
        ):
            raise ConfigError(f"{prefix}.profile_ranks: must be a list of ranks >= 0 (got {self.profile_ranks!r})")
        if self.check_routing_agreement is not None:
            nonnegative(f"{prefix}.check_routing_agreement", self.check_routing_agreement)
        positive(f"{prefix}.distributed_timeout_minutes", self.distributed_timeout_minutes)
        nonnegative(f"{prefix}.heartbeat_interval", self.heartbeat_interval)
        if self.heartbeat_timeout is not None:
            positive(f"{prefix}.heartbeat_timeout", self.heartbeat_timeout)
        if self.heartbeat_interval and self.stall_timeout_seconds < 2 * self.heartbeat_interval:
            raise ConfigError(
                f"{prefix}.heartbeat_timeout: {self.stall_timeout_seconds:g} s must be at least twice "
                f"heartbeat_interval={self.heartbeat_interval:g} s (a rank misses beats while busy)"
            )
        choice(f"{prefix}.on_save_failure", self.on_save_failure, ("stop", "continue"))

    @property
    def stall_timeout_seconds(self) -> float:
        """Seconds without a rank's heartbeat before the job stops (heartbeat_timeout, else the
        collective timeout)."""
        return self.heartbeat_timeout if self.heartbeat_timeout is not None else 60.0 * self.distributed_timeout_minutes

    @property
    def routing_agreement_interval(self) -> int:
        """Iterations between routing-agreement checks (0: none)."""
        return self.log_interval if self.check_routing_agreement is None else self.check_routing_agreement


@dataclass
class ExperimentConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    curriculum: CurriculumConfig = field(default_factory=CurriculumConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    training: TrainingConfig = field(default_factory=TrainingConfig)

    def validate(self, check_data: bool = True) -> "ExperimentConfig":
        self.model.validate()
        self.curriculum.validate(self.model)
        self.parallel.validate(self.model)
        par, plan = self.parallel, self.model.execution_plan()
        check_pipeline_layout(
            self.model,
            plan.depth,
            par.pipeline_model_parallel_size,
            par.virtual_pipeline_model_parallel_size,
            plan.name,
            plan.pipeline_ok,
        )
        self.optimizer.validate()
        self.training.validate()
        windowed = any(step.attention != "full" for step in plan.steps())  # window, strided or sliding
        size = windows_of(self.model).size
        if windowed and size > self.training.seq_length:
            raise ConfigError(
                f"model.plan.windows.size: {size} is larger than training.seq_length="
                f"{self.training.seq_length} (a window must fit in a sequence)"
            )
        # a warm-up longer than the run is allowed (a smoke run of a long config): the run ends inside
        # it, and the trainer says so (training/optimizer.py, build_scheduler)
        tr = self.training
        multiple = fp8_row_multiple(self.model.precision.fp8_recipe)
        if self.model.precision.fp8 is not None and (tr.micro_batch_size * tr.seq_length) % multiple:
            raise ConfigError(
                f"training.seq_length: FP8 GEMMs ({self.model.precision.fp8_recipe}) need micro_batch_size x "
                f"seq_length = {tr.micro_batch_size * tr.seq_length} tokens in multiples of {multiple}"
            )
        if check_data:
            self.data.validate()
        return self

    def to_dict(self) -> dict:
        out = asdict(self)
        out["model"] = self.model.to_dict()
        return out


def bias_updates_allowed(step: int, train_iters: int, stop_fraction: float) -> bool:
    """The bias update after 0-based step ``t`` happens iff ``t < f * train_iters`` (docs/model.md,
    "Load balancing").

    Compared in exact rational arithmetic so that e.g. ``f = 0.966`` is the
    decimal the user wrote, not its binary approximation.
    """
    return Fraction(step) < Fraction(str(stop_fraction)) * train_iters
