"""The console filter (mindspeed_rl/console.py): our lines and every warning on the console, the libraries'
INFO in the log file only."""

import io
import logging

import pytest

from mindspeed_rl.console import quiet_console, show_progress_bar


@pytest.fixture
def handlers():
    root = logging.getLogger()
    console, file = logging.StreamHandler(io.StringIO()), logging.FileHandler("/dev/null")
    file.stream = io.StringIO()
    saved_level = root.level
    root.setLevel(logging.INFO)
    root.addHandler(console)
    root.addHandler(file)
    yield console.stream, file.stream
    root.removeHandler(console)
    root.removeHandler(file)
    root.setLevel(saved_level)


def test_library_info_goes_to_the_file_only(handlers):
    console, file = handlers
    quiet_console()
    quiet_console()  # idempotent
    logging.getLogger("megatron.core.distributed").info("Params for bucket 1")
    logging.getLogger("megatron.core").warning("a real warning")
    logging.getLogger("mindspeed_rl.memory").info("initialized")
    assert console.getvalue().splitlines() == ["a real warning", "initialized"]
    assert file.getvalue().splitlines() == ["Params for bucket 1", "a real warning", "initialized"]


def test_runtime_log_level_shows_the_libraries_info(handlers):
    console, _ = handlers
    quiet_console("warning")
    quiet_console("info")  # replaces the filter
    logging.getLogger("megatron.core").info("Params for bucket 1")
    logging.getLogger("megatron.core").debug("detail")
    assert console.getvalue().splitlines() == ["Params for bucket 1"]


def test_no_progress_bar_for_small_inputs_or_off_a_terminal():
    assert not show_progress_bar(256)
