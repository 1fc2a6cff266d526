"""Tool calls in a response's text, in the Hermes format that Qwen's chat templates teach::

    <tool_call>{"name": "code_interpreter", "arguments": {"code": "print(1)"}}</tool_call>

As MindSpeed-RL's ``HermesToolParser`` (which decodes the response ids first; here the caller passes the text),
but in linear time: their lazy DOTALL regex rescans the rest of the text from every opening tag, quadratic in a
response of many openings without a close; this scan finds each tag once with str.find.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from typing import Any

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class ToolCall:
    """One call: the tool's name and the model's arguments (a JSON object)."""

    name: str
    arguments: dict[str, Any]


class HermesToolParser:
    """``<tool_call>{json}</tool_call>`` blocks, in order; a block that is not a call is skipped."""

    start_tag = "<tool_call>"
    end_tag = "</tool_call>"

    def extract_tool_calls(self, text: str) -> list[ToolCall]:
        """Every well-formed call of ``text``: a block is the text between an opening tag and the first closing
        tag after it (the regex's non-overlapping matches); one that is not JSON of a string ``name`` and an
        object ``arguments`` is skipped, logged at debug level."""
        calls: list[ToolCall] = []
        position = 0
        while True:
            start = text.find(self.start_tag, position)
            if start == -1:
                return calls
            body_start = start + len(self.start_tag)
            end = text.find(self.end_tag, body_start)
            if end == -1:
                return calls  # no closing tag after this opening, so none after any later one either
            call = _call_of(text[body_start:end])
            if call is not None:
                calls.append(call)
            position = end + len(self.end_tag)


def _call_of(body: str) -> ToolCall | None:
    try:
        data = json.loads(body)
    except (ValueError, RecursionError) as error:  # RecursionError: JSON nested deeper than the C stack allows
        logger.debug("tool call skipped, not JSON (%s): %.200s", type(error).__name__, body)
        return None
    if not (isinstance(data, dict) and isinstance(data.get("name"), str) and isinstance(data.get("arguments"), dict)):
        logger.debug("tool call skipped, not {\"name\": str, \"arguments\": object}: %.200s", body)
        return None
    return ToolCall(name=data["name"], arguments=data["arguments"])


TOOL_PARSERS: dict[str, type[HermesToolParser]] = {"hermes": HermesToolParser}
