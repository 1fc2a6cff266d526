"""Checks of multi-turn tool use (rl_config.multi_turn_enable and its keys, MindSpeed-RL's), across sections.

Off, its keys must keep their defaults: a tool limit that is set and then never read is a silent no-op. On, the
tool file must load (every problem of it reported at once), and the limits must be ones the rollout can honour.
"""
from __future__ import annotations

import dataclasses

from mindspeed_rl.errors import ConfigError, raise_together

_KEY = "rl_config"
# The keys read only with multi-turn on; off, each must keep its RLConfig default (MindSpeed-RL's).
_TOOL_KEYS = ("tool_config_path", "tool_parser_format", "max_tool_calls", "max_parallel_calls",
              "max_total_response_length", "max_tool_response_length", "tool_response_truncate_side")


def check_multi_turn(config) -> None:
    rl = config.rl_config
    if not rl.multi_turn_enable:
        defaults = {field.name: field.default for field in dataclasses.fields(rl)}
        raise_together([ConfigError(f"{_KEY}.{name}", "is read only with rl_config.multi_turn_enable: true; remove it "
                                                      "or enable multi-turn tool use")
                        for name in _TOOL_KEYS if getattr(rl, name) != defaults[name]])
        return
    raise_together(_limit_errors(config) + _combination_errors(config) + _tool_file_errors(rl.tool_config_path))


def _tool_file_errors(path) -> list[ConfigError]:
    """Every problem of the tools' YAML (it is loaded, the tools built, nothing connected to)."""
    from mindspeed_rl.tools.registry import load_tools

    if not path:
        return []  # _limit_errors names the missing key
    try:
        load_tools(path)
    except ConfigError as error:
        return error.all()
    return []


def _limit_errors(config) -> list[ConfigError]:
    from mindspeed_rl.registries import TOOL_PARSER_NAMES, TRUNCATE_SIDES

    rl, max_tokens = config.rl_config, config.generate_config.sampling_config.max_tokens
    errors = []
    if not rl.tool_config_path:
        errors.append(ConfigError(f"{_KEY}.tool_config_path", "must name the tools' YAML (MindSpeed-RL's format: "
                                                             "configs/tools/retool_config.yaml)"))
    if rl.tool_parser_format not in TOOL_PARSER_NAMES:
        errors.append(ConfigError(f"{_KEY}.tool_parser_format", f"must be one of {', '.join(TOOL_PARSER_NAMES)}, "
                                                               f"got {rl.tool_parser_format!r}"))
    if rl.tool_response_truncate_side not in TRUNCATE_SIDES:
        errors.append(ConfigError(f"{_KEY}.tool_response_truncate_side", f"must be one of {', '.join(TRUNCATE_SIDES)}, "
                                                                        f"got {rl.tool_response_truncate_side!r}"))
    for name, low in (("max_tool_calls", 0), ("max_parallel_calls", 1), ("max_tool_response_length", 1)):
        if getattr(rl, name) < low:
            errors.append(ConfigError(f"{_KEY}.{name}", f"must be >= {low}, got {getattr(rl, name)}"))
    # MindSpeed-RL's own check: the first turn may use all of sampling_config.max_tokens.
    if rl.max_total_response_length < max_tokens:
        errors.append(ConfigError(f"{_KEY}.max_total_response_length", f"must be >= generate_config.sampling_config."
                                                                       f"max_tokens={max_tokens}, got "
                                                                       f"{rl.max_total_response_length}"))
    return errors


def _combination_errors(config) -> list[ConfigError]:
    errors = []
    if config.rl_config.adv_estimator == "gae":
        errors.append(ConfigError(f"{_KEY}.multi_turn_enable", "is not implemented with a critic (adv_estimator gae): "
                                                              "its value targets would span the tool outputs"))
    if config.rollout_staleness:
        errors.append(ConfigError(f"{_KEY}.multi_turn_enable", "needs rollouts on the current policy: each turn waits "
                                                              "for the tools, so a rollout cannot run ahead "
                                                              "(async_generation_ratio must be 0)"))
    return errors
