"""How a run ends when it does not finish: Ctrl-C / SIGTERM (mindspeed_rl/interrupts.py), a worker
that failed (workers/supervision.py), or a disk that refused a write (full, over quota, read-only, failing).
The CLI prints one line and exits 128 + the signal number (130, 143), or 1 for a failure."""
from __future__ import annotations

import errno
import os
import signal
from dataclasses import dataclass, field
from pathlib import Path

from mindspeed_rl.checkpoint.store import LATEST_NAME
from mindspeed_rl.memory.capacity import MARK, failure_phase_and_detail

WORKER_FAILURE_EXIT_CODE = 1
# A write the disk refused: no space, over quota, a read-only filesystem, an I/O error, a file-size limit.
DISK_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EIO, errno.EFBIG})


class RunStopped(Exception):
    """The run ended early on purpose; `message` is the one line for the user."""

    def __init__(self, exit_code: int, message: str):
        super().__init__(message)
        self.exit_code = exit_code
        self.message = message


@dataclass(kw_only=True)
class RunProgress:
    """Where the loop is, for the line an interrupted run prints."""

    save_root: str | None = None
    iteration: int = 0                      # the iteration in progress; 0 = start-up
    last_checkpoint: str | None = None      # saved or loaded by this run
    phase: str = field(default="start-up")
    saved_by_this_run: bool = False         # a restart resumes from actor_config.save only then
    restarts: int = 0                       # runtime.max_restarts used so far
    first_iteration: int = 1                # where the run started: its summary covers every iteration from there

    def last_checkpoint_text(self) -> str:
        if self.save_root and (Path(self.save_root) / LATEST_NAME).is_file():
            return str(Path(self.save_root) / (Path(self.save_root) / LATEST_NAME).read_text().strip())
        if self.last_checkpoint:
            return self.last_checkpoint
        return "none" if self.save_root else "none (actor_config.save is not set)"

    def worker_failure_line(self, failure: object) -> str:
        out_of_memory = failure_phase_and_detail(str(failure))
        if out_of_memory is not None:  # the capacity's line first: what ran out, where, on which rank
            phase, detail = out_of_memory
            who = str(failure).split(" failed in ", 1)[0]
            return (f"{MARK}{phase}: {detail}; on {who} during {self._where()}; last checkpoint: "
                    f"{self.last_checkpoint_text()}")
        return f"worker failure during {self._where()}: {failure}; last checkpoint: {self.last_checkpoint_text()}"

    def disk_failure_line(self, error: OSError) -> str:
        return (f"disk error during {self._where()}: {describe_disk_error(error)}; "
                f"last checkpoint: {self.last_checkpoint_text()}")

    def _where(self) -> str:
        return f"iteration {self.iteration}" if self.iteration else self.phase

    def interrupted_line(self, signum: int) -> str:
        where = f"at iteration {self.iteration}" if self.iteration else f"during {self.phase}"
        return f"interrupted by {signal.Signals(signum).name} {where}; last checkpoint: {self.last_checkpoint_text()}"


def describe_disk_error(error: OSError) -> str:
    """`PATH: what the disk said (ENOSPC)` in one line."""
    name = errno.errorcode.get(error.errno, str(error.errno))
    if error.filename:
        return f"{error.filename}: {error.strerror or os.strerror(error.errno)} ({name})"
    return f"{error.strerror or error} ({name})"
