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


def test_a_fork_bomb_is_bounded_and_ends_with_the_call(monkeypatch):
    from mindspeed_rl.tools import cgroups

    made, remove = [], cgroups.CallCgroups.remove
    monkeypatch.setattr(cgroups.CallCgroups, "remove", lambda self: (made.append((self.memory, self.pids)),
                                                                      remove(self)))
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
    # Its cgroups are gone too, though its last processes were still exiting when the call returned.
    assert made and not any(path is not None and path.exists() for path in made[0])


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


def test_the_root_and_dev_are_read_only_so_small_files_cannot_fill_memory():
    # bwrap's root and /dev are unsized tmpfs (RAM): many files under the size limit would fill it without bound.
    run = _run("import os\nfor folder in ('/', '/dev', '/dev/shm'):\n    try:\n"
               "        for i in range(3):\n            open(os.path.join(folder, f'f{i}'), 'wb').write(b'x')\n"
               "        print(folder, 'written')\n    except OSError as error:\n        print(folder, error.errno)")
    assert run.stdout.split("\n")[:3] == ["/ 30", "/dev 30", "/dev/shm written"], run.stderr  # EROFS


# --- The interpreter under /tmp (a common CI and container layout): bound over the private /tmp, read-only. ---

_UNDER_TMP = """\
import json, os, sys
from mindspeed_rl.tools import wall
from mindspeed_rl.tools.registry import load_tools
from mindspeed_rl.tools.sandbox import run_python
secret, repo_file = sys.argv[1], sys.argv[2]
repo = os.path.dirname(os.path.dirname(repo_file))
(tool,) = load_tools(os.path.join(repo, "configs", "tools", "retool_local.yaml")).values()
attack = ("import os, sys\\nfor act in (lambda: open(%r).read(), lambda: open(%r).read(),\\n"
          "            lambda: open(os.path.join(sys.prefix, 'evil'), 'w').write('x')):\\n"
          "    try:\\n        print(act())\\n    except OSError as error:\\n        print(error.errno)\\n"
          "print(sys.prefix)") % (secret, repo_file)
run = run_python(attack, timeout_seconds=10, memory_limit_mb=256)
print(json.dumps({"prefix": sys.prefix, "reason": wall.wall_unavailable_reason(), "isolated": tool.isolated,
                  "answer": tool.run_code("print(6*7)", 10.0, "python").stdout, "status": run.status,
                  "stdout": run.stdout, "stderr": run.stderr}))
"""


@pytest.fixture
def interpreter_under_tmp():
    """A real virtualenv whose prefix is under /tmp, seeing this one's packages and the repo through a .pth file."""
    import subprocess
    import sys
    import tempfile

    root = Path(tempfile.mkdtemp(prefix="mindspeed_rl_venv_", dir="/tmp"))
    try:
        subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(root / "venv")], check=True, timeout=120)
        python = root / "venv" / "bin" / "python"
        site = subprocess.run([str(python), "-c", "import site; print(site.getsitepackages()[0])"], check=True,
                              capture_output=True, text=True, timeout=60).stdout.strip()
        here = [p for p in sys.path if p.endswith("site-packages")] + [str(REPO)]
        Path(site, "host_packages.pth").write_text("\n".join(here) + "\n")
        yield root, python
    finally:
        shutil.rmtree(root, ignore_errors=True)


def test_with_python_under_tmp_the_tool_config_loads_and_the_code_cannot_reach_the_host(interpreter_under_tmp):
    import json
    import subprocess

    root, python = interpreter_under_tmp
    secret = root / "secret.txt"  # under /tmp, beside the virtualenv: not bound
    secret.write_text(f"secret-{uuid.uuid4().hex}")
    done = subprocess.run([str(python), "-c", _UNDER_TMP, str(secret), str(REPO / "mindspeed_rl" / "__init__.py")],
                          capture_output=True, text=True, timeout=120, cwd=str(root))
    assert done.returncode == 0, done.stderr[-2000:]
    result = json.loads(done.stdout.splitlines()[-1])
    assert result["prefix"].startswith("/tmp/") and result["reason"] is None and result["isolated"] is True
    assert result["answer"].strip() == "42" and result["status"] == FINISHED, result["stderr"]
    # ENOENT twice (the secret beside it and the repo are not there), EROFS (its own prefix is read-only).
    assert result["stdout"].split() == ["2", "2", "30", result["prefix"]]
    assert not (Path(result["prefix"]) / "evil").exists() and secret.read_text() not in done.stdout


