"""Typed experiment configuration loaded from YAML (see :mod:`.schema`)."""

from megatron_lol.config.loader import add_config_arguments, config_from_args, config_from_dict, load_config
from megatron_lol.config.schema import (
    ConfigError,
    CurriculumConfig,
    DataConfig,
    ExperimentConfig,
    ModelConfig,
    OptimizerConfig,
    ParallelConfig,
    TrainingConfig,
    bias_updates_allowed,
)

__all__ = [
    "add_config_arguments",
    "config_from_args",
    "config_from_dict",
    "load_config",
    "ConfigError",
    "CurriculumConfig",
    "DataConfig",
    "ExperimentConfig",
    "ModelConfig",
    "OptimizerConfig",
    "ParallelConfig",
    "TrainingConfig",
    "bias_updates_allowed",
]
