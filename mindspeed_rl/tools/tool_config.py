"""A tool's `config:` mapping read the one way every tool here reads it: defaults filled in, unknown keys and bad
values collected, so that the tool raises one ValueError naming them all (tools/registry.py reports it at load)."""
from __future__ import annotations

from typing import Any


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
