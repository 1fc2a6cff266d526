"""The interface of a tool, MindSpeed-RL's ``BaseTool``: a user's tool written for MindSpeed-RL subclasses this
one unchanged (the same constructor, ``name`` and create/execute/calc_reward/release methods).

A rollout calls, per tool call of a sample: ``instance_id = tool.create()``, ``tool.execute(instance_id,
arguments)``, then ``tool.release(instance_id)`` (:func:`mindspeed_rl.tools.turns.run_tool_calls`). Calls come
from several threads at once (one per sample in flight), so a tool's per-instance state must be thread-safe.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any
from uuid import uuid4

from mindspeed_rl.tools.schemas import OpenAIFunctionToolSchema

logger = logging.getLogger(__name__)


class BaseTool:
    """A tool the policy calls by ``name``; subclasses implement :meth:`execute`.

    ``tool_schema`` may be None when the subclass gives its own through :meth:`get_openai_tool_schema`
    (MindSpeed-RL's rule); a plain mapping is read with :meth:`OpenAIFunctionToolSchema.from_dict`.
    """

    def __init__(self, config: dict, tool_schema: OpenAIFunctionToolSchema | Mapping | None) -> None:
        self.config = dict(config or {})
        schema = tool_schema if tool_schema is not None else self.get_openai_tool_schema()
        if schema is None:
            raise ValueError(f"{type(self).__name__}: tool_schema is not set (none given, none of its own)")
        if isinstance(schema, Mapping):
            schema = OpenAIFunctionToolSchema.from_dict(schema)
        self.tool_schema: OpenAIFunctionToolSchema = schema
        self.name: str = schema.function.name
        logger.debug("tool %s (%s) with schema %s", self.name, type(self).__name__, schema.to_dict())

    def get_openai_tool_schema(self) -> OpenAIFunctionToolSchema | Mapping | None:
        """The schema this tool has without a config's ``tool_schema``: a class attribute ``tool_schema`` if any."""
        return getattr(type(self), "tool_schema", None)

    def create(self, instance_id: str | None = None, **kwargs: Any) -> str:
        """Start one use of the tool (one tool call of one sample); returns its id."""
        return instance_id if instance_id is not None else str(uuid4())

    def execute(self, instance_id: str, parameters: dict[str, Any], **kwargs: Any) -> tuple[str, float, dict]:
        """Run the call with the model's ``parameters``: (text shown to the model, step reward, metrics).

        MindSpeed-RL's base class answers "not implement" as if it were the tool's output; here a tool that
        does not implement it raises, so the model is not trained on that text (the turn ends instead).
        """
        raise NotImplementedError(f"{type(self).__name__}.execute is not implemented")

    def calc_reward(self, instance_id: str, **kwargs: Any) -> float:
        """A reward of the instance's calls, if the tool gives one (none by default)."""
        return 0.0

    def release(self, instance_id: str, **kwargs: Any) -> None:
        """Free what :meth:`create` holds for ``instance_id``."""
