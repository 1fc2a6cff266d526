"""The tool side of multi-turn rollouts (ReTool): tool-call parsing, the tool turn's text, the local sandbox's hard
wall, the SandboxFusion client, MindSpeed-RL's tool config files and the retool reward.

Runs where: in the pytest process; the sandbox runs start short-lived Python subprocesses, and the SandboxFusion
tests talk to an http.server on 127.0.0.1 started here (a stand-in: the real service is a Docker image that cannot
run on this host).
"""

from __future__ import annotations

import http.server
import json
import socket
import tempfile
import threading
import time
import tracemalloc
from pathlib import Path

import pytest

from mindspeed_rl.errors import ConfigError, ConfigErrors
from mindspeed_rl.data import rewards
from mindspeed_rl.tools import sandbox_fusion
from mindspeed_rl.tools.base_tool import BaseTool
from mindspeed_rl.tools.parser import TOOL_PARSERS, HermesToolParser, ToolCall
from mindspeed_rl.tools.registry import load_tools
from mindspeed_rl.tools.retool import ReTool, massage_code
from mindspeed_rl.tools.sandbox import run_python
from mindspeed_rl.tools.sandbox_fusion import call_sandbox_fusion
from mindspeed_rl.tools.sandbox_fusion_tool import SandboxFusionTool
from mindspeed_rl.tools.turns import run_tool_calls, tool_turn_text, wrap_tool_output

THEIR_RETOOL_CONFIG = Path(__file__).parent / "data" / "mindspeed_rl_recipes" / "tools" / "retool_config.yaml"
SCHEMA = {"type": "function", "function": {"name": "code_interpreter", "description": "Runs code.", "parameters": {
    "type": "object", "properties": {"code": {"type": "string"}}, "required": ["code"]}}}
LOCAL = {"sandbox_fusion_url": "local", "default_timeout": 5, "memory_limit_mb": 256}


class EchoTool(BaseTool):
    """A user's own tool, as one written for MindSpeed-RL: answers its ``text`` argument."""

    def __init__(self, config: dict, tool_schema) -> None:
        super().__init__(config, tool_schema)
        self.live: set[str] = set()

    def create(self, instance_id=None, **kwargs) -> str:
        instance_id = super().create(instance_id, **kwargs)
        self.live.add(instance_id)
        return instance_id

    def execute(self, instance_id, parameters, **kwargs):
        if parameters.get("fail"):
            raise RuntimeError("asked to fail")
        return self.config.get("prefix", "") + parameters["text"], 0.0, {}

    def release(self, instance_id, **kwargs) -> None:
        self.live.discard(instance_id)


def echo_tool(name: str = "echo") -> EchoTool:
    return EchoTool({}, {"type": "function", "function": {"name": name, "description": "Echoes."}})


# --- parser ----------------------------------------------------------------------------------------------------


def test_parser_reads_a_call():
    text = 'Let me run it.\n<tool_call>\n{"name": "code_interpreter", "arguments": {"code": "print(1)"}}\n</tool_call>'
    assert HermesToolParser().extract_tool_calls(text) == [ToolCall("code_interpreter", {"code": "print(1)"})]
    assert TOOL_PARSERS["hermes"] is HermesToolParser


def test_parser_reads_several_calls_in_order():
    text = "".join(f'<tool_call>{{"name": "t{i}", "arguments": {{"i": {i}}}}}</tool_call> and ' for i in range(3))
    assert HermesToolParser().extract_tool_calls(text) == [ToolCall(f"t{i}", {"i": i}) for i in range(3)]


def test_parser_skips_blocks_that_are_not_calls():
    text = ('<tool_call>{"name": "a", "arguments": {</tool_call>'  # invalid JSON
            '<tool_call>{"arguments": {}}</tool_call>'  # no name
            '<tool_call>{"name": "b"}</tool_call>'  # no arguments
            '<tool_call>{"name": "c", "arguments": [1]}</tool_call>'  # arguments not an object
            '<tool_call>{"name": "d", "arguments": {}}</tool_call>'
            '<tool_call>{"name": "e", "arguments": {}}')  # never closed
    assert HermesToolParser().extract_tool_calls(text) == [ToolCall("d", {})]


