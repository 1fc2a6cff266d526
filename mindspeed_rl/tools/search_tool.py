"""MindSpeed-RL's ``SearchTool`` (``mindspeed_rl.tools.search_tool.SearchTool``, the class their
``configs/tools/search_tool_config.yaml`` names): the model's ``query_list`` is sent to a Search-R1 ``/retrieve``
service at ``retrieval_service_url`` and the passages come back in their text: a JSON ``{"result": ...}`` of
"Doc i (Title: first line)\\nrest" per passage, queries joined by "\\n---\\n".

Their keys and defaults (``num_workers``, ``enable_global_rate_limit``, ``rate_limit``, ``timeout``, ``topk``,
``type``); ours: ``retrieval_service_url: local`` with ``corpus_path`` serves the corpus from this process
(tools/retrieval_server.py, started at the first call, ending with the run). A call is bounded: at most ``timeout``
seconds in all, at most 3 tries, at most ``MAX_QUERIES`` queries of the model's, each cut to ``MAX_QUERY_CHARS``.
``rate_limit`` caps the calls in flight; with ``enable_global_rate_limit`` every search tool of this process waits on
one semaphore (tools/tool_config.rate_limit_slots, as the code tools do on theirs).
"""
from __future__ import annotations

import json
import logging
import os
import threading
import time
import urllib.error
import urllib.request
from typing import Any

from mindspeed_rl.tools.base_tool import BaseTool
from mindspeed_rl.tools.retrieval_server import MAX_QUERIES, MAX_QUERY_CHARS, serve_in_background
from mindspeed_rl.tools.schemas import OpenAIFunctionToolSchema
from mindspeed_rl.tools.tool_config import ToolConfigCheck, rate_limit_slots

logger = logging.getLogger(__name__)

LOCAL_URL = "local"
DEFAULTS: dict[str, Any] = {"num_workers": 120, "enable_global_rate_limit": True, "rate_limit": 120, "timeout": 30,
                            "topk": 3, "type": "native"}
CONFIG_KEYS = frozenset(DEFAULTS) | {"retrieval_service_url", "corpus_path"}
_TRIES = 3
_MAX_ANSWER_BYTES = 8 << 20


class SearchTool(BaseTool):
    """Runs the ``query_list`` argument against the retrieval service and answers its passages."""

    def __init__(self, config: dict, tool_schema: OpenAIFunctionToolSchema | None) -> None:
        super().__init__(config, tool_schema)
        values = read_search_config(self.config)
        self.retrieval_service_url: str = values["retrieval_service_url"]
        # Resolved now, at load: the run may change its working directory before the first call.
        self.corpus_path: str | None = os.path.abspath(values["corpus_path"]) if values.get("corpus_path") else None
        self.topk: int = values["topk"]
        self.timeout: float = values["timeout"]
        self.num_workers: int = values["num_workers"]
        self.rate_limit: int = values["rate_limit"]
        self.enable_global_rate_limit: bool = values["enable_global_rate_limit"]
        self._slots = rate_limit_slots(kind="search", rate_limit=self.rate_limit,
                                       shared=self.enable_global_rate_limit, tool_name=self.name)
        self._local_url: str | None = None
        self._local_lock = threading.Lock()

    def execute(self, instance_id: str, parameters: dict[str, Any], **kwargs: Any) -> tuple[str, float, dict]:
        queries = parameters.get("query_list")
        if not queries or not isinstance(queries, list):
            error = "Error: 'query_list' is missing, empty, or not a list in parameters."
            return json.dumps({"result": error}), 0.0, {}
        queries = [str(query)[:MAX_QUERY_CHARS] for query in queries[:MAX_QUERIES]]
        with self._slots:
            answer, error = self._retrieve(queries)
        if error is not None:
            return json.dumps({"result": f"Search error: {error}"}), 0.0, {"status": "api_error"}
        results = answer.get("result") or []
        if not results:
            return json.dumps({"result": "No search results found."}), 0.0, {"status": "no_results"}
        text = "\n---\n".join(passages_text(passages) for passages in results)
        return json.dumps({"result": text}), 0.0, {"status": "success", "query_count": len(queries),
                                                   "total_results": sum(len(p) for p in results)}

    def _url(self) -> str:
        if self.retrieval_service_url != LOCAL_URL:
            return self.retrieval_service_url
        with self._local_lock:
            if self._local_url is None:
                self._local_url = serve_in_background(self.corpus_path)
            return self._local_url

    def _retrieve(self, queries: list[str]) -> tuple[dict, str | None]:
        """(the service's answer, None) or ({}, why not), within `timeout` seconds in all."""
        body = json.dumps({"queries": queries, "topk": self.topk, "return_scores": True}).encode()
        deadline, error = time.monotonic() + self.timeout, "no try"
        for attempt in range(_TRIES):
            left = deadline - time.monotonic()
            if left <= 0:
                break
            request = urllib.request.Request(self._url(), data=body, method="POST",
                                             headers={"Content-Type": "application/json", "Accept": "application/json"})
            try:
                with urllib.request.urlopen(request, timeout=left) as response:
                    return json.loads(response.read(_MAX_ANSWER_BYTES)), None
            except urllib.error.HTTPError as failure:
                error = f"HTTP {failure.code}"
                if failure.code < 500:
                    break  # the request itself is wrong: another try gets the same answer
            except (OSError, ValueError) as failure:
                error = f"{type(failure).__name__}: {failure}"
            time.sleep(min(0.2 * (attempt + 1), max(0.0, deadline - time.monotonic())))
        return {}, error


def passages_text(passages: list[dict]) -> str:
    """MindSpeed-RL's passages2string: "Doc i (Title: <first line>)\\n<the rest>" per passage."""
    parts = []
    for index, passage in enumerate(passages):
        contents = passage["document"]["contents"]
        title, _, text = contents.partition("\n")
        parts.append(f"Doc {index + 1} (Title: {title})\n{text}\n\n")
    return "".join(parts).strip()


def read_search_config(config: dict[str, Any]) -> dict[str, Any]:
    """The config with defaults filled in, or a ValueError naming every bad or unknown key."""
    check = ToolConfigCheck(config, DEFAULTS, CONFIG_KEYS)
    values = check.values
    url = values.get("retrieval_service_url")
    if not isinstance(url, str) or not url.strip():
        check.problems.append(f"retrieval_service_url must be the service's /retrieve URL or {LOCAL_URL!r}, "
                              f"got {url!r}")
    elif url == LOCAL_URL and not values.get("corpus_path"):
        check.problems.append(f"retrieval_service_url {LOCAL_URL!r} needs corpus_path (a JSONL of {{id, contents}})")
    elif url == LOCAL_URL and not os.path.isfile(str(values["corpus_path"])):
        check.problems.append(f"corpus_path {values['corpus_path']!r} is not a file (relative paths: to the launch "
                              f"directory)")
    check.positive_integers("num_workers", "rate_limit", "topk")
    check.positive_seconds("timeout")
    check.native_type()
    return check.result()
