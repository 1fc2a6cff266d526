"""One call's cgroups (tools/wall.py): what bounds the memory and the process count of a sandboxed call as a whole.

For a root caller a call gets, where the kernel lets one be made, a memory cgroup of its own (cgroup v2:
``memory.max`` = the call's ``memory_limit_mb`` and ``memory.swap.max`` = 0; v1: ``memory.limit_in_bytes`` and, where
swap is accounted, ``memory.memsw.limit_in_bytes`` the same) and a pids cgroup (``pids.max``: the kernel does not
apply RLIMIT_NPROC to root). The wall's launcher joins them before it becomes bwrap, so everything the call runs
counts: every process, its page tables and page cache, and the files it writes in its private tmpfs. Past the
limit the kernel's OOM killer ends one of the call's processes, never one outside it. Each is made under the
caller's own cgroup first (the limits around the trainer still hold around the call), else at its hierarchy's root,
and removed when the call ends.

Where no memory cgroup can be made (a caller that is not root, a read-only cgroup file system, no memory
controller) the call's memory is split instead (:func:`process_budget`): its processes are capped at
``memory_limit // PROCESS_SHARE_BYTES`` (at least 1, at most ``PROCESS_LIMIT - 1``; threads count) and each gets
an equal share of address space (RLIMIT_AS), so together they cannot map more than the limit.
"""
from __future__ import annotations

import functools
import logging
import os
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

PROCESS_LIMIT = 64
PROCESS_SHARE_BYTES = 256 * 1024 * 1024
_NAME_PREFIX = "mindspeed_rl_sandbox_"
_REMOVE_SECONDS = 2.0
_MOUNTINFO = "/proc/self/mountinfo"
_OWN_CGROUPS = "/proc/self/cgroup"
# Where a cgroup of a controller is limited (v2's file, v1's); swap: v2's set to 0, v1's memory+swap to the limit.
_LIMIT_FILES = {"memory": ("memory.max", "memory.limit_in_bytes"), "pids": ("pids.max",)}
_SWAP_FILES = ("memory.swap.max", "memory.memsw.limit_in_bytes")
_PEAK_FILES = ("memory.peak", "memory.max_usage_in_bytes")
logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Budget:
    """What each of the call's processes may map (RLIMIT_AS) and how many the program may run, itself and its
    threads included (bwrap's own two processes come on top)."""

    address_space: int
    processes: int