@pytest.mark.parametrize("text", [
    "<tool_call>" * 6000,
    "<tool_call>" + "{" * 65536,
    "<tool_call>" + "[" * 65536 + "</tool_call>",  # nested deeper than json's C scanner allows
    "<tool_call>{}</tool_call>" * 2600,
], ids=["openings", "unclosed-braces", "deep-nesting", "many-empty-calls"])
def test_parser_is_fast_on_64kb_adversarial_text(text):
    start = time.perf_counter()
    assert HermesToolParser().extract_tool_calls(text) == []
    assert time.perf_counter() - start < 0.1


# --- the tool turn's text ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("side, max_length, expected", [
    # get_tool_response of MindSpeed-RL on "abcdefghij", worked out by hand.
    ("left", 4, "\n<tool_response>\nabcd...(truncated)\n</tool_response>"),
    ("right", 4, "\n<tool_response>\n(truncated)...ghij\n</tool_response>"),
    ("middle", 4, "\n<tool_response>\nab...(truncated)...ij\n</tool_response>"),
    ("middle", 5, "\n<tool_response>\nab...(truncated)...ij\n</tool_response>"),
    ("left", 10, "\n<tool_response>\nabcdefghij\n</tool_response>"),
])
def test_wrap_tool_output_truncates_as_mindspeed_rl(side, max_length, expected):
    assert wrap_tool_output("abcdefghij", max_length=max_length, truncate_side=side) == expected


def test_tool_turn_text_is_a_user_turn_then_the_assistant_again():
    wrapped = [wrap_tool_output("42", max_length=256, truncate_side="middle"), "\n<tool_response>\nx\n</tool_response>"]
    assert tool_turn_text(wrapped) == ("<|im_start|>user\n<tool_response>\n42\n</tool_response>"
                                       "\n<tool_response>\nx\n</tool_response><|im_end|>\n<|im_start|>assistant\n")


def test_run_tool_calls_wraps_each_output_and_releases_every_instance():
    tool = echo_tool()
    calls = [ToolCall("echo", {"text": "one"}), ToolCall("echo", {"text": "two"}), ToolCall("echo", {"text": "3"})]
    outputs = run_tool_calls(calls, {"echo": tool}, max_parallel_calls=2, max_length=256, truncate_side="middle")
    assert outputs == ["\n<tool_response>\none\n</tool_response>", "\n<tool_response>\ntwo\n</tool_response>"]
    assert tool.live == set()


def test_run_tool_calls_with_an_unknown_tool_is_none():
    calls = [ToolCall("echo", {"text": "one"}), ToolCall("search", {"query": "x"})]
    assert run_tool_calls(calls, {"echo": echo_tool()}, max_parallel_calls=2, max_length=256,
                          truncate_side="middle") is None


def test_run_tool_calls_with_a_raising_tool_is_none_and_releases_it():
    tool = echo_tool()
    assert run_tool_calls([ToolCall("echo", {"fail": True})], {"echo": tool}, max_parallel_calls=1, max_length=256,
                          truncate_side="middle") is None
    assert tool.live == set()


# --- the local sandbox --------------------------------------------------------------------------------------------


def test_sandbox_runs_a_program():
    run = run_python("print(6*7)", timeout_seconds=5, memory_limit_mb=256)
    assert (run.status, run.stdout, run.stderr) == ("Finished", "42\n", "")


def test_sandbox_reports_a_failing_program():
    run = run_python("raise SystemExit('bad input')", timeout_seconds=5, memory_limit_mb=256)
    assert (run.status, run.stderr) == ("Failed", "bad input\n")


def test_sandbox_stops_an_infinite_loop_at_the_wall():
    start = time.monotonic()
    run = run_python("while True:\n    pass", timeout_seconds=1, memory_limit_mb=256)
    assert run.status == "TimeLimitExceeded"
    assert time.monotonic() - start < 2.0


