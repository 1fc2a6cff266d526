"""Launch `python cli/train_grpo.py` as a user would (own session, like a terminal's foreground job; forked from the
session's preloaded server, tests/preloaded.py), watch its output line by line, signal it, and list what it leaves
behind: for the failure tests."""
from __future__ import annotations

import os
import queue
import signal
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from preloaded import ScriptProcess

REPO = Path(__file__).resolve().parents[1]


def session_processes(session_id: int) -> dict[int, str]:
    """Live processes of a session: the driver was started in its own, and Ray's daemons, workers and
    their children inherit it."""
    found = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
            cmdline = Path(f"/proc/{entry}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        fields = stat.rsplit(")", 1)[1].split()
        if fields[0] != "Z" and int(fields[3]) == session_id:
            found[int(entry)] = cmdline.strip()
    return found


def shm_entries() -> set[str]:
    return set(os.listdir("/dev/shm")) if os.path.isdir("/dev/shm") else set()


@dataclass
class WatchedRun:
    process: ScriptProcess
    started: float
    lines: "queue.Queue[tuple[float, str]]" = field(default_factory=queue.Queue)
    stdout: list[str] = field(default_factory=list)
    stderr: list[str] = field(default_factory=list)

    def wait_for(self, marker: str, timeout: float = 300.0) -> float:
        """Block until a stdout line contains `marker`; returns when it was seen (monotonic)."""
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            try:
                seen, line = self.lines.get(timeout=0.5)
            except queue.Empty:
                if self.process.poll() is not None and self.lines.empty():
                    break
                continue
            if marker in line:
                return seen
        raise AssertionError(f"{marker!r} never printed; stdout tail:\n" + "".join(self.stdout[-30:])
                             + "\nstderr tail:\n" + "".join(self.stderr[-30:]))

    def wait_for_file_line(self, path: Path, marker: str, timeout: float = 300.0) -> float:
        """Block until a line of `path` (written by the run's workers) contains `marker`; returns when."""
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            if path.is_file() and marker in path.read_text():
                return time.monotonic()
            if self.process.poll() is not None and not (path.is_file() and marker in path.read_text()):
                break
            time.sleep(0.05)
        raise AssertionError(f"{marker!r} never written to {path}; stderr tail:\n" + "".join(self.stderr[-30:]))

    def signal_group(self, signum: int) -> None:
        """What a terminal does on Ctrl-C: the signal goes to every process of the foreground group."""
        os.killpg(self.process.pid, signum)

    def finish(self, timeout: float = 300.0) -> tuple[int, float]:
        """(exit code, when it exited)."""
        code = self.process.wait(timeout=timeout)
        ended = time.monotonic()
        self._readers_done.wait(timeout=10)
        return code, ended

    def stderr_text(self) -> str:
        return "".join(self.stderr)

    def stdout_text(self) -> str:
        return "".join(self.stdout)


def launch(tmp_path: Path, config_name: str, *overrides: str, env: dict[str, str] | None = None,
           script: str = "cli/train_grpo.py", shared_ray: bool = False) -> WatchedRun:
    """`shared_ray`: a run that needs Ray joins the session's cluster (cli_runner.shared_ray_address); its ranks are
    then not in the run's session, so tests that look for what a run leaves behind keep their own (the default)."""
    from cli_runner import NO_PLOTS

    args = ["--config-name", config_name, *NO_PLOTS, *overrides, f"hydra.run.dir={tmp_path / 'run'}"]
    ray_env = {}
    if shared_ray:
        from cli_runner import shared_ray_address

        ray_env = {"RAY_ADDRESS": shared_ray_address()}
    process = ScriptProcess(script, args, cwd=REPO, env={**os.environ, **ray_env, **(env or {})})
    run = WatchedRun(process=process, started=time.monotonic())
    done = [threading.Event(), threading.Event()]

    def pump(stream, sink: list[str], event: threading.Event, to_queue: bool) -> None:
        for line in stream:
            sink.append(line)
            if to_queue:
                run.lines.put((time.monotonic(), line))
        event.set()

    threading.Thread(target=pump, args=(process.stdout, run.stdout, done[0], True), daemon=True).start()
    threading.Thread(target=pump, args=(process.stderr, run.stderr, done[1], False), daemon=True).start()

    class _Both:
        def wait(self, timeout: float) -> None:
            for event in done:
                event.wait(timeout)

    run._readers_done = _Both()
    return run


def leftovers(run: WatchedRun, before_shm: set[str], *, settle_seconds: float = 5.0):
    """(processes of the run's session, new /dev/shm entries) still there after a short settle."""
    end = time.monotonic() + settle_seconds
    while True:
        processes = session_processes(run.process.pid)
        shm = shm_entries() - before_shm
        if (not processes and not shm) or time.monotonic() > end:
            return processes, shm
        time.sleep(0.2)
