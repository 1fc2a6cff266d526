"""Run a Python program on this host behind a hard wall: time, memory and output are bounded whatever it does.

What the wall is. The program runs in a fresh interpreter (``sys.executable -I``: no user site, no PYTHON*
variables, the script's directory not on sys.path) with a minimal environment, in a temporary directory that is
removed afterwards, as its own session (process group). In the child, before the program starts: RLIMIT_AS
(memory per process: a bigger allocation raises MemoryError; inside the wall the call's budget, tools/cgroups.py),
RLIMIT_CPU (timeout + 1 s) and RLIMIT_FSIZE (output files: Python ignores SIGXFSZ, so a write past it raises
OSError). The parent polls the run: at the wall-clock limit, or as soon as stdout or stderr has grown past
``max_output_bytes``, the whole process group is killed with SIGKILL.
stdout and stderr go to files in the temporary directory, not pipes: a pipe read with communicate() would hold
an unbounded output in the parent's memory. At most ``max_output_bytes`` of each is read back.

The limits are set by a small launcher that execs the program's interpreter (rlimits survive exec), not by
``preexec_fn``: the rollout runs tools from a thread pool, and ``preexec_fn`` is unsafe in threaded programs.

The security boundary is the wall (tools/wall.py): each run is a bubblewrap sandbox in its own user, mount, PID,
network, IPC and UTS namespaces, with no view of the host's files, processes or network, every descendant killed
when the call ends, a bound on its process count, and one on the memory its processes hold together (a memory
cgroup per call, or a per-process share of ``memory_limit_mb``: tools/cgroups.py). ``isolated=False`` (the tool
config's ``allow_unisolated`` where no wall can be built) runs without it: then the program runs as this user, can
read files and use the network, a grandchild that starts its own session leaves the process group, and
``memory_limit_mb`` holds per process only.
"""

from __future__ import annotations

import math
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from typing import IO

from mindspeed_rl.tools import wall

FINISHED = "Finished"
FAILED = "Failed"
TIME_LIMIT_EXCEEDED = "TimeLimitExceeded"
OUTPUT_LIMIT_EXCEEDED = "OutputLimitExceeded"
STATUSES = (FINISHED, FAILED, TIME_LIMIT_EXCEEDED, OUTPUT_LIMIT_EXCEEDED)

_POLL_SECONDS = 0.02
_MIB = 1024 * 1024
# Set the limits, then become the program's interpreter. A limit above the current hard limit cannot be raised
# by an unprivileged process: the lower one holds.
_LAUNCHER = """\
import os, resource, sys
for name, value in zip(("RLIMIT_AS", "RLIMIT_CPU", "RLIMIT_FSIZE", "RLIMIT_NPROC"), map(int, sys.argv[1:5])):
    if value < 0:
        continue
    kind = getattr(resource, name)
    hard = resource.getrlimit(kind)[1]
    soft = value if hard == resource.RLIM_INFINITY else min(value, hard)
    # CPU: SIGXCPU at the soft limit, and SIGKILL a second later for a program that catches SIGXCPU.
    if name == "RLIMIT_CPU" and (hard == resource.RLIM_INFINITY or soft < hard):
        resource.setrlimit(kind, (soft, soft + 1))
    else:
        resource.setrlimit(kind, (soft, soft))
os.execv(sys.executable, [sys.executable, "-I", sys.argv[5]])
"""
# Outside the wall: join the call's cgroups (its memory and process bounds: argv[1] of them), then become bwrap.
# A cgroup that cannot be joined fails the call: it never runs without the bounds it was given.
_WALL_LAUNCHER = """\
import os, sys
count = int(sys.argv[1])
for procs_file in sys.argv[2:2 + count]:
    with open(procs_file, "w") as procs:
        procs.write(str(os.getpid()))
os.execv(sys.argv[2 + count], sys.argv[2 + count:])
"""


@dataclass(frozen=True)
class SandboxRun:
    """How a run ended: ``status`` is one of :data:`STATUSES` (SandboxFusion's run statuses, plus
    OutputLimitExceeded); ``stdout``/``stderr`` are at most the output limit each; ``seconds`` is wall time."""

    status: str
    stdout: str
    stderr: str
    seconds: float


def run_python(code: str, *, timeout_seconds: float, memory_limit_mb: int,
               max_output_bytes: int = 64 * 1024, isolated: bool = True) -> SandboxRun:
    """Run ``code`` as a Python program, inside the wall unless ``isolated`` is False: Finished (exit 0), Failed
    (non-zero exit, e.g. an exception or a MemoryError), TimeLimitExceeded (killed at ``timeout_seconds`` of wall
    time or at its CPU limit) or OutputLimitExceeded (stdout or stderr over ``max_output_bytes``). Returns within
    about timeout + 0.1 s."""
    _check_limits(timeout_seconds, memory_limit_mb, max_output_bytes)
    start = time.monotonic()
    workdir = tempfile.mkdtemp(prefix="mindspeed_rl_sandbox_")
    try:
        with open(os.path.join(workdir, "stdout"), "wb+") as out, open(os.path.join(workdir, "stderr"), "wb+") as err:
            status = _run(code, workdir, out, err, timeout_seconds, memory_limit_mb, max_output_bytes, isolated)
            stdout, stderr = _read_back(out, max_output_bytes), _read_back(err, max_output_bytes)
        return SandboxRun(status=status, stdout=stdout, stderr=stderr, seconds=time.monotonic() - start)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


