"""The OpenAI function tool schema a tool config gives each tool (``tool_schema:``), as MindSpeed-RL reads it.

MindSpeed-RL validates it with pydantic models; here a frozen dataclass checked by hand, so a bad schema is
reported with the dotted field it lies at (``function.name: missing``) and every problem of it at once.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any


class ToolSchemaError(ValueError):
    """Every problem of one schema; ``problems`` holds (dotted field, message) pairs."""

    def __init__(self, problems: list[tuple[str, str]]) -> None:
        super().__init__("; ".join(f"{where}: {message}" for where, message in problems))
        self.problems = problems


def _empty_parameters() -> dict[str, Any]:
    return {"type": "object", "properties": {}, "required": []}


@dataclass(frozen=True)
class FunctionSchema:
    name: str
    description: str
    # A JSON schema of the arguments; kept as given (a copy) since it is shown to the model as is.
    parameters: dict[str, Any] = field(default_factory=_empty_parameters)
    strict: bool = False


@dataclass(frozen=True)
class OpenAIFunctionToolSchema:
    type: str
    function: FunctionSchema

    @classmethod
    def from_dict(cls, data: Any) -> OpenAIFunctionToolSchema:
        """The schema of a ``{type, function: {name, description, parameters}}`` mapping, or ToolSchemaError."""
        problems: list[tuple[str, str]] = []
        if not isinstance(data, Mapping):
            raise ToolSchemaError([("tool_schema", f"must be a mapping, got {type(data).__name__}")])
        _check_keys(data, "", {"type", "function"}, {"type", "function"}, problems)
        _check_str(data, "type", "type", problems)
        function = data.get("function")
        if function is not None and not isinstance(function, Mapping):
            problems.append(("function", f"must be a mapping, got {type(function).__name__}"))
        elif function is not None:
            _check_function(function, problems)
        if problems:
            raise ToolSchemaError(problems)
        parameters = copy.deepcopy(dict(function.get("parameters") or _empty_parameters()))
        return cls(type=data["type"], function=FunctionSchema(
            name=function["name"], description=function["description"], parameters=parameters,
            strict=bool(function.get("strict", False))))

    def to_dict(self) -> dict[str, Any]:
        """The schema as the chat template's ``tools=`` takes it."""
        function = self.function
        return {"type": self.type, "function": {"name": function.name, "description": function.description,
                                                "parameters": copy.deepcopy(function.parameters),
                                                "strict": function.strict}}


def _check_function(function: Mapping, problems: list[tuple[str, str]]) -> None:
    _check_keys(function, "function.", {"name", "description", "parameters", "strict"}, {"name", "description"},
                problems)
    _check_str(function, "name", "function.name", problems)
    _check_str(function, "description", "function.description", problems, allow_empty=True)
    if "strict" in function and not isinstance(function["strict"], bool):
        problems.append(("function.strict", f"must be true or false, got {function['strict']!r}"))
    parameters = function.get("parameters")
    if parameters is None:
        return
    if not isinstance(parameters, Mapping):
        problems.append(("function.parameters", f"must be a mapping, got {type(parameters).__name__}"))
        return
    # The three fields MindSpeed-RL's pydantic model requires of `parameters`; other JSON-schema keys may follow.
    _check_keys(parameters, "function.parameters.", None, {"type", "properties", "required"}, problems)
    _check_str(parameters, "type", "function.parameters.type", problems)
    if "properties" in parameters and not isinstance(parameters["properties"], Mapping):
        problems.append(("function.parameters.properties", "must be a mapping of argument name -> schema"))
    required = parameters.get("required", [])
    if not (isinstance(required, list) and all(isinstance(name, str) for name in required)):
        problems.append(("function.parameters.required", f"must be a list of argument names, got {required!r}"))


def _check_keys(data: Mapping, prefix: str, known: set[str] | None, required: set[str],
                problems: list[tuple[str, str]]) -> None:
    """Missing required keys, and keys outside ``known`` (None: any key may appear)."""
    for key in sorted(required - set(data)):
        problems.append((f"{prefix}{key}", "missing"))
    if known is None:
        return
    unknown = sorted(str(key) for key in set(data) - known)
    if unknown:
        problems.append((prefix.rstrip(".") or "tool_schema", f"unknown keys {unknown}; known: {sorted(known)}"))


def _check_str(data: Mapping, key: str, where: str, problems: list[tuple[str, str]],
               allow_empty: bool = False) -> None:
    if key not in data:
        return  # reported as missing by _check_keys where required
    value = data[key]
    if not isinstance(value, str) or (not allow_empty and not value.strip()):
        problems.append((where, f"must be a non-empty string, got {value!r}"))