def test_the_unavailable_reason_says_what_failed(monkeypatch):
    import sys

    from mindspeed_rl.tools import wall

    if all(d == "/usr" or d.startswith("/usr/") for d in (sys.prefix, sys.base_prefix)):
        pytest.skip("this interpreter lives under /usr, which the wall always binds: it cannot be left out")
    monkeypatch.setattr(wall, "_interpreter_dirs", lambda: [])  # the interpreter is then not in the wall
    reason = wall.wall_unavailable_reason.__wrapped__()
    assert reason is not None and "bwrap: execvp" in reason and "No such file" in reason
    assert "user namespaces" not in reason


# --- One call's memory, bounded as a whole: children that each touch memory, measured from outside. ---

_FORKS_AND_TOUCHES = """\
import os, resource, sys, time
print("limits", resource.getrlimit(resource.RLIMIT_AS)[0], flush=True)
children = []
for i in range({children}):
    try:
        pid = os.fork()
    except OSError as error:
        print("fork-failed", i, error.errno, flush=True)
        break
    if pid == 0:
        try:
            block = bytearray({touch_mb} * 2**20)
            for j in range(0, len(block), 4096):
                block[j] = 1
            print("held", i, flush=True)
        except MemoryError:
            print("memory-error", i, flush=True)
        time.sleep(1)
        os._exit(0)
    children.append(pid)
statuses = [os.waitpid(pid, 0)[1] for pid in children]
print("killed", sum(status != 0 for status in statuses))
sys.exit(1 if any(statuses) else 0)
"""


class _Watch:
    """From outside the sandbox: the most memory (PSS: shared pages split between their holders) and the most
    processes this test's descendants (the launcher, bwrap and everything in the sandbox) held at once. Only the trees
    of the children started after entering count: in the suite the pytest process has other children (an earlier
    module's Ray daemons and their workers, servers)."""

    def __enter__(self):
        self.memory, self.processes, self._done = 0, 0, threading.Event()
        self._before = {child.pid for child in psutil.Process().children()}
        self._thread = threading.Thread(target=self._sample)
        self._thread.start()
        return self

    def _calls_processes(self, me) -> list:
        processes = []
        for child in me.children():
            if child.pid not in self._before:
                try:
                    processes += [child, *child.children(recursive=True)]
                except psutil.Error:
                    pass
        return processes

    def _sample(self):
        me = psutil.Process()
        while not self._done.is_set():
            memory, processes = 0, self._calls_processes(me)
            for process in processes:
                try:
                    memory += process.memory_full_info().pss
                except psutil.Error:
                    pass
            self.memory, self.processes = max(self.memory, memory), max(self.processes, len(processes))
            time.sleep(0.02)

    def __exit__(self, *exc):
        self._done.set()
        self._thread.join()


def _attack(limit_mb: int, children: int, touch_mb: int):
    with _Watch() as watch:
        run = run_python(_FORKS_AND_TOUCHES.format(children=children, touch_mb=touch_mb), timeout_seconds=20,
                         memory_limit_mb=limit_mb)
    lines = run.stdout.split("\n")
    return run, watch, lines, sum(line.startswith("held") for line in lines)


def test_a_call_that_forks_cannot_hold_more_than_its_limit_in_total(monkeypatch):
    from mindspeed_rl.tools import cgroups

    probe = cgroups.CallCgroups(2**20)
    probe.remove()
    if probe.memory is None:
        pytest.skip("no memory cgroup can be made here (not root, or no writable memory controller): the shared "
                    "budget below is what bounds a call here")
    peaks, remove = [], cgroups.CallCgroups.remove
    monkeypatch.setattr(cgroups.CallCgroups, "remove", lambda self: (peaks.append(self.memory_peak_bytes()),
                                                                      remove(self)))
    # 8 children of 96 MiB each: 3x the limit, each well under it (the old per-process limit let all 8 hold it).
    run, watch, lines, held = _attack(limit_mb=256, children=8, touch_mb=96)
    assert run.status == "Failed" and held < 8 and "killed 0" not in lines, run.stdout  # the OOM killer's SIGKILL
    assert peaks and peaks[0] <= 256 * 2**20
    assert watch.memory <= (256 + 16) * 2**20, watch.memory  # 16 MiB: a sample landing mid-kill


