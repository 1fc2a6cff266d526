"""Where each iteration's metrics go: one JSON line in metrics.jsonl, and each tracker's scalars
(trainer/trackers.py: TensorBoard event files, wandb, SwanLab, MLflow)."""
from __future__ import annotations

import contextlib
import json
import os
import stat
import threading
from pathlib import Path

TENSORBOARD_SUBDIR = "tensorboard"


class MetricsSinks:
    def __init__(self, run_dir: Path, *, metrics_file: str, trackers: list | None = None):
        self.metrics_path = run_dir / metrics_file
        self.trackers = list(trackers or [])

    def write(self, record: dict) -> None:
        append_jsonl(self.metrics_path, record)
        scalars = {key: value for key, value in record.items()
                   if key != "iteration" and isinstance(value, (int, float))}
        for tracker in self.trackers:
            tracker.log(scalars, step=int(record["iteration"]))

    def close(self) -> None:
        trackers, self.trackers = self.trackers, []  # closed once, even when closing fails
        for tracker in trackers:
            tracker.close()


@contextlib.contextmanager
def errors_name(path: Path):
    """An OSError without a file name gets `path`: TensorBoard's writer thread re-raises the disk's error on the
    next flush without saying which file it was writing."""
    try:
        yield
    except OSError as error:
        if error.filename or error.errno is None:
            raise
        raise OSError(error.errno, error.strerror or str(error), str(path)) from error


def quiet_tensorboard_thread_errors() -> None:
    """TensorBoard's writer thread prints its error's traceback as it dies and the writer raises the same error
    on the next flush in the trainer's thread, which ends the run with one line; the thread's copy is dropped."""
    previous = threading.excepthook
    if getattr(previous, "quiets_tensorboard", False):
        return

    def hook(args) -> None:
        if type(args.thread).__name__ == "_AsyncWriterThread" and issubclass(args.exc_type, Exception):
            return
        previous(args)

    hook.quiets_tensorboard = True
    threading.excepthook = hook


def append_jsonl(path: Path, record: dict) -> None:
    """Append one JSON line durably; on failure the file is cut back to its last whole line.

    A full disk (or a file-size limit) can accept part of a write: without the truncate the file would end
    in half a record, which every later reader (curves, resume) trips over.
    """
    data = (json.dumps(record) + "\n").encode("utf-8")
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        status = os.fstat(fd)
        try:
            _write_all(fd, data)
            os.fsync(fd)
        except OSError as error:
            what = error.strerror or str(error)
            if stat.S_ISREG(status.st_mode):  # a device or a pipe cannot be cut back
                os.ftruncate(fd, status.st_size)
                what += f"; the file was cut back to its {status.st_size} bytes of whole records"
            raise OSError(error.errno, what, str(path)) from error
    finally:
        os.close(fd)


def _write_all(fd: int, data: bytes) -> None:
    # os.write may write fewer bytes than asked (a file-size limit, a nearly full disk); the rest follows.
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]
