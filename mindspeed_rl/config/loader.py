"""From a Hydra/OmegaConf tree to a validated GRPOConfig, with every error as one ConfigError.

The schema is ``OmegaConf.structured(GRPOConfig)``. kw_only dataclasses work with it (checked with
omegaconf 2.3): ``structured()`` reads ``dataclasses.fields`` and ``to_object()`` constructs with
keyword arguments only, so field order and kw_only do not matter and every ``__post_init__`` runs.
"""

import importlib.util
import os
import re
import typing
from collections.abc import Mapping
from dataclasses import fields, is_dataclass
from typing import Any, Optional, Union

from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import (
    ConfigKeyError,
    InterpolationResolutionError,
    MissingMandatoryValue,
    OmegaConfBaseException,
    ValidationError,
)

from mindspeed_rl.config.errors import ConfigError
from mindspeed_rl.config.grpo import GRPOConfig
from mindspeed_rl.config.removed import check_removed_keys

SCHEMA_NAME = "grpo_config_schema"
ACCELERATOR_CONFIG_NAME = "grpo_qwen25_7b_A3"
CPU_CONFIG_NAME = "grpo_tiny_cpu"


def load_config(cfg: Union[DictConfig, Mapping[str, Any]]) -> GRPOConfig:
    """Reject MindSpeed-RL keys this engine does not have (with the reason, ``removed.py``), check
    ``cfg`` against the schema (unknown keys, types, missing values), then build the dataclasses so
    that every section and cross-section check runs. Raises ConfigError only."""
    check_removed_keys(cfg)
    try:
        merged = OmegaConf.merge(OmegaConf.structured(GRPOConfig), cfg)
        config = OmegaConf.to_object(merged)
    except OmegaConfBaseException as error:
        raise _as_config_error(error, cfg) from None
    assert isinstance(config, GRPOConfig)
    return config


def register_configs() -> None:
    """Store the schema in Hydra's ConfigStore as ``grpo_config_schema`` (for tools that want
    Hydra-side typing). The shipped YAMLs deliberately do not list it in their defaults: Hydra would
    then reject bad values with its own messages and exit code, before load_config can name the key."""
    from hydra.core.config_store import ConfigStore

    ConfigStore.instance().store(name=SCHEMA_NAME, node=GRPOConfig)


def default_config_name() -> str:
    """The 7B recipe where an accelerator is present, the tiny CPU demo elsewhere."""
    return ACCELERATOR_CONFIG_NAME if accelerator_present() else CPU_CONFIG_NAME


def accelerator_present() -> bool:
    if importlib.util.find_spec("torch_npu") is not None:
        return True
    # `import torch` costs seconds, which `--help` and config errors should not pay; without a GPU
    # driver on the host CUDA (or ROCm) cannot be available anyway.
    if not any(os.path.exists(path) for path in ("/proc/driver/nvidia", "/dev/nvidiactl", "/dev/kfd")):
        return False
    import torch

    return torch.cuda.is_available()


def _as_config_error(error: OmegaConfBaseException, cfg: Any) -> ConfigError:
    key = getattr(error, "full_key", None) or "<root>"
    first_line = str(error).splitlines()[0] if str(error) else type(error).__name__
    if isinstance(error, ConfigKeyError):
        parent = key.rsplit(".", 1)[0] if "." in key else ""
        valid = _field_names(_schema_type_at(parent))
        where = f"valid keys of {parent}" if parent else "valid top-level keys"
        return ConfigError(key, f"unknown key ({where}: {', '.join(valid)})")
    expected = _describe_type(_schema_type_at(key))
    if isinstance(error, MissingMandatoryValue):
        return ConfigError(key, f"missing required value (expected {expected})")
    if isinstance(error, InterpolationResolutionError):
        return ConfigError(key, f"cannot resolve interpolation: {first_line}")
    if isinstance(error, ValidationError):
        value = _select_quietly(cfg, key)
        got = f"{value!r} ({type(value).__name__})" if value is not _NOT_FOUND else first_line
        return ConfigError(key, f"expected {expected}, got {got}")
    return ConfigError(key, first_line)


_NOT_FOUND = object()


def _select_quietly(cfg: Any, key: str) -> Any:
    """The user's value at ``key`` for the error message, or _NOT_FOUND."""
    try:
        root = cfg if isinstance(cfg, DictConfig) else OmegaConf.create(cfg)
        node = OmegaConf.select(root, key, default=_NOT_FOUND, throw_on_resolution_failure=False)
    except OmegaConfBaseException:
        return _NOT_FOUND
    return OmegaConf.to_container(node) if OmegaConf.is_config(node) else node


def _schema_type_at(path: str) -> Optional[Any]:
    """The annotated type at a dotted path of the schema (``a.b[0]`` style), or None if unknown."""
    current: Any = GRPOConfig
    for part in re.findall(r"[^.\[\]]+", path):
        current = _strip_optional(current)
        if is_dataclass(current):
            hints = typing.get_type_hints(current)
            if part not in hints:
                return None
            current = hints[part]
        elif typing.get_origin(current) is dict:
            current = typing.get_args(current)[1]
        elif typing.get_origin(current) is list:
            current = typing.get_args(current)[0]
        else:
            return None
    return current


def _strip_optional(annotation: Any) -> Any:
    if typing.get_origin(annotation) is Union:
        non_none = [arg for arg in typing.get_args(annotation) if arg is not type(None)]
        if len(non_none) == 1:
            return non_none[0]
    return annotation


def _field_names(annotation: Optional[Any]) -> list[str]:
    annotation = _strip_optional(annotation)
    return [f.name for f in fields(annotation)] if is_dataclass(annotation) else []


def _describe_type(annotation: Optional[Any]) -> str:
    if annotation is None:
        return "a valid value"
    inner = _strip_optional(annotation)
    if inner is not annotation:
        return f"{_describe_type(inner)} or null"
    origin = typing.get_origin(annotation)
    if origin is list:
        return f"a list of {_describe_type(typing.get_args(annotation)[0])}"
    if origin is dict:
        return f"a mapping of names to {_describe_type(typing.get_args(annotation)[1])}"
    if is_dataclass(annotation):
        return f"a mapping ({annotation.__name__})"
    return getattr(annotation, "__name__", str(annotation))
