"""The directory lock a run holds on its run and save directories (mindspeed_rl/locks.py): a second holder is
refused naming the first, a clean release leaves nothing, a killed holder's lock is taken over with a line, and
a child the holder forked does not keep it.

Runs where: the pytest process and `python -c` holders in subprocesses.
"""
import os
import signal
import subprocess
import sys
import time

import pytest

from mindspeed_rl.config import ConfigError
from mindspeed_rl.locks import hold_directory

HOLDER = """
import os, sys, time
from mindspeed_rl.locks import hold_directory
with hold_directory(sys.argv[1], key="hydra.run.dir"):
    if sys.argv[2] == "fork" and os.fork() == 0:
        time.sleep(60)  # a child that outlives its parent, as Megatron's checkpoint writer can
        os._exit(0)
    print("held", flush=True)
    time.sleep(60)
"""


def _holder(directory, mode: str = "plain") -> subprocess.Popen:
    process = subprocess.Popen([sys.executable, "-c", HOLDER, str(directory), mode], stdout=subprocess.PIPE, text=True)
    assert process.stdout.readline().strip() == "held"
    return process


def test_a_second_run_is_refused_naming_the_holder(tmp_path):
    holder = _holder(tmp_path)
    try:
        with pytest.raises(ConfigError) as info:
            with hold_directory(tmp_path, key="hydra.run.dir"):
                pass
        message = str(info.value)
        assert message.startswith(f"hydra.run.dir: {tmp_path} is in use by another run (pid {holder.pid} on ")
        assert ", started 20" in message and message.endswith("wait for it to end or choose another directory")
    finally:
        holder.kill()
        holder.wait()


def test_a_clean_release_leaves_the_directory_free_and_unmarked(tmp_path, capsys):
    with hold_directory(tmp_path, key="k"):
        pass
    with hold_directory(tmp_path, key="k"):
        pass
    assert "[lock]" not in capsys.readouterr().out


def test_the_lock_of_a_killed_run_is_taken_over_with_a_line(tmp_path, capsys):
    holder = _holder(tmp_path)
    holder.send_signal(signal.SIGKILL)
    holder.wait()
    with hold_directory(tmp_path, key="k"):
        out = capsys.readouterr().out
    assert out.startswith(f"[lock] {tmp_path}: taking over from a run that ended without letting go "
                          f"(pid {holder.pid} on ")


def test_a_child_of_a_killed_holder_does_not_keep_the_lock(tmp_path):
    holder = _holder(tmp_path, "fork")
    children = [int(pid) for pid in open(f"/proc/{holder.pid}/task/{holder.pid}/children").read().split()]
    assert children, "the holder forked a child"
    try:
        holder.send_signal(signal.SIGKILL)
        holder.wait()
        time.sleep(0.2)
        assert os.path.exists(f"/proc/{children[0]}"), "the child is still alive"
        with hold_directory(tmp_path, key="k"):
            pass
    finally:
        for child in children:
            os.kill(child, signal.SIGKILL)


def test_a_directory_it_made_and_nothing_wrote_into_is_gone_after_the_release(tmp_path):
    """A run refused at its start checks (after it held its save directory) leaves no empty save directory."""
    made = tmp_path / "ckpt"
    with hold_directory(made, key="actor_config.save"):
        assert made.is_dir()
    assert not made.exists()


def test_a_directory_that_was_there_or_got_files_stays(tmp_path):
    there = tmp_path / "there"
    there.mkdir()
    with hold_directory(there, key="actor_config.save"):
        pass
    assert there.is_dir()
    written = tmp_path / "written"
    with hold_directory(written, key="actor_config.save"):
        (written / "iter_0000001").mkdir()
    assert (written / "iter_0000001").is_dir()