def process_budget(memory_limit_bytes: int, memory_cgroup: bool) -> Budget:
    """With a memory cgroup the cgroup bounds the total: each process may map the whole limit (a bigger allocation
    is a MemoryError) and the process cap is the usual one. Without, processes x address space <= the limit."""
    if memory_cgroup:
        return Budget(memory_limit_bytes, PROCESS_LIMIT - 1)
    processes = max(1, min(PROCESS_LIMIT - 1, memory_limit_bytes // PROCESS_SHARE_BYTES))
    return Budget(memory_limit_bytes // processes, processes)


class CallCgroups:
    """The cgroups of one call. ``memory`` / ``pids``: the cgroup directory bounding that, or None where none could
    be made here; ``budget``: what the launcher sets as rlimits; ``procs_files``: what the launcher joins."""

    def __init__(self, memory_limit_bytes: int) -> None:
        self.memory: Path | None = None
        self.pids: Path | None = None
        if os.geteuid() == 0:
            self.memory = _make("memory", memory_limit_bytes)
        self.budget = process_budget(memory_limit_bytes, self.memory is not None)
        if os.geteuid() == 0:
            self.pids = _make("pids", self.budget.processes + 2, reuse=self.memory)
            if self.memory is None and self.pids is None:
                _warn_unbounded()

    @property
    def procs_files(self) -> list[str]:
        return [str(path / "cgroup.procs") for path in dict.fromkeys(p for p in (self.memory, self.pids) if p)]

    def memory_peak_bytes(self) -> int | None:
        """The most memory the call held at once, as its memory cgroup measured it (None: no memory cgroup)."""
        for name in _PEAK_FILES if self.memory is not None else ():
            try:
                return int((self.memory / name).read_text(encoding="ascii")[:32])
            except (OSError, ValueError):
                continue
        return None

    def remove(self) -> None:
        for path in dict.fromkeys(p for p in (self.memory, self.pids) if p):
            _remove(path, time.monotonic() + _REMOVE_SECONDS)


def _make(controller: str, limit: int, reuse: Path | None = None) -> Path | None:
    """A new cgroup with ``controller`` limited to ``limit``: ``reuse`` where it has that controller too (v2: one
    cgroup for all), else under the caller's own cgroup, else at the hierarchy's root; None where none can be made."""
    if reuse is not None and _set_limit(reuse, controller, limit):
        return reuse
    for parent in candidate_parents(controller):
        if reuse is not None and _is_v2(reuse) and _is_v2(parent):
            continue  # a process is in one v2 cgroup only: joining another would leave the first
        path = parent / f"{_NAME_PREFIX}{uuid.uuid4().hex}"
        try:
            path.mkdir()
        except OSError:
            continue
        if _set_limit(path, controller, limit):
            return path
        _remove(path, time.monotonic())
    return None


def _set_limit(path: Path, controller: str, limit: int) -> bool:
    names = [name for name in _LIMIT_FILES[controller] if (path / name).exists()]
    if not names:
        return False
    try:
        (path / names[0]).write_text(str(limit))
    except OSError:
        return False
    if controller == "memory":  # no swap: the limit is what it holds, not what it holds in RAM
        for swap_file in _SWAP_FILES:
            if (path / swap_file).exists():
                try:
                    (path / swap_file).write_text("0" if swap_file == _SWAP_FILES[0] else str(limit))
                except OSError:
                    return False
    return True


@functools.lru_cache(maxsize=None)  # read once per process: mounts and the caller's cgroups do not move
def candidate_parents(controller: str) -> tuple[Path, ...]:
    """Directories where a cgroup with ``controller`` may be made: the caller's own cgroup, then the root, of each
    hierarchy that has it (v1: mounted with it; v2: the parent's subtree_control lists it)."""
    own = _own_cgroups()
    parents: list[Path] = []
    for mount_root, mount_point, fstype, options in _cgroup_mounts():
        key = "" if fstype == "cgroup2" else controller
        if key and controller not in options.split(",") or key not in own:
            continue
        for parent in (Path(mount_point + _relative(own[key], mount_root)), Path(mount_point)):
            if parent not in parents and (key or _enabled_v2(parent, controller)):
                parents.append(parent)
    return tuple(parents)


def _is_v2(path: Path) -> bool:
    return (path / "cgroup.controllers").exists()


def _relative(own: str, mount_root: str) -> str:
    """The caller's cgroup below a mount of its hierarchy ("" where the mount does not hold it)."""
    if mount_root == "/":
        return own.rstrip("/")
    return own[len(mount_root):].rstrip("/") if own == mount_root or own.startswith(mount_root + "/") else ""


def _enabled_v2(parent: Path, controller: str) -> bool:
    try:
        return controller in (parent / "cgroup.subtree_control").read_text().split()
    except OSError:
        return False


def _own_cgroups() -> dict[str, str]:
    """The caller's cgroup per v1 controller, and under "" its v2 cgroup."""
    own: dict[str, str] = {}
    try:
        lines = Path(_OWN_CGROUPS).read_text().splitlines()
    except OSError:
        return own
    for line in lines:
        _, controllers, path = (line.split(":", 2) + ["", ""])[:3]
        for controller in controllers.split(",") if controllers else [""]:
            own[controller] = path
    return own


def _cgroup_mounts() -> list[tuple[str, str, str, str]]:
    """(root within the hierarchy, mount point, fstype, super options) of each mounted cgroup hierarchy."""
    mounts = []
    try:
        lines = Path(_MOUNTINFO).read_text().splitlines()
    except OSError:
        return mounts
    for line in lines:
        fields, _, tail = line.partition(" - ")
        fields, tail = fields.split(), tail.split()
        if len(fields) >= 5 and len(tail) >= 3 and tail[0] in ("cgroup", "cgroup2"):
            unescape = lambda text: text.replace("\\040", " ")  # noqa: E731 (mountinfo escapes spaces)
            mounts.append((unescape(fields[3]), unescape(fields[4]), tail[0], tail[2]))
    return mounts


def _remove(path: Path, deadline: float) -> None:
    """rmdir once its processes are gone: the PID namespace dies with the call, but its last processes may still be
    exiting when the call returns (the cgroup is busy until then): retried until ``deadline``, then left."""
    while True:
        try:
            path.rmdir()
            return
        except FileNotFoundError:
            return
        except OSError:
            if time.monotonic() >= deadline:
                return
            time.sleep(0.01)


@functools.lru_cache(maxsize=1)
def _warn_unbounded() -> None:
    logger.warning("no memory or pids cgroup can be made here: a root caller's sandboxed calls are bounded in memory "
                   "per process only, and in number of processes by the time limit alone")
