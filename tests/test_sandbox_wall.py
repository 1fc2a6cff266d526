"""The wall around model-written code (tools/wall.py, used by tools/sandbox.run_python): what a policy's code tried
against the unwalled interpreter, each attack checked from outside the sandbox, plus a fork bomb, a disk filler,
/proc/1/environ, /dev/shm, a port bound for the host and ptrace. Ordinary tool code still answers.

Runs where: in the pytest process, each call a real bubblewrap sandbox (user, mount, PID, network, IPC, UTS
namespaces) on this host; the suite's machine has user namespaces (the wall's probe says so, else these fail).
"""
import os
import shutil
import socket
import threading
import time
import uuid
from pathlib import Path

import psutil
import pytest

from mindspeed_rl.tools.sandbox import FINISHED, run_python
from mindspeed_rl.tools.wall import PROCESS_LIMIT, wall_unavailable_reason

REPO = Path(__file__).resolve().parent.parent


def _run(code: str, timeout: float = 10.0):
    return run_python(code, timeout_seconds=timeout, memory_limit_mb=1024)


def test_the_wall_can_be_built_here():
    assert wall_unavailable_reason() is None


def test_ordinary_tool_code_answers():
    run = _run("import numpy, sympy\nprint(int(numpy.arange(10).sum()), sympy.factor(sympy.Symbol('x')**2 - 1))\n"
               "open('scratch.txt', 'w').write('ok'); print(open('scratch.txt').read())")
    assert run.status == FINISHED, run.stderr
    assert run.stdout.split() == ["45", "(x", "-", "1)*(x", "+", "1)", "ok"]


def test_files_outside_its_folder_are_neither_seen_nor_changed(tmp_path):
    checkpoint, secret = tmp_path / "ckpt.pt", f"secret-{uuid.uuid4().hex}"
    checkpoint.write_text(secret)
    run = _run(f"import os, shutil\nfor act in (lambda: print(open({str(checkpoint)!r}).read()),\n"
               f"            lambda: os.remove({str(checkpoint)!r}), lambda: shutil.rmtree({str(tmp_path)!r}),\n"
               f"            lambda: open({str(tmp_path / 'evil')!r}, 'w').write('x')):\n"
               "    try:\n        act()\n    except OSError as error:\n        print(type(error).__name__)")
    assert checkpoint.read_text() == secret and not (tmp_path / "evil").exists()
    assert secret not in run.stdout and run.stdout.split().count("FileNotFoundError") >= 3


def test_the_hosts_processes_are_invisible_and_cannot_be_signalled_or_traced():
    me = os.getpid()
    run = _run(f"import ctypes, os\nprint(sorted(int(p) for p in os.listdir('/proc') if p.isdigit()))\n"
               f"try:\n    os.kill({me}, 0); print('signalled')\nexcept ProcessLookupError:\n    print('no such process')\n"
               f"libc = ctypes.CDLL(None, use_errno=True)\n"
               f"print('ptrace', libc.ptrace(16, {me}, 0, 0), ctypes.get_errno())\n"  # PTRACE_ATTACH
               "print(open('/proc/1/environ').read().replace(chr(0), ' '))")
    assert run.status == FINISHED, run.stderr
    pids, signal_line, ptrace_line, environ = run.stdout.splitlines()[:4]
    assert len(eval(pids)) <= 3 and signal_line == "no such process"
    assert ptrace_line.startswith("ptrace -1")  # ESRCH: that pid does not exist in the sandbox
    assert "PATH=" in environ and not any(key in environ for key in ("HF_", "VLLM_", "PYTEST", "MASTER_ADDR"))


def _server() -> tuple[socket.socket, list]:
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen()
    server.settimeout(3.0)
    accepted: list = []

    def accept():
        try:
            accepted.append(server.accept())
        except OSError:
            pass

    threading.Thread(target=accept, daemon=True).start()
    return server, accepted


def test_no_host_address_is_reachable():
    server, accepted = _server()
    port = server.getsockname()[1]
    run = _run(f"import socket\ntry:\n    socket.create_connection(('127.0.0.1', {port}), timeout=2); print('connected')\n"
               "except OSError as error:\n    print(type(error).__name__)")
    time.sleep(0.2)
    server.close()
    assert "connected" not in run.stdout and accepted == []


def test_a_port_it_binds_is_not_reachable_from_the_host():
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    result: dict = {}
    thread = threading.Thread(target=lambda: result.update(run=_run(
        f"import socket, time\ns = socket.socket(); s.bind(('0.0.0.0', {port})); s.listen(); print('listening', "
        f"flush=True)\ntime.sleep(3)")))
    thread.start()
    time.sleep(1.5)
    with pytest.raises(ConnectionRefusedError):
        socket.create_connection(("127.0.0.1", port), timeout=1).close()
    thread.join()
    assert "listening" in result["run"].stdout


