"""Exclusive locks on files and directories, which no holder outlives (a crash, SIGKILL, the watchdog's exit).

`exclusive_lock` waits for an flock on a file (a short critical section: generating the demo's assets).
`hold_directory` holds a directory for a whole run (the run directory, the save directory) and refuses at once
a directory another run holds, naming that run. It takes a POSIX record lock (`lockf`), which belongs to the
process alone: children a run forks (Megatron's checkpoint writer starts a multiprocessing Manager) do not
inherit it, so an orphan left by a killed run cannot keep the directory locked. Lock files are never removed:
unlinking one while another process waits on it would let a third process lock a new file of the same name.
"""
from __future__ import annotations

import contextlib
import fcntl
import json
import os
import socket
import time
from pathlib import Path
from typing import Iterator

from mindspeed_rl.errors import ConfigError

RUN_LOCK_FILE = ".mindspeed_rl.lock"


@contextlib.contextmanager
def exclusive_lock(path: Path) -> Iterator[None]:
    """Wait for the exclusive lock on the file `path` (created if missing); held inside the block."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # releases the flock


@contextlib.contextmanager
def hold_directory(directory: Path, *, key: str) -> Iterator[None]:
    """Hold `directory` (created if missing) for this process inside the block. Another holder: ConfigError
    naming `key`, the holder's pid, host and start time. The holder's line is in the lock file while it holds
    it and removed when it lets go, so a line found with the lock free is a holder that died: said, taken over.
    A directory this call made and nothing else wrote into is removed again when it lets go (a run refused at its
    start checks leaves no empty save directory behind)."""
    directory = Path(directory)
    made = not directory.exists()
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / RUN_LOCK_FILE
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
    try:
        try:
            fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:  # EAGAIN or EACCES: another process holds it
            raise ConfigError(key, f"{directory} is in use by another run ({_describe(_holder(fd))}); wait for it "
                                   "to end or choose another directory") from None
        left = _read(fd)
        if left:
            print(f"[lock] {directory}: taking over from a run that ended without letting go ({_describe(left)})",
                  flush=True)
        _write(fd, json.dumps({"pid": os.getpid(), "host": socket.gethostname(), "started": time.time()}))
        try:
            yield
        finally:
            _write(fd, "")  # before the lock goes: nobody reads a stale line after a clean release
            if made and [entry.name for entry in directory.iterdir()] == [RUN_LOCK_FILE]:
                path.unlink()  # still held: a run starting now finds no directory and makes its own
                directory.rmdir()
    finally:
        os.close(fd)  # releases the lock


def _holder(fd: int, *, seconds: float = 2.0) -> dict:
    """The holder's line; a holder that has just taken the lock writes it right after, so an empty file is read
    again for up to `seconds` before the holder is called unrecorded."""
    deadline = time.monotonic() + seconds
    while not (holder := _read(fd)) and time.monotonic() < deadline:
        time.sleep(0.05)
    return holder


def _read(fd: int) -> dict:
    os.lseek(fd, 0, os.SEEK_SET)
    text = os.read(fd, 4096).decode("utf-8", errors="replace").strip()
    with contextlib.suppress(ValueError):
        return json.loads(text) if text else {}
    return {"unreadable": text[:80]}


def _write(fd: int, text: str) -> None:
    os.ftruncate(fd, 0)
    os.lseek(fd, 0, os.SEEK_SET)
    os.write(fd, text.encode("utf-8"))


def _describe(holder: dict) -> str:
    if not holder.get("pid"):
        return "its holder is not recorded"
    started = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(holder.get("started", 0)))
    return f"pid {holder['pid']} on {holder.get('host', '?')}, started {started}"
