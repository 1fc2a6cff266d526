"""End to end: a disk that refuses a write ends the run with one line naming the path, what the disk said and
the last checkpoint (exit 1), never a traceback, and leaves no half-written save or record.

The full disk is a file-size limit (RLIMIT_FSIZE, with SIGXFSZ ignored): the kernel then refuses the write that
crosses it (EFBIG) as a full disk refuses one (ENOSPC), partly accepted first; no mount is needed.

Runs where: CLI subprocesses, one rank in the CLI's own process; ~1 min on 2 cores.
"""
import json
import resource
import signal
import subprocess
import sys
from pathlib import Path

from test_config import load

from mindspeed_rl.trainer import setup

REPO = Path(__file__).resolve().parents[1]


def _run_on_a_small_disk(tmp_path, limit_bytes: int, *overrides: str) -> subprocess.CompletedProcess:
    assets = tmp_path / "assets"
    setup.resolve_assets(load("grpo_tiny_cpu", f"synthetic_data.data_dir={assets}"))  # generated beforehand

    def small_disk() -> None:
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # else the kernel kills the writer at the limit
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit_bytes, resource.RLIM_INFINITY))

    argv = [sys.executable, "cli/train_grpo.py", "--config-name", "grpo_tiny_cpu", f"synthetic_data.data_dir={assets}",
            f"hydra.run.dir={tmp_path / 'run'}", *overrides]
    return subprocess.run(argv, cwd=REPO, capture_output=True, text=True, timeout=600, preexec_fn=small_disk)


def _last_line(done: subprocess.CompletedProcess) -> str:
    return [line for line in done.stderr.splitlines() if line.strip()][-1]


def test_a_full_disk_during_a_checkpoint_save_names_the_save_and_the_last_checkpoint(tmp_path):
    save = tmp_path / "save"
    # The model's shard (1.2 MB) crosses the limit in the first save.
    done = _run_on_a_small_disk(tmp_path, 1_000_000, "megatron_training.train_iters=2",
                                "megatron_training.save_interval=1", f"actor_config.save={save}")
    assert done.returncode == 1, done.stderr[-3000:]
    assert "Traceback" not in done.stderr
    line = _last_line(done)
    assert line.startswith(f"disk error during iteration 1: {save}/.tmp_iter_0000001_"), line
    assert line.endswith(": File too large (EFBIG); last checkpoint: none"), line
    assert sorted(p.name for p in save.iterdir() if p.name.startswith(".tmp")) == [], "the partial save is removed"


def test_a_full_disk_while_writing_metrics_names_the_file_and_keeps_whole_records(tmp_path):
    done = _run_on_a_small_disk(tmp_path, 16_000, "megatron_training.train_iters=6")
    assert done.returncode == 1, done.stderr[-3000:]
    assert "Traceback" not in done.stderr
    metrics = tmp_path / "run" / "metrics.jsonl"
    records = [json.loads(line) for line in metrics.read_text().splitlines()]
    assert records and metrics.read_text().endswith("\n")
    failed = len(records) + 1
    assert _last_line(done) == (f"disk error during iteration {failed}: {metrics}: File too large; the file was cut "
                                f"back to its {metrics.stat().st_size} bytes of whole records (EFBIG); last checkpoint: "
                                "none (actor_config.save is not set)")