def _run(code: str, workdir: str, out: IO[bytes], err: IO[bytes], timeout_seconds: float, memory_limit_mb: int,
         max_output_bytes: int, isolated: bool) -> str:
    program = os.path.join(workdir, "main.py")
    with open(program, "w", encoding="utf-8", errors="surrogatepass") as file:
        file.write(code)
    cgroups = wall.CallCgroups(memory_limit_mb * _MIB) if isolated else None
    try:
        command = _command(program, cgroups, timeout_seconds, memory_limit_mb, max_output_bytes)
        process = subprocess.Popen(command, cwd=workdir, env=_minimal_env(wall.SANDBOX_DIR if isolated else workdir),
                                   stdin=subprocess.DEVNULL, stdout=out, stderr=err, start_new_session=True)
        try:
            stopped = _wait(process.pid, time.monotonic() + timeout_seconds, (out, err), max_output_bytes)
        finally:
            # The leader is not reaped yet (waitid with WNOWAIT), so its group id cannot have been reused: killing
            # the group reaches every process it left behind (inside the wall: bwrap, whose death ends the PID
            # namespace and everything in it).
            _kill_group(process.pid)
            returncode = process.wait()
    finally:
        if cgroups is not None:
            cgroups.remove()
    if stopped is not None:
        return stopped
    if _over_limit((out, err), max_output_bytes):
        return OUTPUT_LIMIT_EXCEEDED
    if returncode == -signal.SIGXCPU:
        return TIME_LIMIT_EXCEEDED
    return FINISHED if returncode == 0 else FAILED


def _command(program: str, cgroups: wall.CallCgroups | None, timeout_seconds: float, memory_limit_mb: int,
             max_output_bytes: int) -> list[str]:
    """The launcher's command line: inside the wall (``cgroups`` given) the call's budget (memory per process and
    the process cap: tools/cgroups.py) and its cgroups; unisolated, the memory limit per process and no process cap
    (RLIMIT_NPROC would count the trainer's own)."""
    budget = cgroups.budget if cgroups is not None else wall.Budget(memory_limit_mb * _MIB, -1)
    nproc = budget.processes + 1 if cgroups is not None else -1  # + bwrap's init, counted in the sandbox's user ns
    limits = [str(budget.address_space), str(math.ceil(timeout_seconds) + 1), str(max_output_bytes + 1), str(nproc)]
    command = [sys.executable, "-I", "-c", _LAUNCHER, *limits, wall.PROGRAM if cgroups is not None else program]
    if cgroups is None:
        return command
    procs_files = cgroups.procs_files
    return [sys.executable, "-I", "-c", _WALL_LAUNCHER, str(len(procs_files)), *procs_files,
            *wall.wall_arguments(program), *command]


def _wait(pid: int, deadline: float, outputs: tuple[IO[bytes], ...], max_output_bytes: int) -> str | None:
    """None once the program exits (left unreaped), else the status of the limit it ran into."""
    while True:
        try:
            if os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is not None:
                return None
        except ChildProcessError:  # SIGCHLD ignored by the host program: the kernel reaped it already
            return None
        if _over_limit(outputs, max_output_bytes):
            return OUTPUT_LIMIT_EXCEEDED
        left = deadline - time.monotonic()
        if left <= 0:
            return TIME_LIMIT_EXCEEDED
        time.sleep(min(_POLL_SECONDS, left))


def _over_limit(outputs: tuple[IO[bytes], ...], max_output_bytes: int) -> bool:
    return any(os.fstat(output.fileno()).st_size > max_output_bytes for output in outputs)


def _kill_group(pgid: int) -> None:
    try:
        os.killpg(pgid, signal.SIGKILL)
    except ProcessLookupError:
        pass  # the program and everything it started have already exited


def _read_back(output: IO[bytes], max_output_bytes: int) -> str:
    output.seek(0)
    return output.read(max_output_bytes).decode("utf-8", errors="replace")


def _minimal_env(workdir: str) -> dict[str, str]:
    # One thread per numeric library: a BLAS pool per core would count against RLIMIT_AS and the host's cores.
    return {"PATH": "/usr/local/bin:/usr/bin:/bin", "HOME": workdir, "TMPDIR": workdir, "LANG": "C.UTF-8",
            "LC_ALL": "C.UTF-8", "OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}


def _check_limits(timeout_seconds: float, memory_limit_mb: int, max_output_bytes: int) -> None:
    if not (isinstance(timeout_seconds, (int, float)) and 0 < timeout_seconds < float("inf")):
        raise ValueError(f"timeout_seconds must be a positive number, got {timeout_seconds!r}")
    for name, value in (("memory_limit_mb", memory_limit_mb), ("max_output_bytes", max_output_bytes)):
        if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
            raise ValueError(f"{name} must be a positive integer, got {value!r}")
