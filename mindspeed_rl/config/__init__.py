"""Typed, validated configuration of a GRPO run (MindSpeed-RL key names, plus our own sections).

Entry point: ``load_config(cfg)`` turns a Hydra-composed tree into a ``GRPOConfig`` or raises one
``ConfigError`` (a ``ConfigErrors`` when there are several) naming each full key and its offending value.
"""

from mindspeed_rl.errors import ConfigError, ConfigErrors, error_lines
from mindspeed_rl.config.generate import GenerateConfig, SamplingConfig
from mindspeed_rl.config.grpo import GRPOConfig
from mindspeed_rl.config.loader import (
    ACCELERATOR_CONFIG_NAME,
    CPU_CONFIG_NAME,
    SCHEMA_NAME,
    default_config_name,
    load_config,
    register_configs,
)
from mindspeed_rl.config.megatron import ActorConfig, MegatronTrainingConfig
from mindspeed_rl.config.model_arch import ModelArchConfig
from mindspeed_rl.config.model_check import check_model_block_against_hf
from mindspeed_rl.config.removed import REMOVED_KEYS
from mindspeed_rl.config.resources import ResourcePlan
from mindspeed_rl.config.role_sections import (
    ActorInferResources,
    ActorTrainResources,
    ReferenceResources,
    RewardResources,
    RoleResources,
)
from mindspeed_rl.config.device_mapping import parse_device_mapping
from mindspeed_rl.config.rl import IntegratedModeConfig, ResourceConfig, RLConfig
from mindspeed_rl.config.runtime import RuntimeConfig, SyntheticDataConfig

__all__ = [
    "ACCELERATOR_CONFIG_NAME",
    "REMOVED_KEYS",
    "CPU_CONFIG_NAME",
    "SCHEMA_NAME",
    "ActorConfig",
    "ActorInferResources",
    "ActorTrainResources",
    "ConfigError",
    "ConfigErrors",
    "GRPOConfig",
    "GenerateConfig",
    "IntegratedModeConfig",
    "MegatronTrainingConfig",
    "ModelArchConfig",
    "RLConfig",
    "ReferenceResources",
    "ResourceConfig",
    "ResourcePlan",
    "RewardResources",
    "RoleResources",
    "RuntimeConfig",
    "SamplingConfig",
    "SyntheticDataConfig",
    "check_model_block_against_hf",
    "default_config_name",
    "error_lines",
    "load_config",
    "parse_device_mapping",
    "register_configs",
]
