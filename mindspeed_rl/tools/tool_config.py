"""A tool's `config:` mapping read the one way every tool here reads it: defaults filled in, unknown keys and bad
values collected, so that the tool raises one ValueError naming them all (tools/registry.py reports it at load)."""
from __future__ import annotations

import logging
import threading
from typing import Any

logger = logging.getLogger(__name__)
# enable_global_rate_limit: one semaphore per kind of tool in this process, sized by the first such tool built.
_SHARED_SLOTS: dict[str, threading.BoundedSemaphore] = {}
_SHARED_SIZES: dict[str, int] = {}
_SHARED_LOCK = threading.Lock()


def rate_limit_slots(*, kind: str, rate_limit: int, shared: bool, tool_name: str) -> threading.BoundedSemaphore:
    """The slots a tool's calls wait for (MindSpeed-RL's `rate_limit`): with `enable_global_rate_limit` (`shared`)
    the one semaphore of every tool of this `kind` in this process, else one of the tool's own."""
    if not shared:
        return threading.BoundedSemaphore(rate_limit)
    with _SHARED_LOCK:
        if kind not in _SHARED_SLOTS:
            _SHARED_SLOTS[kind], _SHARED_SIZES[kind] = threading.BoundedSemaphore(rate_limit), rate_limit
        elif _SHARED_SIZES[kind] != rate_limit:
            logger.warning("tool %s: rate_limit %d ignored: the global rate limit of this process's %s tools is %d "
                           "(set by the first one built)", tool_name, rate_limit, kind, _SHARED_SIZES[kind])
        return _SHARED_SLOTS[kind]


class ToolConfigCheck:
    """`values`: the config over `defaults`; `problems`: what is wrong so far. The checks append to `problems`;
    `result()` returns the values or raises."""

    def __init__(self, config: dict[str, Any], defaults: dict[str, Any], known: frozenset[str]) -> None:
        self.problems: list[str] = []
        unknown = sorted(str(key) for key in set(config) - known)
        if unknown:
            self.problems.append(f"unknown keys {unknown}; known: {sorted(known)}")
        self.values = {**defaults, **{key: value for key, value in config.items() if key in known}}

    def positive_integers(self, *keys: str) -> None:
        for key in keys:
            value = self.values[key]
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                self.problems.append(f"{key} must be a positive integer, got {value!r}")

    def positive_seconds(self, key: str) -> None:
        value = self.values[key]
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < float("inf"):
            self.problems.append(f"{key} must be a positive number of seconds, got {value!r}")

    def booleans(self, *keys: str) -> None:
        for key in keys:
            if not isinstance(self.values[key], bool):
                self.problems.append(f"{key} must be true or false, got {self.values[key]!r}")

    def native_type(self) -> None:
        if self.values["type"] != "native":
            self.problems.append(f"type must be 'native' (MCP tools are not supported), got {self.values['type']!r}")

    def result(self) -> dict[str, Any]:
        if self.problems:
            raise ValueError("; ".join(self.problems))
        return self.values
