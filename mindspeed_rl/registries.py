"""The names each feature answers to, below config/: the config checks validate against them, and the package that
implements a feature imports its names from here (and checks at import that it implements exactly these). Pure: no
torch, no model, no tokenizer.
"""
from __future__ import annotations

import functools
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import yaml

from mindspeed_rl.errors import ConfigError

# Rule verifiers (data/rewards.py implements each; MindSpeed-RL's names).
VERIFIER_NAMES = ("arith_acc", "acc", "base_acc", "math_verify_reward", "math_17k_acc", "acc_for_ppo", "acc_for_dapo",
                  "format", "strict_format", "step", "retool_reward")
# Multi-turn tool use (tools/parser.py, tools/turns.py).
TOOL_PARSER_NAMES = ("hermes",)
TRUNCATE_SIDES = ("left", "right", "middle")
# Prompts longer than rl_config.max_prompt_length: dropped and counted, or an error (data/dataset.py).
OVERLONG_CHOICES = ("filter", "error")
# rewards.<name>.model_path naming the generated tiny reward model (data/tiny_reward_model.py).
SYNTHETIC_REWARD_MODEL = "synthetic"
# distillation.teacher_models.<name>.model_path naming the demo's teacher (trainer/teacher.py).
SYNTHETIC_TEACHER = "synthetic"

# -- prompt templates (data/templates.py renders them) ------------------------------------------------------------
TEMPLATES_FILE = Path(__file__).resolve().parents[1] / "configs" / "prompt_templates.yaml"
CHAT_PROMPT_TYPE = "chat"
PROMPT_TYPE_KEY = "megatron_training.prompt_type"
TEMPLATE_FIELDS = ("user", "system", "assistant", "separator", "default_system")


@functools.cache
def template_entries() -> dict[str, dict[str, Any]]:
    """configs/prompt_templates.yaml: template name -> its fields (checked: known fields, `chat` reserved)."""
    try:
        entries = yaml.safe_load(TEMPLATES_FILE.read_text(encoding="utf-8"))
    except (OSError, yaml.YAMLError) as error:
        raise ConfigError(PROMPT_TYPE_KEY, f"cannot read the templates file {TEMPLATES_FILE}: {error}") from None
    for name, fields in entries.items():
        unknown = sorted(set(fields) - set(TEMPLATE_FIELDS))
        if unknown:
            raise ConfigError(PROMPT_TYPE_KEY, f"template {name!r} in {TEMPLATES_FILE}: unknown fields {unknown}; "
                                               f"known: {', '.join(TEMPLATE_FIELDS)}")
    if CHAT_PROMPT_TYPE in entries:
        raise ConfigError(PROMPT_TYPE_KEY, f"{TEMPLATES_FILE} must not define {CHAT_PROMPT_TYPE!r} (reserved)")
    return entries


def known_prompt_types() -> list[str]:
    """``chat`` and every template of ``configs/prompt_templates.yaml``, sorted."""
    return sorted([CHAT_PROMPT_TYPE, *template_entries()])


def check_prompt_type(prompt_type: str, *, key: str = PROMPT_TYPE_KEY) -> None:
    """A ConfigError naming the known types unless ``prompt_type`` is one of them."""
    if prompt_type != CHAT_PROMPT_TYPE and prompt_type not in template_entries():
        raise ConfigError(
            key, f"unknown template {prompt_type!r}; known: {', '.join(known_prompt_types())} "
                 f"(named templates live in {TEMPLATES_FILE})"
        )


# -- a dataset row's fields (data/dataset.py reads them) --------------------------------------------------------
MAP_KEYS_FIELDS = ("prompt", "labels", "system")
MAP_KEYS_KEY = "megatron_training.map_keys"


def resolve_map_keys(map_keys: Mapping[str, str], *, key: str = MAP_KEYS_KEY) -> dict[str, str]:
    """``{prompt, labels[, system]}`` -> dotted row paths. MindSpeed-RL's spellings are accepted: its
    ``response`` is our ``labels``; its empty ``query``/``system`` mean "not used"."""
    if not isinstance(map_keys, Mapping):
        raise ConfigError(key, f"expected a mapping like {{prompt: problem, labels: answer}}, got {map_keys!r}")
    fields = {str(name): value for name, value in map_keys.items()}
    for name, value in fields.items():
        if not isinstance(value, str):
            raise ConfigError(f"{key}.{name}", f"expected a (dotted) field name string, got {value!r}")
    if fields.get("response"):
        if fields.get("labels"):
            raise ConfigError(key, "give the label field once: 'labels' (or MindSpeed-RL's 'response'), not both")
        fields["labels"] = fields["response"]
    fields.pop("response", None)
    if fields.pop("query", ""):
        raise ConfigError(f"{key}.query", "not supported: prompts come from one field (map 'prompt'); leave it empty")
    unknown = sorted(set(fields) - set(MAP_KEYS_FIELDS))
    if unknown:
        raise ConfigError(key, f"unknown fields {unknown}; known: {', '.join(MAP_KEYS_FIELDS)}")
    for required in ("prompt", "labels"):
        if not fields.get(required):
            raise ConfigError(f"{key}.{required}", "required: the row field (dotted path for nested) holding it")
    return {name: value for name, value in fields.items() if value}
