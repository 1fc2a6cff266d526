"""Processes for the tests, forked from one server that has imported torch, Megatron-core and vLLM once per session.

A fresh Python process imports those afresh: about 10 CPU-seconds on this machine, most of what a two-rank spawn or a
short CLI run costs. multiprocessing's forkserver, with them preloaded, starts each process already past them.

- `spawn_ranks`: torch.multiprocessing.spawn's call for the `*_multiprocess.py` tests.
- `run_script`: `python <script> <args>` as subprocess.run would run it (its own cwd, environment, sys.path, argv,
  `__main__`, exit code, atexit handlers, stdout and stderr), for tests/cli_runner.run_cli.
- `ScriptProcess`: the same run as subprocess.Popen with start_new_session=True would start it (pid, stdout and
  stderr streams, poll, wait, send_signal), for tests/run_watch.launch.

A forked process is a fresh process of its own: the server holds no CUDA context, torch.distributed state, Ray
connection or thread of Python when it forks. Only third-party modules are preloaded, after the session's
environment is set (tests/conftest.py), so anything that reads the environment at import reads the values a
subprocess would see; the engine's own modules are imported by each process under its own environment.
"""
from __future__ import annotations

import contextlib
import json
import multiprocessing
import os
import pickle
import subprocess
import sys
import tempfile
import threading
import time
from functools import lru_cache
from pathlib import Path

PRELOADED = ("torch", "torch.distributed", "transformers", "datasets", "megatron.core", "megatron.core.models.gpt",
             "vllm", "vllm.entrypoints.llm")


def _forkserver():
    multiprocessing.set_forkserver_preload(list(PRELOADED))
    return multiprocessing.get_context("forkserver")


def spawn_ranks(fn, args: tuple = (), nprocs: int = 1, join: bool = True):
    """torch.multiprocessing.spawn's call, by the preloaded forkserver. The function and its arguments travel as one
    pickle by value: torch's sharing of tensors by file descriptors would pass the server more than the 256
    descriptors one message may carry."""
    import torch.multiprocessing as mp

    _forkserver()
    payload = pickle.dumps((fn, args))
    return mp.start_processes(_run_pickled, args=(payload,), nprocs=nprocs, join=join, start_method="forkserver")


def _run_pickled(rank: int, payload: bytes) -> None:
    fn, args = pickle.loads(payload)
    fn(rank, *args)


@lru_cache(maxsize=None)
def _interpreter_path(pythonpath: str | None) -> tuple[str, ...]:
    """sys.path[1:] of `python <script>` under that PYTHONPATH ([0] is the script's folder)."""
    env = {key: value for key, value in os.environ.items() if key != "PYTHONPATH"}
    if pythonpath is not None:
        env["PYTHONPATH"] = pythonpath
    done = subprocess.run([sys.executable, "-c", "import json, sys; print(json.dumps(sys.path[1:]))"], env=env,
                          cwd=tempfile.gettempdir(), capture_output=True, text=True, check=True)
    return tuple(json.loads(done.stdout))


def _script_process(script: str, args: list[str], cwd: Path, env: dict[str, str], out: Path, err: Path, *,
                    new_session: bool):
    path = [str((Path(cwd) / script).resolve().parent), *_interpreter_path(env.get("PYTHONPATH"))]
    process = _forkserver().Process(target=_script_main, args=(script, args, str(cwd), env, path, str(out), str(err),
                                                               new_session))
    process.start()
    return process


def run_script(script: str, args: list[str], *, cwd: Path, env: dict[str, str],
               timeout: float) -> subprocess.CompletedProcess:
    """subprocess.run([sys.executable, script, *args], cwd=cwd, env=env, capture_output=True, text=True,
    timeout=timeout), the process forked from the preloaded server."""
    with tempfile.TemporaryDirectory(prefix="msrl-run-") as captured:
        out, err = Path(captured) / "stdout", Path(captured) / "stderr"
        process = _script_process(script, args, cwd, env, out, err, new_session=False)
        process.join(timeout)
        if process.is_alive():
            process.kill()
            process.join()
            raise subprocess.TimeoutExpired([sys.executable, script, *args], timeout, out.read_text(errors="replace"),
                                            err.read_text(errors="replace"))
        return subprocess.CompletedProcess([sys.executable, script, *args], process.exitcode,
                                           out.read_text(errors="replace"), err.read_text(errors="replace"))