def test_sandbox_stops_an_output_flood_quickly_with_bounded_memory():
    tracemalloc.start()
    try:
        start = time.monotonic()
        run = run_python("while True:\n    print('x' * 10**6)", timeout_seconds=10, memory_limit_mb=256,
                         max_output_bytes=64 * 1024)
        seconds, peak = time.monotonic() - start, tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert run.status == "OutputLimitExceeded"
    assert len(run.stdout) == 64 * 1024 and seconds < 2.0
    assert peak < 1024 * 1024  # this process read back at most the limit, not the flood


def test_sandbox_memory_bomb_fails_with_memory_error():
    run = run_python("blocks = [bytearray(64 * 2**20) for _ in range(64)]", timeout_seconds=5, memory_limit_mb=256)
    assert run.status == "Failed"
    assert "MemoryError" in run.stderr


def test_sandbox_leaves_no_directory_and_no_process(tmp_path, monkeypatch):
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    code = ("import os, time\nchild = os.fork()\nif child == 0:\n    time.sleep(60)\n    os._exit(0)\n"
            "print(os.getcwd())\nprint(child)")
    # Unisolated (allow_unisolated): the process-group kill alone; inside the wall see test_sandbox_wall.
    run = run_python(code, timeout_seconds=5, memory_limit_mb=256, isolated=False)
    assert run.status == "Finished"
    workdir, child = run.stdout.split()
    assert Path(workdir).parent == tmp_path and list(tmp_path.iterdir()) == []
    # The sleeper outlived the program but was in its process group: SIGKILLed (which lands within moments; then
    # a zombie at most, until its new parent reaps it).
    deadline = time.monotonic() + 2.0
    while _state(int(child)) not in (None, "Z") and time.monotonic() < deadline:
        time.sleep(0.01)
    assert _state(int(child)) in (None, "Z")


