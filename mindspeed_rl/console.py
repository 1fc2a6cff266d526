"""What the console shows of a run: this engine's lines and every warning; the INFO chatter of the libraries
underneath (Megatron's bucket listings and configs, vLLM's start-up notes) goes to the run's log file only.

Hydra configures logging before the task starts: one console handler and one file handler
(`<run dir>/<entry point>.log`) on the root logger. The filter sits on the console handler only, so the
file keeps every record.
"""
from __future__ import annotations

import logging
import sys

# Records of these loggers reach the console at any level; others from WARNING up.
OUR_LOGGERS = ("mindspeed_rl", "__main__")
# Below this many rows a progress bar is noise (the tiny demos read 256 prompts in milliseconds).
PROGRESS_BAR_MIN_ROWS = 10_000


LOG_LEVELS = ("debug", "info", "warning", "error")


class _OursOrLibraryLevel(logging.Filter):
    def __init__(self, library_level: int):
        super().__init__()
        self.library_level = library_level

    def filter(self, record: logging.LogRecord) -> bool:
        return record.levelno >= self.library_level or record.name.startswith(OUR_LOGGERS)


def quiet_console(library_level: str = "warning") -> None:
    """Filter the root logger's console handlers (not its file handlers): the libraries' records from
    `library_level` up (runtime.log_level), ours at any level."""
    level = getattr(logging, library_level.upper())
    for handler in logging.getLogger().handlers:
        if isinstance(handler, logging.StreamHandler) and not isinstance(handler, logging.FileHandler):
            for existing in [f for f in handler.filters if isinstance(f, _OursOrLibraryLevel)]:
                handler.removeFilter(existing)
            handler.addFilter(_OursOrLibraryLevel(level))


def show_progress_bar(rows: int) -> bool:
    """A progress bar for long work on a terminal only (a CI log or a file would keep every redraw)."""
    return rows >= PROGRESS_BAR_MIN_ROWS and sys.stderr.isatty()
