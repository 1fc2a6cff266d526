"""MindSpeed-RL keys that this engine does not have, and why.

Users bring MindSpeed-RL YAMLs; a key that would be accepted and then do nothing is worse than an
error, so these are not in the schema. The loader looks for them before the schema does, so the
message says why instead of only "unknown key". `*` stands for any one key (a model block's name).
"""

from collections.abc import Mapping
from typing import Any

from omegaconf.errors import OmegaConfBaseException

from mindspeed_rl.errors import ConfigError

_INTEGRATED = (
    "in integrated mode (rl_config.use_integrated_worker, the only mode of this hybrid engine) the "
    "reference and reward models reuse actor_config"
)

REMOVED_KEYS: dict[str, str] = {
    "ref_config": _INTEGRATED,
    "reward_config": _INTEGRATED,
}


def removed_key_errors(cfg: Mapping[str, Any]) -> list[ConfigError]:
    """A ConfigError ``<key>: not supported: <reason>; remove it`` for every removed key present."""
    return [
        ConfigError(key, f"not supported: {reason}; remove it")
        for pattern, reason in REMOVED_KEYS.items()
        for key in present_keys(cfg, pattern.split("."))
    ]


def present_keys(node: Any, parts: list[str], prefix: str = "") -> list[str]:
    """The dotted keys of ``node`` that match ``parts`` (``*`` matches any one name)."""
    if not isinstance(node, Mapping):
        return []
    head, rest = parts[0], parts[1:]
    names = [str(name) for name in node] if head == "*" else ([head] if head in node else [])
    found = []
    for name in names:
        key = f"{prefix}.{name}" if prefix else name
        # A leaf is found by its presence alone: its value may be missing (???) or an interpolation.
        found += [key] if not rest else present_keys(_child(node, name), rest, key)
    return found


def _child(node: Mapping[str, Any], name: str) -> Any:
    try:
        return node[name]
    except OmegaConfBaseException:
        return None  # an unresolvable section: the schema step reports it
