"""Tools from a tool config file in MindSpeed-RL's format (``rl_config.tool_config_path``)::

    tools:
      - class_name: mindspeed_rl.tools.retool.ReTool   # any importable BaseTool subclass
        config: {...}                                   # the class's own keys
        tool_schema: {type: function, function: {name, description, parameters}}

Every problem of the file is reported at once (a ConfigErrors), each as ``rl_config.tool_config_path: <file>:
tools[i].<field>: <problem>``. Building the tools of this package connects to nothing: a service is first
called by a tool call.
"""

from __future__ import annotations

import importlib
import os
from collections.abc import Callable, Mapping
from typing import Any

from mindspeed_rl.errors import ConfigError, raise_together
from mindspeed_rl.tools.base_tool import BaseTool
from mindspeed_rl.tools.schemas import OpenAIFunctionToolSchema, ToolSchemaError

CONFIG_KEY = "rl_config.tool_config_path"
ITEM_KEYS = frozenset({"class_name", "config", "tool_schema"})
# Reports one problem: (where in the file, e.g. "tools[0].class_name"; what is wrong).
Report = Callable[[str, str], None]


def load_tools(path: str) -> dict[str, BaseTool]:
    """tool name -> tool, for every tool of the file at ``path``; ConfigError(s) for everything wrong in it."""
    errors: list[ConfigError] = []

    def problem(where: str, message: str) -> None:
        errors.append(ConfigError(CONFIG_KEY, f"{path}: {where}: {message}" if where else f"{path}: {message}"))

    items = _read_items(path, problem)
    tools: dict[str, BaseTool] = {}
    first_index: dict[str, int] = {}
    for index, item in enumerate(items):
        tool = _build(item, f"tools[{index}]", problem)
        if tool is None:
            continue
        if tool.name in tools:
            problem(f"tools[{index}].tool_schema.function.name",
                    f"duplicate tool name {tool.name!r} (also tools[{first_index[tool.name]}])")
            continue
        tools[tool.name], first_index[tool.name] = tool, index
    raise_together(errors)
    return tools


def _read_items(path: str, problem: Report) -> list[Any]:
    """The file's ``tools:`` list (resolved as MindSpeed-RL's OmegaConf.load does), or [] after a problem."""
    from omegaconf import OmegaConf  # hydra's dependency; imported here so `tools` stays light to import

    if not os.path.isfile(path):
        problem("", "no such file")
        return []
    try:
        tree = OmegaConf.to_container(OmegaConf.load(path), resolve=True)
    except Exception as error:  # OmegaConf's YAML and interpolation errors have no common base
        problem("", f"cannot read: {type(error).__name__}: {error}")
        return []
    if not isinstance(tree, Mapping) or "tools" not in tree:
        problem("", "must be a mapping with a 'tools:' list")
        return []
    if not isinstance(tree["tools"], list) or not tree["tools"]:
        problem("tools", f"must be a non-empty list of tools, got {tree['tools']!r}")
        return []
    return tree["tools"]


def _build(item: Any, where: str, problem: Report) -> BaseTool | None:
    """The tool of one ``tools:`` item, or None after reporting what is wrong with it."""
    if not isinstance(item, Mapping):
        problem(where, f"must be a mapping with class_name, config and tool_schema, got {item!r}")
        return None
    unknown = sorted(str(key) for key in set(item) - ITEM_KEYS)
    if unknown:
        problem(where, f"unknown keys {unknown}; known: {sorted(ITEM_KEYS)}")
    tool_class = _tool_class(item.get("class_name"), f"{where}.class_name", problem)
    schema = _schema(item.get("tool_schema"), f"{where}.tool_schema", problem)
    config = item.get("config", {})
    if config is None or not isinstance(config, Mapping):
        problem(f"{where}.config", f"must be a mapping of the tool's settings, got {config!r}")
        return None
    if tool_class is None or schema is False or unknown:
        return None
    try:
        return tool_class(config=dict(config), tool_schema=schema)
    except (ValueError, TypeError) as error:  # by convention, what a tool says of its config
        problem(f"{where}.config", str(error))
    except Exception as error:
        problem(where, f"building {item['class_name']} failed: {type(error).__name__}: {error}")
    return None


def _tool_class(class_name: Any, where: str, problem: Report) -> type[BaseTool] | None:
    if not isinstance(class_name, str) or "." not in class_name:
        problem(where, "missing" if class_name is None else f"must be a dotted module.Class path, got {class_name!r}")
        return None
    module_name, _, attribute = class_name.rpartition(".")
    try:
        module = importlib.import_module(module_name)
    except ImportError as error:
        problem(where, f"cannot import {class_name} ({error})")
        return None
    except Exception as error:  # the module itself fails while importing
        problem(where, f"cannot import {class_name} ({type(error).__name__}: {error})")
        return None
    tool_class = getattr(module, attribute, None)
    if tool_class is None:
        problem(where, f"cannot import {class_name} (module {module_name} has no attribute {attribute!r})")
        return None
    if not (isinstance(tool_class, type) and issubclass(tool_class, BaseTool)):
        problem(where, f"{class_name} is not a subclass of {BaseTool.__module__}.{BaseTool.__qualname__}")
        return None
    return tool_class


def _schema(data: Any, where: str, problem: Report) -> OpenAIFunctionToolSchema | None | bool:
    """The item's schema; None when it has none (the class then gives its own); False after a problem."""
    if data is None:
        return None
    try:
        return OpenAIFunctionToolSchema.from_dict(data)
    except ToolSchemaError as error:
        for field, message in error.problems:
            problem(f"{where}.{field}" if field != "tool_schema" else where, message)
        return False
