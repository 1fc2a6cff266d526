"""A tool turn of a multi-turn rollout: running a response's tool calls and the text appended after it, as
MindSpeed-RL's ``tools/utils/tool_utils.py`` (``process_response``, ``call_tool``, ``get_tool_response``).

The rollout stops a sample's turns itself (response length, ``max_tool_calls``); here, one turn's calls.
"""

from __future__ import annotations

import logging

from mindspeed_rl.registries import TRUNCATE_SIDES  # noqa: F401 (the names live below config/)
from mindspeed_rl.tools.base_tool import BaseTool
from mindspeed_rl.tools.parser import ToolCall

logger = logging.getLogger(__name__)
# Qwen's ChatML: the tool outputs come back as a user turn, then the assistant's turn starts again.
_TURN_START = "<|im_start|>user"
_TURN_END = "<|im_end|>\n<|im_start|>assistant\n"


def wrap_tool_output(text: str, *, max_length: int, truncate_side: str) -> str:
    """``text`` cut to ``max_length`` characters plus a marker, inside ``<tool_response>`` tags.

    The sides are MindSpeed-RL's: "left" keeps the first ``max_length`` characters ("...(truncated)" after them),
    "right" the last ones ("(truncated)..." before them), "middle" the first and last ``max_length // 2``
    ("...(truncated)..." between). With ``max_length`` 1 "middle" keeps no character (theirs, through
    ``text[-0:]``, would keep all of them).
    """
    if isinstance(max_length, bool) or not isinstance(max_length, int) or max_length <= 0:
        raise ValueError(f"max_length must be a positive integer, got {max_length!r}")
    if truncate_side not in TRUNCATE_SIDES:
        raise ValueError(f"truncate_side must be one of {list(TRUNCATE_SIDES)}, got {truncate_side!r}")
    if len(text) > max_length:
        if truncate_side == "left":
            text = text[:max_length] + "...(truncated)"
        elif truncate_side == "right":
            text = "(truncated)..." + text[-max_length:]
        else:
            half = max_length // 2
            text = text[:half] + "...(truncated)..." + text[len(text) - half:]
    return f"\n<tool_response>\n{text}\n</tool_response>"


def tool_turn_text(wrapped_outputs: list[str]) -> str:
    """The text appended to the sample after its tool calls: one user turn holding every wrapped output."""
    return _TURN_START + "".join(wrapped_outputs) + _TURN_END


def run_tool_calls(calls: list[ToolCall], tools: dict[str, BaseTool], *, max_parallel_calls: int,
                   max_length: int, truncate_side: str) -> list[str] | None:
    """The wrapped outputs of the first ``max_parallel_calls`` calls, run one after the other as MindSpeed-RL
    does (the rollout's parallelism is across samples); None when any of them names an unknown tool, raises
    or answers something other than text: MindSpeed-RL's rule, the sample's turn then ends without a tool
    response."""
    if isinstance(max_parallel_calls, bool) or not isinstance(max_parallel_calls, int) or max_parallel_calls <= 0:
        raise ValueError(f"max_parallel_calls must be a positive integer, got {max_parallel_calls!r}")
    outputs = []
    for call in calls[:max_parallel_calls]:
        text = _run_one(call, tools)
        if text is None:
            return None
        outputs.append(wrap_tool_output(text, max_length=max_length, truncate_side=truncate_side))
    return outputs


def _run_one(call: ToolCall, tools: dict[str, BaseTool]) -> str | None:
    tool = tools.get(call.name)
    if tool is None:
        logger.warning("tool call to unknown tool %r (tools: %s): the turn ends", call.name, sorted(tools))
        return None
    instance_id = None
    try:
        instance_id = tool.create()
        text, _, _ = tool.execute(instance_id, call.arguments)
        if not isinstance(text, str):
            raise TypeError(f"execute returned {type(text).__name__}, not the text shown to the model")
        return text
    except Exception as error:  # a user's tool may raise anything; the sample goes on without this turn
        logger.warning("tool %s failed: %s: %s: the turn ends", call.name, type(error).__name__, error)
        return None
    finally:
        if instance_id is not None:
            tool.release(instance_id)