def _without_memory_cgroup(monkeypatch):
    """The fallback as this caller gets it: a root caller with the memory cgroup made impossible (its pids cgroup
    caps the processes), or a caller that is not root (RLIMIT_NPROC does)."""
    from mindspeed_rl.tools import cgroups

    parents = cgroups.candidate_parents
    monkeypatch.setattr(cgroups, "candidate_parents", lambda c: () if c == "memory" else parents(c))
    probe = cgroups.CallCgroups(2**20)
    probe.remove()
    if os.geteuid() == 0 and probe.pids is None:
        pytest.skip("a root caller without any cgroup: only the time limit bounds its processes (documented)")


def test_without_a_memory_cgroup_the_processes_share_the_limit(monkeypatch):
    from mindspeed_rl.tools.cgroups import PROCESS_SHARE_BYTES, process_budget

    _without_memory_cgroup(monkeypatch)
    budget = process_budget(1024 * 2**20, memory_cgroup=False)
    assert (budget.processes, budget.address_space) == (1024 * 2**20 // PROCESS_SHARE_BYTES, PROCESS_SHARE_BYTES)
    run, watch, lines, held = _attack(limit_mb=1024, children=8, touch_mb=200)
    assert lines[0] == f"limits {budget.address_space}", run.stderr
    assert f"fork-failed {budget.processes - 1} 11" in lines and held == budget.processes - 1  # EAGAIN
    assert watch.processes <= budget.processes + 2 and watch.memory <= 1024 * 2**20
    run, watch, lines, held = _attack(limit_mb=1024, children=1, touch_mb=300)  # over its share
    assert "memory-error 0" in lines and held == 0


_AS_NOBODY = """\
import json, sys
sys.path.insert(0, sys.argv[1])
import test_sandbox_wall as t
from mindspeed_rl.tools.cgroups import CallCgroups
budget = CallCgroups(1024 * 2**20).budget  # no cgroup is made for a caller that is not root: nothing to remove
run, watch, lines, held = t._attack(limit_mb=1024, children=8, touch_mb=200)
with t._Watch() as bomb:
    t._run("import os, time\\nwhile True:\\n    try:\\n        os.fork()\\n    except OSError:\\n"
           "        time.sleep(0.01)", timeout=2.0)
print(json.dumps({"budget": [budget.processes, budget.address_space], "lines": lines, "held": held,
                  "memory": watch.memory, "processes": watch.processes, "bomb": bomb.processes}))
"""


def _unprivileged_python() -> list[str]:
    """setpriv's command line running an interpreter of this version as nobody with this one's packages, or a
    skip naming what is missing."""
    import subprocess
    import sys

    setpriv = shutil.which("setpriv")
    if os.geteuid() != 0 or setpriv is None:
        pytest.skip("needs root and setpriv to become nobody (a caller that is not root runs the test above as is)")
    path = ":".join([p for p in sys.path if p.endswith("site-packages")] + [str(REPO)])
    version = f"python{sys.version_info.major}.{sys.version_info.minor}"
    for python in (os.path.realpath(sys.executable), f"/usr/bin/{version}", f"/usr/local/bin/{version}"):
        command = [setpriv, "--reuid=65534", "--regid=65534", "--clear-groups", "env", "HOME=/tmp",
                   f"PYTHONPATH={path}", python]
        check = subprocess.run([*command, "-c", "import psutil, pytest, mindspeed_rl.tools.sandbox"],
                               capture_output=True, timeout=60, cwd="/")
        if check.returncode == 0:
            return command
    pytest.skip(f"no {version} with this interpreter's packages is readable by nobody here")


def test_a_caller_that_is_not_root_gets_the_shared_budget_and_a_capped_fork_bomb():
    import json
    import subprocess

    command = _unprivileged_python()
    done = subprocess.run([*command, "-c", _AS_NOBODY, str(REPO / "tests")], capture_output=True, text=True,
                          timeout=180, cwd="/")
    assert done.returncode == 0, done.stderr[-2000:]
    result = json.loads(done.stdout.splitlines()[-1])
    processes, address_space = result["budget"]
    assert processes * address_space <= 1024 * 2**20 and result["lines"][0] == f"limits {address_space}"
    assert f"fork-failed {processes - 1} 11" in result["lines"] and result["held"] == processes - 1
    assert result["memory"] <= 1024 * 2**20 and result["processes"] <= processes + 2
    assert result["bomb"] <= processes + 2  # RLIMIT_NPROC in its user namespace: bwrap's two, then its own
