"""MindSpeed-RL's ``ReTool`` (``mindspeed_rl.tools.retool.ReTool``, the class path their
``configs/tools/retool_config.yaml`` names): the SandboxFusion code interpreter, with the model's code massaged
first as theirs does, since ReTool policies are trained against exactly that behaviour.
"""

from __future__ import annotations

from typing import Any

from mindspeed_rl.tools.sandbox_fusion_tool import SandboxFusionTool, output_text

_FENCE_OPEN = "```python"
_FENCE_CLOSE = "```"


def massage_code(code: str) -> str:
    """The code ReTool runs for the model's ``code`` argument.

    The first ```python ...``` block if there is one (stripped), then its last non-empty line wrapped in
    ``print(...)`` unless it starts with "print", so a trailing expression shows its value as in a notebook.
    As in MindSpeed-RL, only "" counts as empty and the line is wrapped as is (indentation included).
    """
    start = code.find(_FENCE_OPEN)
    if start != -1:
        # str.find, not their lazy DOTALL regex: the same first block, in linear time on many unclosed fences.
        end = code.find(_FENCE_CLOSE, start + len(_FENCE_OPEN))
        if end != -1:
            code = code[start + len(_FENCE_OPEN):end].strip()
    lines = code.split("\n")
    for index in range(len(lines) - 1, -1, -1):
        if lines[index] == "":
            continue
        if not lines[index].startswith("print"):
            lines[index] = f"print({lines[index]})"
        break
    return "\n".join(lines)


class ReTool(SandboxFusionTool):
    """The code interpreter of ReTool; a call without a ``code`` argument fails (the sample's turn ends)."""

    def execute(self, instance_id: str, parameters: dict[str, Any], **kwargs: Any) -> tuple[str, float, dict]:
        if "code" not in parameters:
            raise ValueError(f"{self.name}: call without a 'code' argument: {sorted(parameters)}")
        code = parameters["code"]
        code = massage_code(code if isinstance(code, str) else str(code))
        run = self.run_code(code, self._timeout_of(parameters),
                            str(parameters.get("language", self.default_language)))
        return output_text(run), 0.0, {}
