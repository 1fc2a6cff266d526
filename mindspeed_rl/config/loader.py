"""From a Hydra/OmegaConf tree to a validated GRPOConfig, or every error of the tree at once.

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

from mindspeed_rl.errors import ConfigError, ConfigErrors, raise_together
from mindspeed_rl.config.dpo_recipe import lift_dpo_recipe
from mindspeed_rl.config.grpo import GRPOConfig
from mindspeed_rl.config.no_effect import drop_no_effect_keys, lift_megatron_keys
from mindspeed_rl.config.their_keys import their_key_errors
from mindspeed_rl.config.lora import lift_lora_keys
from mindspeed_rl.config.noop_layers import lift_noop_layers
from mindspeed_rl.config.removed import removed_key_errors

SCHEMA_NAME = "grpo_config_schema"
ACCELERATOR_CONFIG_NAME = "grpo_qwen25_7b_A3"
CPU_CONFIG_NAME = "grpo_tiny_cpu"


def load_config(
    cfg: Union[DictConfig, Mapping[str, Any]], *, notices: Optional[list[str]] = None
) -> GRPOConfig:
    """Every error of ``cfg`` at once, else the validated GRPOConfig. Raises ConfigError only.

    In order, each step reporting all it finds: MindSpeed-RL's keys of its own implementation (dropped,
    each as ``key (why)`` in ``notices``) and those it reads elsewhere (``no_effect.py``); its keys this
    engine does not have (with the reason, ``removed.py``); the schema (unknown keys, types, missing
    values); each section built on its own (its ``__post_init__``); then, once every section is valid,
    the checks across sections.
    """
    tree = _plain_tree(cfg)
    _dapo_without_reference(tree)
    dpo_notices: list[str] = []  # their DPO recipe's shape (config/dpo.py): its keys without a counterpart
    errors = (lift_dpo_recipe(tree, dpo_notices) + lift_megatron_keys(tree) + lift_lora_keys(tree)
              + lift_noop_layers(tree) + their_key_errors(tree))
    dropped, no_effect_errors = drop_no_effect_keys(tree, strict=_strict_keys(tree))
    errors += no_effect_errors
    if notices is not None:
        notices += dropped + dpo_notices
    errors += removed_key_errors(tree)
    for error in errors:
        _delete_key(tree, error.key)
    invalid_keys: list[str] = []  # keys whose value the schema refused (not merely unknown ones)
    merged = _merge_with_schema(tree, cfg, errors, invalid_keys)
    # A refused value was dropped from the tree, which leaves a required key missing: said once.
    missing = sorted(set(OmegaConf.missing_keys(merged)) - set(invalid_keys))
    errors += [ConfigError(key, f"missing required value (expected {_describe_type(_schema_type_at(key))})")
               for key in missing]
    errors += _section_errors(merged, cfg, skip=invalid_keys + missing)
    raise_together(errors)
    try:
        config = OmegaConf.to_object(merged)
    except OmegaConfBaseException as error:
        raise _as_config_error(error, cfg) from None
    assert isinstance(config, GRPOConfig)
    if notices is not None and config.profiler_config is not None:
        notices += config.profiler_config.integrated.notices()  # Ascend-profiler choices torch.profiler lacks
    return config


def _dapo_without_reference(tree: dict[str, Any]) -> None:
    """MindSpeed-RL's DAPO (stage ray_dapo) builds no reference and has no KL term whatever init_kl_coef's default
    (0.01, GRPO's) says: a ray_dapo recipe that does not set init_kl_coef gets 0 here, i.e. no reference."""
    training, rl = tree.get("megatron_training"), tree.get("rl_config")
    if isinstance(training, dict) and training.get("stage") == "ray_dapo" and (rl is None or isinstance(rl, dict)):
        tree.setdefault("rl_config", {}).setdefault("init_kl_coef", 0.0)


def _strict_keys(tree: dict[str, Any]) -> bool:
    runtime = tree.get("runtime")
    return isinstance(runtime, dict) and runtime.get("strict_keys") is True


# Each error of the schema step is found by one merge; a config has far fewer bad keys than this.
_MAX_SCHEMA_ERRORS = 200


def _plain_tree(cfg: Union[DictConfig, Mapping[str, Any]]) -> dict[str, Any]:
    """A mutable copy with interpolations kept as written (they resolve against the merged tree)."""
    node = cfg if isinstance(cfg, DictConfig) else OmegaConf.create(dict(cfg))
    tree = OmegaConf.to_container(node, resolve=False)
    assert isinstance(tree, dict)
    return tree


def _merge_with_schema(
    tree: dict[str, Any], cfg: Any, errors: list[ConfigError], invalid_keys: list[str]
) -> DictConfig:
    """Merge onto the schema, dropping each key the schema refuses (recorded in ``errors``; the mistyped
    ones also in ``invalid_keys``) and merging again, so that one run names every such key."""
    schema = OmegaConf.structured(GRPOConfig)
    for _ in range(_MAX_SCHEMA_ERRORS):
        try:
            return OmegaConf.merge(schema, tree)
        except OmegaConfBaseException as error:
            key = getattr(error, "full_key", "") or ""
            errors.append(_as_config_error(error, cfg))
            if not isinstance(error, ConfigKeyError):
                invalid_keys.append(key)
            if not _delete_key(tree, key):
                break
    raise ConfigErrors(errors)


def _section_errors(merged: DictConfig, cfg: Any, *, skip: list[str]) -> list[ConfigError]:
    """Build each top-level section alone, so that an error in one does not hide another's. A section
    with a refused or missing value is not built: with that key dropped it would report a consequence."""
    errors = []
    for name in merged:
        if any(key == name or key.startswith((f"{name}.", f"{name}[")) for key in skip):
            continue
        try:
            node = merged[name]
            if OmegaConf.is_config(node):
                OmegaConf.to_object(node)
        except ConfigError as error:
            errors.append(error)
        except OmegaConfBaseException as error:
            errors.append(_as_config_error(error, cfg))
    return errors


def _delete_key(tree: dict[str, Any], key: str) -> bool:
    """Remove ``a.b.c`` from the tree (a list element removes its whole list, so that the indices of the
    errors still to come stay right); False when there is nothing to remove."""
    parts = [part for part in key.split("[", 1)[0].split(".") if part]
    node: Any = tree
    for part in parts[:-1]:
        node = node.get(part) if isinstance(node, dict) else None
    if not parts or not isinstance(node, dict) or parts[-1] not in node:
        return False
    del node[parts[-1]]
    return True


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
