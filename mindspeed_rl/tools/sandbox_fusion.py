"""A client of the SandboxFusion service's ``run_code`` HTTP API, as MindSpeed-RL calls it
(``tools/utils/tool_utils.py: call_sandbox_api``): the same JSON payload, compile and run timeouts both
``timeout_seconds``, a request timeout of their sum + 10 s, and up to 3 attempts when the service answers 504
(Gateway Timeout, its sign of a full queue) with 1 s then 2 s waits between them.

Unlike MindSpeed-RL it needs no ``requests`` (urllib), and it never raises for a network or service problem: the
run is "Failed" with the reason in ``stderr``, which the tool shows the model as a failed run.
"""

from __future__ import annotations

import http.client
import json
import logging
import time
import urllib.error
import urllib.request
from typing import Any

from mindspeed_rl.tools.sandbox import FAILED, STATUSES, SandboxRun

logger = logging.getLogger(__name__)

# The languages SandboxFusion runs (MindSpeed-RL's SUPPORTED_LANGUAGES): another is refused before any request.
SUPPORTED_LANGUAGES = (
    "python", "cpp", "nodejs", "go", "go_test", "java", "php", "csharp", "bash", "typescript", "sql", "rust",
    "cuda", "lua", "R", "perl", "D_ut", "ruby", "scala", "julia", "pytest", "junit", "kotlin_script", "jest",
    "verilog", "python_gpu", "lean", "swift", "racket",
)
REQUEST_TIMEOUT_MARGIN_SECONDS = 10.0
RETRY_WAITS_SECONDS = (1.0, 2.0)  # after the 1st and 2nd 504: 3 attempts in all
# A response is JSON of two outputs the service itself caps; more than this is not a SandboxFusion answer.
MAX_RESPONSE_BYTES = 64 * 1024 * 1024


def call_sandbox_fusion(url: str, code: str, *, timeout_seconds: float, memory_limit_mb: int,
                        language: str) -> SandboxRun:
    """Run ``code`` on the SandboxFusion service at ``url`` (its ``/run_code`` endpoint): the service's
    ``run_result`` (status, stdout, stderr), or a "Failed" run saying why there is none."""
    start = time.monotonic()
    if language not in SUPPORTED_LANGUAGES:
        return _failed(f"unsupported language {language!r}; SandboxFusion runs {list(SUPPORTED_LANGUAGES)}", start)
    payload = json.dumps({
        "compile_timeout": timeout_seconds, "run_timeout": timeout_seconds, "code": code, "stdin": None,
        "memory_limit_MB": memory_limit_mb, "language": language, "files": {}, "fetch_files": [],
    }).encode("utf-8")
    request_timeout = 2 * timeout_seconds + REQUEST_TIMEOUT_MARGIN_SECONDS
    answer, error = _post_with_retries(url, payload, request_timeout)
    if error is not None:
        logger.warning("SandboxFusion call to %s failed: %s", url, error)
        return _failed(error, start)
    return _run_of(answer, start)


def _post_with_retries(url: str, payload: bytes, request_timeout: float) -> tuple[Any, str | None]:
    """(the parsed JSON answer, None), or (None, why there is none)."""
    request = urllib.request.Request(url, data=payload, method="POST", headers={
        "Content-Type": "application/json", "Accept": "application/json"})
    attempts = len(RETRY_WAITS_SECONDS) + 1
    for attempt in range(attempts):
        try:
            with urllib.request.urlopen(request, timeout=request_timeout) as response:
                body = response.read(MAX_RESPONSE_BYTES + 1)
        except urllib.error.HTTPError as error:
            error.close()
            if error.code != 504:
                return None, f"SandboxFusion answered HTTP {error.code} {error.reason}"
            if attempt + 1 < attempts:
                time.sleep(RETRY_WAITS_SECONDS[attempt])
            continue
        # URLError, refused, reset, timeout (OSError); a cut-off answer (HTTPException); a malformed URL (ValueError)
        except (OSError, http.client.HTTPException, ValueError) as error:
            return None, f"cannot reach SandboxFusion at {url}: {error}"
        if len(body) > MAX_RESPONSE_BYTES:
            return None, f"SandboxFusion's answer is over {MAX_RESPONSE_BYTES} bytes"
        try:
            return json.loads(body), None
        except ValueError as error:
            return None, f"SandboxFusion's answer is not JSON: {error}"
    return None, f"SandboxFusion answered HTTP 504 (Gateway Timeout) {attempts} times"


def _run_of(answer: Any, start: float) -> SandboxRun:
    """The run in a run_code answer: ``{"status": ..., "run_result": {"status", "stdout", "stderr", ...}}``."""
    run = answer.get("run_result") if isinstance(answer, dict) else None
    if not isinstance(run, dict):
        # No run: e.g. a compile error or a sandbox error; the answer's own status and message say which.
        summary = {key: answer.get(key) for key in ("status", "message")} if isinstance(answer, dict) else answer
        return _failed(f"SandboxFusion's answer has no run_result: {str(summary)[:1000]}", start)
    status, stdout, stderr = run.get("status"), run.get("stdout") or "", run.get("stderr") or ""
    if not (isinstance(stdout, str) and isinstance(stderr, str)):
        return _failed("SandboxFusion's run_result has non-text stdout/stderr", start)
    if status not in STATUSES:
        return _failed(f"SandboxFusion's run status {status!r} is none of {list(STATUSES)}\n{stderr}", start,
                       stdout=stdout)
    return SandboxRun(status=status, stdout=stdout, stderr=stderr, seconds=time.monotonic() - start)


def _failed(reason: str, start: float, stdout: str = "") -> SandboxRun:
    return SandboxRun(status=FAILED, stdout=stdout, stderr=reason, seconds=time.monotonic() - start)