def _state(pid: int) -> str | None:
    """The process's state letter in /proc (R, S, Z, ...), None if there is no such process."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return None


# --- ReTool, locally -----------------------------------------------------------------------------------------------


def test_retool_massages_code_as_mindspeed_rl():
    assert massage_code("I will compute.\n```python\nx = 6 * 7\nx\n```\nDone.") == "x = 6 * 7\nprint(x)"
    assert massage_code("print(1)\n\n") == "print(1)\n\n"
    assert massage_code("a = 1\na + 1\n") == "a = 1\nprint(a + 1)\n"


def test_retool_runs_the_massaged_code_locally():
    tool = ReTool(LOCAL, SCHEMA)
    instance = tool.create()
    assert tool.execute(instance, {"code": "```python\nimport math\nmath.factorial(5)\n```"}) == ("120\n", 0.0, {})
    assert tool.execute(instance, {"code": "1 / 0"}) == ("no stdout here", 0.0, {})
    tool.release(instance)


def test_sandbox_fusion_tool_refuses_unknown_keys_and_local_non_python():
    with pytest.raises(ValueError, match=r"unknown keys \['sandbox_url'\]"):
        SandboxFusionTool({**LOCAL, "sandbox_url": "x"}, SCHEMA)
    with pytest.raises(ValueError, match="runs python only"):
        SandboxFusionTool({**LOCAL, "default_language": "cpp"}, SCHEMA)


# --- the SandboxFusion client, against a stand-in service -------------------------------------------------------------


class StandInSandboxFusion(http.server.BaseHTTPRequestHandler):
    """Answers run_code as SandboxFusion does, running the code with run_python; 504 first if asked."""

    requests: list[dict] = []
    gateway_timeouts_left = 0

    def do_POST(self) -> None:  # noqa: N802 (http.server's name)
        payload = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        type(self).requests.append(payload)
        if type(self).gateway_timeouts_left > 0:
            type(self).gateway_timeouts_left -= 1
            self.send_response(504)
            self.end_headers()
            return
        run = run_python(payload["code"], timeout_seconds=payload["run_timeout"],
                         memory_limit_mb=payload["memory_limit_MB"])
        body = json.dumps({"status": "Success", "message": "", "run_result": {
            "status": run.status, "stdout": run.stdout, "stderr": run.stderr, "execution_time": run.seconds}})
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body.encode())

    def log_message(self, *args) -> None:
        pass


@pytest.fixture
def stand_in(monkeypatch):
    monkeypatch.setenv("no_proxy", "127.0.0.1")  # urllib honours a host's http_proxy, as requests does
    StandInSandboxFusion.requests, StandInSandboxFusion.gateway_timeouts_left = [], 0
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), StandInSandboxFusion)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}/run_code"
    server.shutdown()
    server.server_close()


def test_sandbox_fusion_client_sends_mindspeed_rls_payload(stand_in):
    run = call_sandbox_fusion(stand_in, "print(6*7)", timeout_seconds=5, memory_limit_mb=256, language="python")
    assert (run.status, run.stdout) == ("Finished", "42\n")
    assert StandInSandboxFusion.requests == [{"compile_timeout": 5, "run_timeout": 5, "code": "print(6*7)",
                                             "stdin": None, "memory_limit_MB": 256, "language": "python",
                                             "files": {}, "fetch_files": []}]


def test_sandbox_fusion_client_retries_a_gateway_timeout(stand_in):
    StandInSandboxFusion.gateway_timeouts_left = 1
    start = time.monotonic()
    run = call_sandbox_fusion(stand_in, "print(1)", timeout_seconds=5, memory_limit_mb=256, language="python")
    assert (run.status, run.stdout, len(StandInSandboxFusion.requests)) == ("Finished", "1\n", 2)
    assert time.monotonic() - start >= sandbox_fusion.RETRY_WAITS_SECONDS[0]


def test_sandbox_fusion_client_on_an_unreachable_url_fails_without_raising(monkeypatch):
    monkeypatch.setenv("no_proxy", "127.0.0.1")
    with socket.socket() as probe:  # a port nothing listens on once closed
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    run = call_sandbox_fusion(f"http://127.0.0.1:{port}/run_code", "print(1)", timeout_seconds=5,
                              memory_limit_mb=256, language="python")
    assert run.status == "Failed" and "cannot reach SandboxFusion" in run.stderr


def test_retool_through_the_service(stand_in):
    tool = ReTool({"sandbox_fusion_url": stand_in, "memory_limit_mb": 256, "default_timeout": 5}, SCHEMA)
    assert tool.execute(tool.create(), {"code": "sum(range(10))"}) == ("45\n", 0.0, {})


# --- tool config files -------------------------------------------------------------------------------------------


def test_their_retool_config_loads_unchanged_without_connecting(monkeypatch):
    connections = []
    monkeypatch.setattr(socket.socket, "connect", lambda self, address: connections.append(address))
    tools = load_tools(str(THEIR_RETOOL_CONFIG))
    assert list(tools) == ["code_interpreter"] and type(tools["code_interpreter"]) is ReTool
    tool = tools["code_interpreter"]
    assert tool.sandbox_fusion_url == "http://localhost:8080/run_code"
    assert (tool.num_workers, tool.rate_limit, tool.default_timeout, tool.memory_limit_mb) == (128, 128, 30, 1024)
    assert tool.tool_schema.function.parameters["required"] == ["code"]
    assert connections == []


def test_a_tool_config_reports_every_problem_at_once(tmp_path):
    path = tmp_path / "tools.yaml"
    tools = [{"class_name": "foo.Bar", "config": {}, "tool_schema": SCHEMA},
             {"class_name": "mindspeed_rl.tools.retool.ReTool", "config": {**LOCAL, "sandbox_url": "x"},
              "tool_schema": SCHEMA},
             {"class_name": "mindspeed_rl.tools.retool.ReTool", "config": LOCAL,
              "tool_schema": {"type": "function", "function": {"description": "no name"}}}]
    path.write_text(json.dumps({"tools": tools}))  # JSON is YAML
    with pytest.raises(ConfigErrors) as raised:
        load_tools(str(path))
    lines = str(raised.value).splitlines()
    assert len(lines) == 3 and all(error.key == "rl_config.tool_config_path" for error in raised.value.all())
    assert lines[0] == (f"rl_config.tool_config_path: {path}: tools[0].class_name: "
                        "cannot import foo.Bar (No module named 'foo')")
    assert lines[1].startswith(f"rl_config.tool_config_path: {path}: tools[1].config: unknown keys ['sandbox_url']")
    assert lines[2] == f"rl_config.tool_config_path: {path}: tools[2].tool_schema.function.name: missing"


@pytest.mark.parametrize("tools, expected", [
    ([{"class_name": "collections.OrderedDict", "config": {}, "tool_schema": SCHEMA}],
     "tools[0].class_name: collections.OrderedDict is not a subclass of mindspeed_rl.tools.base_tool.BaseTool"),
    ([{"class_name": "test_tools.EchoTool", "config": {}, "tool_schema": SCHEMA}] * 2,
     "tools[1].tool_schema.function.name: duplicate tool name 'code_interpreter' (also tools[0])"),
    ([{"config": {}, "tool_schema": SCHEMA}], "tools[0].class_name: missing"),
    ("not a list", "tools: must be a non-empty list of tools, got 'not a list'"),
])
def test_a_tool_config_names_the_item_at_fault(tmp_path, tools, expected):
    path = tmp_path / "tools.yaml"
    path.write_text(json.dumps({"tools": tools}))
    with pytest.raises(ConfigError) as raised:
        load_tools(str(path))
    assert str(raised.value) == f"rl_config.tool_config_path: {path}: {expected}"


def test_a_missing_tool_config_file_is_a_config_error(tmp_path):
    with pytest.raises(ConfigError, match="no such file"):
        load_tools(str(tmp_path / "absent.yaml"))


def test_a_users_own_tool_loads_and_runs(tmp_path):
    path = tmp_path / "tools.yaml"
    path.write_text(json.dumps({"tools": [{"class_name": "test_tools.EchoTool", "config": {"prefix": "> "},
                                           "tool_schema": {**SCHEMA, "function": {**SCHEMA["function"],
                                                                                  "name": "echo"}}}]}))
    tools = load_tools(str(path))
    text = '<tool_call>{"name": "echo", "arguments": {"text": "hi"}}</tool_call>'
    calls = HermesToolParser().extract_tool_calls(text)
    assert run_tool_calls(calls, tools, max_parallel_calls=1, max_length=256, truncate_side="middle") == [
        "\n<tool_response>\n> hi\n</tool_response>"]


# --- the retool reward -------------------------------------------------------------------------------------------


@pytest.mark.parametrize("response, label, expected", [
    ("Using the interpreter, the sum is 45. So the answer is \\boxed{45}.", "45", 1.0),
    ("The answer is \\boxed{\\frac{1}{2}}", "0.5", 1.0),  # math-verify, not MindSpeed-RL's string compare
    ("The answer is \\boxed{44}.", "45", -1.0),
    ("\\boxed{45} is my first guess. " + "Then I checked it again at length. " * 10, "45", -1.0),  # box too early
    ("No box at all: 45", "45", -1.0),
])
def test_retool_reward(response, label, expected):
    assert rewards.retool_reward(response, label) == expected
    assert rewards.VERIFIERS["retool_reward"](response, label) == expected
    assert rewards.answer_is_correct(response, label, ["retool_reward"]) == (expected == 1.0)


def test_retool_final_answer_is_the_late_box():
    assert rewards.final_answer("x \\boxed{7}", ["retool_reward"]) == "7"
    assert rewards.final_answer("\\boxed{7}" + " " * 120, ["retool_reward"]) is None


@pytest.mark.parametrize("score, tool_calls, expected", [
    (-1.0, 0, -1.0), (-1.0, 3, -0.7), (-1.0, 10, 0.0), (-1.0, 25, 0.0), (1.0, 5, 1.0), (0.0, 4, 0.0),
])
def test_retool_tool_call_bonus(score, tool_calls, expected):
    assert rewards.retool_tool_call_bonus(score, tool_calls) == pytest.approx(expected)