def _processes_with(token: str) -> list:
    return [p for p in psutil.process_iter(["cmdline"]) if token in " ".join(p.info["cmdline"] or [])]


def test_nothing_it_starts_outlives_the_call():
    token = f"orphan-{uuid.uuid4().hex}"
    run = _run(f"import subprocess, sys\nsubprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)  #{token}'],"
               " start_new_session=True)\nprint('started')")
    assert run.stdout.strip() == "started"
    time.sleep(0.5)
    assert _processes_with(token) == []


def test_a_fork_bomb_is_bounded_and_ends_with_the_call():
    token = f"bomb-{uuid.uuid4().hex}"
    before, peak, done = len(psutil.pids()), [0], threading.Event()

    def watch():
        while not done.is_set():
            peak[0] = max(peak[0], len(psutil.pids()))
            time.sleep(0.02)

    watcher = threading.Thread(target=watch)
    watcher.start()
    run = _run(f"import os, time  # {token}\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n"
               "        time.sleep(0.01)", timeout=3.0)
    done.set()
    watcher.join()
    assert run.status != FINISHED
    assert peak[0] - before <= PROCESS_LIMIT + 32  # the sandbox's processes, and room for the host's own churn
    time.sleep(0.3)
    assert _processes_with(token) == []


def test_a_disk_filler_fills_its_own_small_tmpfs_only():
    free = shutil.disk_usage("/tmp").free
    run = _run("import os\nfor folder in ('/sandbox', '/tmp', '/dev/shm'):\n    try:\n"
               "        with open(os.path.join(folder, 'fill'), 'wb') as f:\n"
               "            for _ in range(512):\n                f.write(b'x' * 2**20)\n"
               "    except OSError as error:\n        print(folder, type(error).__name__)")
    assert shutil.disk_usage("/tmp").free > free - 50 * 2**20
    assert not os.path.exists("/dev/shm/fill")
    assert run.stdout.count("OSError") + run.stdout.count("FileTooLarge") >= 2 or "File" in run.stderr


def test_the_limits_still_hold_inside_the_wall():
    assert _run("x = bytearray(3 * 2**30)").status != FINISHED  # memory_limit_mb 1024
    started = time.monotonic()
    assert _run("while True:\n    pass", timeout=1.0).status == "TimeLimitExceeded"
    assert time.monotonic() - started < 3.0
    assert _run("print('x' * 200_000)").status == "OutputLimitExceeded"


def _local_tool_file(tmp_path, allow_unisolated: bool):
    text = (REPO / "configs/tools/retool_local.yaml").read_text()
    if allow_unisolated:
        text = text.replace("      type: native\n", "      type: native\n      allow_unisolated: true\n")
    path = tmp_path / "tools.yaml"
    path.write_text(text)
    return str(path)


def test_without_a_wall_local_code_is_a_config_error_naming_why(tmp_path, monkeypatch):
    from mindspeed_rl.errors import ConfigError
    from mindspeed_rl.tools import wall
    from mindspeed_rl.tools.registry import load_tools

    monkeypatch.setattr(wall, "wall_unavailable_reason", lambda: "user namespaces are off (probe)")
    with pytest.raises(ConfigError, match=r"no wall around the model's code .*user namespaces are off.*allow_unisolated"):
        load_tools(_local_tool_file(tmp_path, allow_unisolated=False))


def test_allow_unisolated_runs_it_unisolated_with_one_warning(tmp_path, monkeypatch, caplog):
    import logging

    from mindspeed_rl.tools import sandbox_fusion_tool, wall
    from mindspeed_rl.tools.registry import load_tools

    monkeypatch.setattr(wall, "wall_unavailable_reason", lambda: "user namespaces are off (probe)")
    monkeypatch.setattr(sandbox_fusion_tool, "_warned_unisolated", threading.Event())
    with caplog.at_level(logging.WARNING, logger="mindspeed_rl.tools.sandbox_fusion_tool"):
        tools = load_tools(_local_tool_file(tmp_path, allow_unisolated=True))
        load_tools(_local_tool_file(tmp_path, allow_unisolated=True))
    (tool,) = tools.values()
    assert tool.isolated is False and caplog.text.count("UNISOLATED") == 1
    assert tool.run_code("print(6*7)", 5.0, "python").stdout.strip() == "42"
