"""Generated demo assets, content-addressed: one directory per parameter set, made once, never modified.

``ensure_generated(data_dir, task, params, ...)`` returns ``data_dir/<task>-<digest>/``, the digest being a
short sha256 of the task and its generation parameters. Two runs sharing ``data_dir`` with different
parameters therefore never read each other's files, and a run never sees its directory rewritten under it.

A directory is generated into a staging sibling while an exclusive ``fcntl.flock`` on ``data_dir/.lock`` is
held, fsynced, then renamed into place, so it exists whole or not at all; once there it is only read. The lock
is taken only to generate. A flock dies with its process, so a run killed while generating leaves the
lock file (harmless: nobody holds it) and a staging directory, which the next generator removes.
"""
from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import tempfile
from pathlib import Path
from typing import Any, Callable, Iterable

from mindspeed_rl.atomic_files import write_text_atomic
from mindspeed_rl.checkpoint.store import fsync_path
from mindspeed_rl.errors import ConfigError
from mindspeed_rl.locks import exclusive_lock

MANIFEST_FILE = "assets.json"
LOCK_FILE = ".lock"
DIGEST_CHARS = 12
DATA_DIR_KEY = "synthetic_data.data_dir"
_STAGING = re.compile(rf"^\.[A-Za-z0-9_]+-[0-9a-f]{{{DIGEST_CHARS}}}\.tmp-")


def manifest_of(task: str, params: dict[str, Any]) -> dict[str, Any]:
    if "task" in params:
        raise ValueError(f"params must not hold 'task' (given separately as {task!r}), got {params['task']!r}")
    return {"task": task, **params}


def asset_dir_name(task: str, params: dict[str, Any]) -> str:
    """``<task>-<digest>``: equal for equal parameters (key order does not matter), different otherwise."""
    canonical = json.dumps(manifest_of(task, params), sort_keys=True, separators=(",", ":"))
    return f"{task}-{hashlib.sha256(canonical.encode('utf-8')).hexdigest()[:DIGEST_CHARS]}"


def ensure_generated(data_dir: str | os.PathLike[str], task: str, params: dict[str, Any], *,
                     required: Iterable[str], generate: Callable[[Path, dict[str, Any]], None]) -> Path:
    """The complete asset directory of (task, params) under ``data_dir``; ``generate(staging_dir, params)``
    runs only when no process has made it yet. Safe to call from any number of processes at once."""
    root = Path(data_dir)
    final = root / asset_dir_name(task, params)
    required = tuple(required)
    if final.is_dir():
        _check_complete(final, task, params, required)
        return final
    root.mkdir(parents=True, exist_ok=True)
    with exclusive_lock(root / LOCK_FILE):
        if final.is_dir():  # another process made it while this one waited for the lock
            _check_complete(final, task, params, required)
            return final
        _remove_abandoned_staging(root)
        staging = Path(tempfile.mkdtemp(prefix=f".{final.name}.tmp-", dir=root))
        try:
            generate(staging, params)
            missing = [name for name in required if not (staging / name).is_file()]
            if missing:
                raise RuntimeError(f"the {task} generator did not write {', '.join(missing)} into {staging}")
            write_text_atomic(staging / MANIFEST_FILE, json.dumps(manifest_of(task, params), indent=2, sort_keys=True))
            _fsync_tree(staging)
            os.rename(staging, final)
            fsync_path(root)
        except BaseException:
            shutil.rmtree(staging, ignore_errors=True)
            raise
    return final


def _remove_abandoned_staging(root: Path) -> None:
    # Called with the lock held: every live generator holds it too, so any staging directory left is from a
    # process that died while generating.
    for entry in root.iterdir():
        if entry.is_dir() and _STAGING.match(entry.name):
            shutil.rmtree(entry, ignore_errors=True)


def _check_complete(final: Path, task: str, params: dict[str, Any], required: tuple[str, ...]) -> None:
    # Only a complete staging directory is ever renamed to `final`; anything else was changed afterwards.
    missing = [name for name in (MANIFEST_FILE, *required) if not (final / name).is_file()]
    problem = f"{', '.join(missing)} missing" if missing else None
    if problem is None:
        try:
            recorded = json.loads((final / MANIFEST_FILE).read_text(encoding="utf-8"))
        except (OSError, json.JSONDecodeError) as error:
            recorded = f"unreadable ({error})"
        if recorded != manifest_of(task, params):
            problem = f"{MANIFEST_FILE} records other parameters: {recorded}"
    if problem is not None:
        raise ConfigError(DATA_DIR_KEY, f"{final} was changed after it was generated ({problem}); "
                                        "remove that directory to generate it again")


def _fsync_tree(top: Path) -> None:
    for directory, _, files in os.walk(top):
        for name in files:
            fsync_path(Path(directory) / name)
        fsync_path(Path(directory))
