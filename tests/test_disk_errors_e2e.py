"""End to end: a disk that refuses a write ends the run with one line naming the path, what the disk said and
the last checkpoint (exit 1), never a traceback, and leaves no half-written save or record.

No mount is needed for a full disk: the save runs into a file-size limit set in the rank's process right before
it (the fault injection's `full_disk`: RLIMIT_FSIZE, SIGXFSZ ignored; the kernel refuses the write that crosses it,
EFBIG, as a full disk refuses one, ENOSPC), and metrics.jsonl is a link to /dev/full, which refuses every write
with ENOSPC.

Runs where (`make test-failures`, which .ci/run calls): CLI subprocesses, one rank in the CLI's own process; ~1 min on
2 cores.
"""
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.failures  # `make test-failures`, beside `make test`'s 25-minute budget

REPO = Path(__file__).resolve().parents[1]


def _run(tmp_path, *overrides: str, fault: str | None = None) -> subprocess.CompletedProcess:
    env = {**os.environ, "MINDSPEED_RL_INJECT_FAULT": fault} if fault else None
    argv = [sys.executable, "cli/train_grpo.py", "--config-name", "grpo_tiny_cpu",
            f"hydra.run.dir={tmp_path / 'run'}", *overrides]
    return subprocess.run(argv, cwd=REPO, capture_output=True, text=True, timeout=600, env=env)


def _last_line(done: subprocess.CompletedProcess) -> str:
    return [line for line in done.stderr.splitlines() if line.strip()][-1]


def test_a_full_disk_during_a_checkpoint_save_names_the_save_and_the_last_checkpoint(tmp_path):
    save = tmp_path / "save"
    # The first save (iteration 1) is whole; the second runs into the limit with the model's 1.2 MB shard.
    done = _run(tmp_path, "megatron_training.train_iters=3", "megatron_training.save_interval=1",
                f"actor_config.save={save}", fault="save_checkpoint:0:2:full_disk")
    assert done.returncode == 1, done.stderr[-3000:]
    assert "Traceback" not in done.stderr
    line = _last_line(done)
    assert line.startswith(f"disk error during iteration 2: {save}/.tmp_iter_0000002_"), line
    assert line.endswith(f": File too large (EFBIG); last checkpoint: {save / 'iter_0000001'}"), line
    assert [p.name for p in save.iterdir() if p.name.startswith(".tmp")] == [], "the partial save is removed"


def test_a_full_disk_while_writing_metrics_names_the_file(tmp_path):
    metrics = tmp_path / "run" / "metrics.jsonl"
    metrics.parent.mkdir(parents=True)
    metrics.symlink_to("/dev/full")
    done = _run(tmp_path, "megatron_training.train_iters=2")
    assert done.returncode == 1, done.stderr[-3000:]
    assert "Traceback" not in done.stderr
    assert _last_line(done) == (f"disk error during iteration 1: {metrics}: No space left on device (ENOSPC); "
                                "last checkpoint: none (actor_config.save is not set)")
