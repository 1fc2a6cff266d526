"""metrics.jsonl keeps only whole lines when the disk fills: a file-size limit (RLIMIT_FSIZE) makes the
kernel accept part of a write and then refuse, exactly as a full disk does."""
import json
import subprocess
import sys
import textwrap
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

# Runs in a child process: the limit and the ignored SIGXFSZ must not reach pytest itself.
_CHILD = textwrap.dedent("""
    import resource, signal, sys
    from pathlib import Path
    from mindspeed_rl.trainer.sinks import append_jsonl

    path = Path(sys.argv[1])
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # else the kernel kills the process at the limit
    resource.setrlimit(resource.RLIMIT_FSIZE, (1000, resource.RLIM_INFINITY))
    for iteration in range(1, 1000):
        try:
            append_jsonl(path, {"iteration": iteration, "reward/mean": 0.125, "pad": "x" * 37})
        except OSError as error:
            print(f"FAILED_AT {iteration}")
            print(f"ERROR {error}")
            sys.exit(0)
    print("NEVER_FAILED")
""")


def test_a_write_past_the_limit_leaves_only_whole_lines_and_names_the_file(tmp_path):
    path = tmp_path / "metrics.jsonl"
    done = subprocess.run([sys.executable, "-c", _CHILD, str(path)], cwd=REPO, capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 0, done.stderr[-2000:]
    lines = done.stdout.splitlines()
    assert lines[0].startswith("FAILED_AT "), done.stdout
    failed_at = int(lines[0].split()[1])
    assert str(path) in lines[1]

    text = path.read_text()
    assert text.endswith("\n")
    records = [json.loads(line) for line in text.splitlines()]
    # Every record before the failing one is there, whole, and nothing of the failing one.
    assert [r["iteration"] for r in records] == list(range(1, failed_at))
    assert failed_at > 1
    # The limit cut the failing record mid-line (1000 is not a multiple of the record length).
    assert len(text.encode()) < 1000 < len(text.encode()) + len(json.dumps(records[0])) + 1



_TENSORBOARD_CHILD = textwrap.dedent("""
    import resource, signal, sys
    from pathlib import Path
    from mindspeed_rl.trainer.sinks import MetricsSinks
    from mindspeed_rl.trainer.trackers import TensorBoardTracker

    sinks = MetricsSinks(Path(sys.argv[1]), metrics_file="metrics.jsonl",
                         trackers=[TensorBoardTracker(Path(sys.argv[1]))])
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    # TensorBoard's event records are larger than the JSON line: its file reaches the limit first.
    resource.setrlimit(resource.RLIMIT_FSIZE, (20000, resource.RLIM_INFINITY))
    for iteration in range(1, 10000):
        try:
            sinks.write({"iteration": iteration, **{f"metric_{i}": 0.5 for i in range(30)}})
        except OSError as error:
            print(f"ERRNO {error.errno}")
            print(f"FILENAME {error.filename}")
            sys.exit(0)
    print("NEVER_FAILED")
""")


def test_a_full_disk_under_tensorboard_names_its_directory_without_a_thread_traceback(tmp_path):
    done = subprocess.run([sys.executable, "-c", _TENSORBOARD_CHILD, str(tmp_path)], cwd=REPO, capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.splitlines() == ["ERRNO 27", f"FILENAME {tmp_path / 'tensorboard'}"]  # EFBIG, a disk errno
    assert "Traceback" not in done.stderr