class ScriptProcess:
    """subprocess.Popen([sys.executable, script, *args], cwd=cwd, env=env, stdout=PIPE, stderr=PIPE, text=True,
    start_new_session=True) as far as run_watch uses it, the process forked from the preloaded server. Its streams
    are files read as they grow (a reader of `stdout` sees end of file once the process has exited and all is read)."""

    def __init__(self, script: str, args: list[str], *, cwd: Path, env: dict[str, str]):
        self._captured = Path(tempfile.mkdtemp(prefix="msrl-watch-"))
        out, err = self._captured / "stdout", self._captured / "stderr"
        out.touch()
        err.touch()
        self._process = _script_process(script, args, cwd, env, out, err, new_session=True)
        self._polling = threading.Lock()  # two readers of the server's exit message at once: one would read EOF
        self.pid = self._process.pid
        self.args = [sys.executable, script, *args]
        self.stdout, self.stderr = _GrowingFile(out, self), _GrowingFile(err, self)

    @property
    def returncode(self) -> int | None:
        return self.poll()

    def poll(self) -> int | None:
        with self._polling:
            return self._process.exitcode

    def wait(self, timeout: float | None = None) -> int:
        end = None if timeout is None else time.monotonic() + timeout
        while (code := self.poll()) is None:
            if end is not None and time.monotonic() > end:
                raise subprocess.TimeoutExpired(self.args, timeout)
            time.sleep(0.05)
        return code

    def send_signal(self, signum: int) -> None:
        os.kill(self.pid, signum)


class _GrowingFile:
    """Lines of a file another process writes, until that process has exited and every line is read."""

    def __init__(self, path: Path, process: ScriptProcess):
        self._file = open(path, encoding="utf-8", errors="replace")  # noqa: SIM115 - read until the process ends
        self._path, self._process = path, process

    def __iter__(self):
        pending = ""
        while True:
            ended = self._process.poll() is not None  # before the read: nothing is written after it
            pending += self._file.read()
            *lines, pending = pending.split("\n")
            yield from (line + "\n" for line in lines)
            if ended:
                if pending:
                    yield pending
                self._file.close()
                self._path.unlink()
                with contextlib.suppress(OSError):  # the other stream's file is still being read
                    self._path.parent.rmdir()
                return
            time.sleep(0.05)


def _script_main(script: str, args: list[str], cwd: str, env: dict[str, str], path: list[str], out: str,
                 err: str, new_session: bool) -> None:
    """The forked process as the interpreter runs a script: its streams, session, cwd, environment, path and argv,
    the script as `__main__`, the exit code as Python sets it (an uncaught Ctrl-C ends it by SIGINT), then threads
    joined and atexit handlers run."""
    import atexit
    import runpy
    import signal
    import traceback

    if new_session:
        os.setsid()
    _fresh_multiprocessing()
    for fd, name in ((1, out), (2, err)):
        file = os.open(name, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(file, fd)
        os.close(file)
    os.chdir(cwd)
    os.environ.clear()
    os.environ.update(env)
    sys.path[:] = path
    sys.argv = [script, *args]
    try:
        runpy.run_path(script, run_name="__main__")
        code = 0
    except SystemExit as stop:
        code = _exit_code(stop.code)
    except BaseException as error:  # noqa: BLE001 - as the interpreter: the traceback on stderr, exit 1
        traceback.print_exc()
        code = -signal.SIGINT if isinstance(error, KeyboardInterrupt) else 1
    threading._shutdown()  # as the interpreter at exit: non-daemon threads are joined
    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    if code == -signal.SIGINT:
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGINT)
    os._exit(code)


def _fresh_multiprocessing() -> None:
    """multiprocessing as a fresh interpreter has it: the platform's default start method (a forked process has the
    server's, under which a lock's semaphore outlives a process ended by os._exit), and a resource tracker of its
    own started on first use, which removes what the process leaked when it ends (a forked one was handed the test
    session's)."""
    from multiprocessing import resource_tracker

    multiprocessing.set_start_method(None, force=True)

    tracker = resource_tracker._resource_tracker
    if tracker._fd is not None:
        os.close(tracker._fd)
    tracker._fd = tracker._pid = None


def _exit_code(code) -> int:
    if code is None:
        return 0
    if isinstance(code, int):
        return code
    print(code, file=sys.stderr)
    return 1
