"""Atomic checkpoint directories: temporary dir, fsync, manifest, rename, `latest` pointer, keep_last_n.

The layout is described in FORMAT.md next to this file. A checkpoint is either complete (renamed into place
with a manifest that matches every file) or invisible: a save killed midway leaves only a `.tmp_*` dir that no
loader looks at, and `latest` still names the previous checkpoint.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

from mindspeed_rl.errors import ConfigError

FORMAT_TAG = "mindspeed_rl.checkpoint/1"
MANIFEST_NAME = "manifest.json"
LATEST_NAME = "latest"
TRAINER_STATE_NAME = "trainer_state.json"  # written by the driver into a save before its manifest
TMP_PREFIX = ".tmp_"
_ITER_DIR = re.compile(r"^iter_(\d{7})$")
_HASH_CHUNK_BYTES = 1 << 20


def iteration_dir_name(iteration: int) -> str:
    return f"iter_{iteration:07d}"


def fsync_path(path: Path) -> None:
    # Directories are fsynced too: a rename is durable only once its parent directory is.
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for chunk in iter(lambda: handle.read(_HASH_CHUNK_BYTES), b""):
            digest.update(chunk)
    return digest.hexdigest()


def _files_under(root: Path) -> list[Path]:
    return sorted(p for p in root.rglob("*") if p.is_file() and p.name != MANIFEST_NAME)


def begin_save(save_root: str | os.PathLike, iteration: int) -> Path:
    """Create and return an empty temporary directory for checkpoint `iteration` under `save_root`."""
    root = Path(save_root)
    root.mkdir(parents=True, exist_ok=True)
    tmp = root / f"{TMP_PREFIX}{iteration_dir_name(iteration)}_{os.getpid()}"
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir()
    return tmp


def check_writable(directory: Path, probe_bytes: int = 1 << 20) -> None:
    """Raise the OSError the disk gives for a write of `probe_bytes` into `directory` (none when it takes it)."""
    probe = Path(directory) / ".write_probe"
    try:
        with open(probe, "wb") as handle:
            handle.write(bytes(probe_bytes))
            handle.flush()
            os.fsync(handle.fileno())
    except OSError as error:
        raise OSError(error.errno, error.strerror, str(directory)) from None
    finally:
        with contextlib.suppress(OSError):
            probe.unlink()


@contextlib.contextmanager
def disk_error_named(directory: Path):
    """A failure of the writes in the block becomes the disk's own error when `directory` refuses a probe write
    (the ranks' torch errors rarely say "no space"); any other failure is raised as it is."""
    try:
        yield
    except Exception:
        check_writable(directory)
        raise


def discard_unfinished_saves(save_root: str | os.PathLike | None) -> None:
    """Remove this process's saves in progress (after its workers are gone: an interrupted run)."""
    if save_root and Path(save_root).is_dir():
        for tmp in Path(save_root).glob(f"{TMP_PREFIX}*_{os.getpid()}"):
            shutil.rmtree(tmp, ignore_errors=True)


def commit_save(tmp_dir: Path, iteration: int, *, keep_last_n: int | None) -> Path:
    """Fsync every file, write the manifest, rename into place, move `latest`, prune; returns the final dir.

    Call once all ranks have finished writing into `tmp_dir` (rank 0 only).
    """
    tmp_dir = Path(tmp_dir)
    root = tmp_dir.parent
    files = {}
    for path in _files_under(tmp_dir):
        fsync_path(path)
        files[path.relative_to(tmp_dir).as_posix()] = {"size": path.stat().st_size, "sha256": _sha256_of(path)}
    for directory in sorted({p.parent for p in tmp_dir.rglob("*")} | {tmp_dir}):
        fsync_path(directory)
    manifest = {"format": FORMAT_TAG, "iteration": iteration, "files": files}
    manifest_path = tmp_dir / MANIFEST_NAME
    manifest_path.write_text(json.dumps(manifest, indent=1, sort_keys=True))
    fsync_path(manifest_path)
    fsync_path(tmp_dir)

    final = root / iteration_dir_name(iteration)
    if final.exists():
        # Re-saving the same iteration (a resumed run saving where it started): the old copy goes first.
        shutil.rmtree(final)
    os.rename(tmp_dir, final)
    fsync_path(root)
    _write_latest(root, final.name)
    _prune(root, keep_last_n=keep_last_n, keep=final.name)
    return final


def _write_latest(root: Path, name: str) -> None:
    tmp = root / f"{LATEST_NAME}.tmp"
    with open(tmp, "w") as handle:
        handle.write(name + "\n")
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(tmp, root / LATEST_NAME)
    fsync_path(root)


def _prune(root: Path, *, keep_last_n: int | None, keep: str) -> None:
    # Stale temporaries from killed saves go too; they were never visible to a loader.
    for stale in root.glob(f"{TMP_PREFIX}*"):
        if stale.is_dir():
            shutil.rmtree(stale, ignore_errors=True)
    if keep_last_n is None:
        return
    saved = sorted(p.name for p in root.iterdir() if p.is_dir() and _ITER_DIR.match(p.name))
    for name in saved[:-keep_last_n] if keep_last_n > 0 else saved:
        if name != keep:
            shutil.rmtree(root / name)


def is_checkpoint_dir(path: str | os.PathLike) -> bool:
    """True if `path` is one of our checkpoints or a save root (a `latest` pointer, or `iter_*` checkpoints
    whose pointer is gone); not an HF dir."""
    path = Path(path)
    return (path / MANIFEST_NAME).is_file() or _is_save_root(path)


@dataclass(frozen=True, kw_only=True)
class VerifiedCheckpoint:
    path: Path
    iteration: int


def resolve_and_verify(load_path: str | os.PathLike, *, key: str,
                       fall_back_to_intact: bool = False) -> VerifiedCheckpoint:
    """The checkpoint `load_path` names (itself, or its save root's `latest`, or without `latest` the newest
    complete `iter_*`, said in one line), every file checked.

    A file missing, of the wrong size or checksum raises ConfigError(key, ...) naming it; in a save root the
    message also names the newest older checkpoint that is intact and how to resume from it, and with
    `fall_back_to_intact` that one is returned instead (said in one line)."""
    path = Path(load_path)
    if (path / MANIFEST_NAME).is_file() or not _is_save_root(path):
        return _verify(path, key)
    newest = _newest(path, key)
    try:
        return _verify(newest, key)
    except ConfigError as error:
        intact = next((checkpoint for checkpoint in _intact_before(path, newest, key)), None)
        if intact is None:
            raise ConfigError(key, f"{error.message}; no older checkpoint in {path} is intact") from None
        if not fall_back_to_intact:
            raise ConfigError(key, f"{error.message}; the newest intact checkpoint is {intact.path}: resume from it "
                                   f"with {key}={intact.path}, or set runtime.resume_from_last_intact=true") from None
        print(f"[checkpoint] {newest} is damaged ({error.message}); resuming from the newest intact checkpoint, "
              f"{intact.path} (runtime.resume_from_last_intact)", flush=True)
        return intact


def _is_save_root(path: Path) -> bool:
    """`latest`, or an `iter_*` of ours (its manifest, or the trainer state written before it; Megatron's own
    `iter_*` dirs hold `mp_rank_*` and neither)."""
    if (path / LATEST_NAME).is_file():
        return True
    return path.is_dir() and any(
        _ITER_DIR.match(p.name) and ((p / MANIFEST_NAME).is_file() or (p / TRAINER_STATE_NAME).is_file())
        for p in path.iterdir())


def _saved_iterations(root: Path) -> list[Path]:
    """The complete checkpoints (renamed into place with a manifest) under a save root, newest first."""
    found = [p for p in root.iterdir() if _ITER_DIR.match(p.name) and (p / MANIFEST_NAME).is_file()]
    return sorted(found, key=lambda p: p.name, reverse=True)


def _newest(root: Path, key: str) -> Path:
    """The checkpoint `latest` names; without it, the newest complete one."""
    if (root / LATEST_NAME).is_file():
        name = (root / LATEST_NAME).read_text().strip()
        if not _ITER_DIR.match(name):
            raise ConfigError(key, f"{root / LATEST_NAME} names {name!r}, expected iter_NNNNNNN")
        return root / name
    saved = _saved_iterations(root)
    if not saved:
        raise ConfigError(key, f"{root} has no `{LATEST_NAME}` pointer and no complete checkpoint (an "
                               f"iter_NNNNNNN directory with its {MANIFEST_NAME})")
    print(f"[checkpoint] {root} has no `{LATEST_NAME}` pointer: resuming from its newest complete checkpoint, "
          f"{saved[0].name}", flush=True)
    return saved[0]


def _intact_before(root: Path, newest: Path, key: str):
    """The save root's checkpoints older than `newest` that pass verification, newest first."""
    for candidate in _saved_iterations(root):
        if candidate.name < newest.name:
            try:
                yield _verify(candidate, key)
            except ConfigError:
                continue


def _verify(path: Path, key: str) -> VerifiedCheckpoint:
    manifest_path = path / MANIFEST_NAME
    if not manifest_path.is_file():
        raise ConfigError(key, f"{manifest_path} is missing: not a complete mindspeed_rl checkpoint")
    try:
        manifest = json.loads(manifest_path.read_text())
        files = manifest["files"]
        iteration = int(manifest["iteration"])
        if manifest["format"] != FORMAT_TAG:
            raise ValueError(f"format {manifest['format']!r}, expected {FORMAT_TAG!r}")
    except (ValueError, KeyError, TypeError) as error:
        raise ConfigError(key, f"{manifest_path} is unreadable: {error}") from None
    for relative, expected in sorted(files.items()):
        file_path = path / relative
        if not file_path.is_file():
            raise ConfigError(key, f"{file_path} is missing (listed in {manifest_path})")
        size = file_path.stat().st_size
        if size != expected["size"]:
            raise ConfigError(key, f"{file_path} has {size} bytes, the manifest says {expected['size']} "
                                   "(truncated or partial checkpoint)")
        if _sha256_of(file_path) != expected["sha256"]:
            raise ConfigError(key, f"{file_path} does not match its sha256 in {manifest_path} (corrupt)")
    return VerifiedCheckpoint(path=path, iteration=iteration)


def replace_dir(src: Path, dst: Path) -> None:
    """Move directory ``src`` to ``dst``, replacing an existing ``dst`` whole.

    ``os.replace`` cannot overwrite a non-empty directory, so the old one is first renamed
    aside; ``dst`` is then either the old or the new complete directory, or briefly absent.
    """
    if dst.exists():
        trash = Path(tempfile.mkdtemp(prefix=f".{dst.name}.old-", dir=dst.parent))
        os.replace(dst, trash / dst.name)
        os.replace(src, dst)
        shutil.rmtree(trash, ignore_errors=True)
    else:
        os.replace(src, dst)
