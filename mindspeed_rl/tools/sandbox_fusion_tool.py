"""MindSpeed-RL's ``SandboxFusionTool``: runs the model's code on a SandboxFusion service, with the same config
keys (``configs/tools/*.yaml``: ``config:``) and the same text back to the model.

Our addition: ``sandbox_fusion_url: local`` runs Python on this host in :func:`mindspeed_rl.tools.sandbox.run_python`,
inside the wall of tools/wall.py (namespaces: no view of the host's files, processes or network), for a setup without
the service. Where no wall can be built the tool refuses to load, naming why, unless ``allow_unisolated: true`` (ours),
which runs the code unisolated with one warning.

Concurrency. ``num_workers`` is how many calls the rollout runs at once (its thread-pool size). ``rate_limit``
caps the runs in flight: with ``enable_global_rate_limit: true`` one semaphore shared by every such tool of this
process (sized by the first one built; MindSpeed-RL shares one Ray actor across the cluster instead, so with N
rollout processes the service here sees up to N x rate_limit runs), else a semaphore of this tool's own.
"""

from __future__ import annotations

import logging
import threading
from typing import Any

from mindspeed_rl.tools.base_tool import BaseTool
from mindspeed_rl.tools.sandbox import FAILED, FINISHED, SandboxRun, run_python
from mindspeed_rl.tools.sandbox_fusion import SUPPORTED_LANGUAGES, call_sandbox_fusion
from mindspeed_rl.tools.schemas import OpenAIFunctionToolSchema
from mindspeed_rl.tools.tool_config import ToolConfigCheck, rate_limit_slots

logger = logging.getLogger(__name__)

LOCAL_URL = "local"
# What the model is shown for a run that did not finish (MindSpeed-RL's text, whatever the reason).
NO_OUTPUT_TEXT = "no stdout here"
# MindSpeed-RL's defaults for keys a config leaves out; `sandbox_fusion_url` has none.
DEFAULTS: dict[str, Any] = {"num_workers": 10, "enable_global_rate_limit": True, "rate_limit": 10,
                            "default_timeout": 30, "default_language": "python", "memory_limit_mb": 1024,
                            "type": "native"}
# Ours: run `local` code without the wall where none can be built (never silently).
OUR_DEFAULTS: dict[str, Any] = {"allow_unisolated": False}
CONFIG_KEYS = frozenset(DEFAULTS) | frozenset(OUR_DEFAULTS) | {"sandbox_fusion_url"}


class SandboxFusionTool(BaseTool):
    """Runs the ``code`` argument (``timeout``/``language`` arguments optional) and answers its output."""

    def __init__(self, config: dict, tool_schema: OpenAIFunctionToolSchema | None) -> None:
        super().__init__(config, tool_schema)
        values = read_sandbox_config(self.config)
        self.sandbox_fusion_url: str = values["sandbox_fusion_url"]
        self.num_workers: int = values["num_workers"]
        self.rate_limit: int = values["rate_limit"]
        self.enable_global_rate_limit: bool = values["enable_global_rate_limit"]
        self.default_timeout: float = values["default_timeout"]
        self.default_language: str = values["default_language"]
        self.memory_limit_mb: int = values["memory_limit_mb"]
        self.isolated = self.sandbox_fusion_url != LOCAL_URL or local_wall(values["allow_unisolated"], self.name)
        self._slots = rate_limit_slots(kind="code", rate_limit=self.rate_limit, shared=self.enable_global_rate_limit,
                                       tool_name=self.name)

    def execute(self, instance_id: str, parameters: dict[str, Any], **kwargs: Any) -> tuple[str, float, dict]:
        code = parameters.get("code", "")
        run = self.run_code(code if isinstance(code, str) else str(code), self._timeout_of(parameters),
                            str(parameters.get("language", self.default_language)))
        return output_text(run), 0.0, {}

    def run_code(self, code: str, timeout_seconds: float, language: str) -> SandboxRun:
        """One run, waiting for a slot of the rate limit."""
        with self._slots:
            if self.sandbox_fusion_url != LOCAL_URL:
                return call_sandbox_fusion(self.sandbox_fusion_url, code, timeout_seconds=timeout_seconds,
                                           memory_limit_mb=self.memory_limit_mb, language=language)
            if language != "python":
                return SandboxRun(status=FAILED, stdout="", stderr=f"{LOCAL_URL} runs python only, not {language!r}",
                                  seconds=0.0)
            return run_python(code, timeout_seconds=timeout_seconds, memory_limit_mb=self.memory_limit_mb,
                              isolated=self.isolated)

    def _timeout_of(self, parameters: dict[str, Any]) -> float:
        # The model may ask for a shorter run than default_timeout, never a longer one: the argument is its text.
        asked = parameters.get("timeout")
        if isinstance(asked, (int, float)) and not isinstance(asked, bool) and 0 < asked < self.default_timeout:
            return float(asked)
        return self.default_timeout


def local_wall(allow_unisolated: bool, tool_name: str) -> bool:
    """Whether `local` runs inside the wall: yes where one can be built; else a ValueError naming why, or (with
    allow_unisolated) False and one warning."""
    from mindspeed_rl.tools.wall import wall_unavailable_reason

    reason = wall_unavailable_reason()
    if reason is None:
        return True
    if not allow_unisolated:
        raise ValueError(f"sandbox_fusion_url {LOCAL_URL!r}: no wall around the model's code can be built on this host "
                         f"({reason}); set allow_unisolated: true to run it unisolated, or use a SandboxFusion service")
    if not _warned_unisolated.is_set():
        _warned_unisolated.set()
        logger.warning("tool %s: the model's code runs UNISOLATED on this host (allow_unisolated: true): %s",
                       tool_name, reason)
    return False


_warned_unisolated = threading.Event()  # one warning per run


def output_text(run: SandboxRun) -> str:
    """What the model is shown: the output of a finished run, MindSpeed-RL's "no stdout here" otherwise."""
    return run.stdout + run.stderr if run.status == FINISHED else NO_OUTPUT_TEXT


def read_sandbox_config(config: dict[str, Any]) -> dict[str, Any]:
    """The config with defaults filled in, or a ValueError naming every bad or unknown key."""
    check = ToolConfigCheck(config, {**DEFAULTS, **OUR_DEFAULTS}, CONFIG_KEYS)
    values = check.values
    url = values.get("sandbox_fusion_url")
    if not isinstance(url, str) or not url.strip():
        check.problems.append(f"sandbox_fusion_url must be the service's run_code URL or {LOCAL_URL!r}, got {url!r}")
    check.positive_integers("num_workers", "rate_limit", "memory_limit_mb")
    check.positive_seconds("default_timeout")
    check.booleans("allow_unisolated", "enable_global_rate_limit")
    if values["default_language"] not in SUPPORTED_LANGUAGES:
        check.problems.append(f"default_language {values['default_language']!r} is none of "
                              f"{list(SUPPORTED_LANGUAGES)}")
    elif url == LOCAL_URL and values["default_language"] != "python":
        check.problems.append(f"sandbox_fusion_url {LOCAL_URL!r} runs python only, not {values['default_language']!r}")
    check.native_type()
    return check.result()
