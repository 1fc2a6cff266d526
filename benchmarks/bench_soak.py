"""A long run of the demo: does memory or iteration time grow with the number of iterations?

    python benchmarks/bench_soak.py --json FILE [--iterations 2000] [--warmup 100] [--policy fixed|learning]
                                    [--keep-free-heap-too]

Runs `cli/train_grpo.py --config-name grpo_tiny_cpu` (one rank, in the CLI's process, so the process's RSS is the
whole run's) for `--iterations` iterations, reads the process's RSS at every `[iter` line, and prints:
- the RSS slope, MB per 100 iterations, by least squares over the iterations after `--warmup` (target <= 0.2);
- the median seconds per iteration (`timing/all` in metrics.jsonl) of the first and the last 100 iterations after
  the warm-up, and their drift in percent (target <= 2%: a positive drift is a slowdown); and the drift of a
  least-squares line through every iteration's seconds, from its value at the first to its value at the last
  (a shared machine moves 100-iteration medians by +-10% either way; the line weighs the whole run);
- the same for the CPU seconds the process itself spent per iteration (user + system, all its threads), which
  other load on a shared machine moves far less than the wall time: more work per iteration shows there.
The machine's load average is printed beside the figures: a busy machine moves the times, not the RSS.

`--policy fixed` (the default) runs every step of the update at a learning rate of 1e-30, which moves no fp32 weight
(Adam's step is about the learning rate; a weight's spacing is ~1e-9): each iteration then does the same work in
distribution (the same policy samples responses of the same lengths), so a change of time or memory is the engine's.
`--policy learning` runs the demo as it learns: its responses change length as the policy learns, and its time with
them.

`--keep-free-heap-too` runs a second demo at the same time, side by side, with the heap trim off
(MINDSPEED_RL_KEEP_FREE_HEAP=1: glibc keeps the freed chunks, accelerator/host_memory.return_free_heap), and
prints its figures beside the first's: what the per-iteration trim is worth, measured in one run.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import psutil

REPO = Path(__file__).resolve().parents[1]
ITER_LINE = re.compile(r"^\[iter\s+(\d+)\]")
WINDOW = 100


RSS_KINDS = ("RssAnon", "RssFile", "RssShmem")


def rss_kinds(pid: int) -> dict[str, int]:
    """The RSS split as the kernel counts it: anonymous (the heaps), file-backed (library code and data paged in as
    it is first touched: grows with the code paths a run reaches, bounded by the libraries' size) and shared memory."""
    fields = dict(line.split(":", 1) for line in Path(f"/proc/{pid}/status").read_text().splitlines() if ":" in line)
    return {kind: int(fields[kind].split()[0]) * 1024 for kind in RSS_KINDS if kind in fields}


FIXED_POLICY_LR = "1e-30"


def soak(iterations: int, run_dir: Path, *, keep_free_heap: bool = False, threads: int = 0,
         fixed_policy: bool = True) -> tuple[list[tuple[int, int, float]], list[dict], list[dict[str, int]]]:
    """(iteration, RSS bytes, CPU seconds so far) at each iteration's line, the run's metrics records, and the RSS
    split (`rss_kinds`) at each line."""
    argv = [sys.executable, "cli/train_grpo.py", "--config-name", "grpo_tiny_cpu",
            f"megatron_training.train_iters={iterations}", "runtime.memory_timeline=false", f"hydra.run.dir={run_dir}",
            f"runtime.num_threads_per_rank={threads}"] + ([f"actor_config.lr={FIXED_POLICY_LR}"] if fixed_policy else [])
    env = os.environ | ({"MINDSPEED_RL_KEEP_FREE_HEAP": "1"} if keep_free_heap else {})
    process = subprocess.Popen(argv, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env=env)
    rss, kinds = [], []
    for line in process.stdout:
        match = ITER_LINE.match(line)
        if match:
            watched = psutil.Process(process.pid)
            cpu = watched.cpu_times()
            rss.append((int(match.group(1)), watched.memory_info().rss, cpu.user + cpu.system))
            kinds.append(rss_kinds(process.pid))
    if process.wait() != 0:
        raise SystemExit(f"the demo exited {process.returncode}")
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    return rss, records, kinds


def least_squares(points: list[tuple[float, float]]) -> tuple[float, float]:
    """(slope, value at the first x) of the least-squares line through `points`."""
    xs, ys = [x for x, _ in points], [y for _, y in points]
    mean_x, mean_y = statistics.fmean(xs), statistics.fmean(ys)
    slope = sum((x - mean_x) * (y - mean_y) for x, y in points) / sum((x - mean_x) ** 2 for x in xs)
    return slope, mean_y + slope * (xs[0] - mean_x)


def slope_mb_per_100(points: list[tuple[int, int, float]]) -> float:
    return 100 * least_squares([(x, y / 1e6) for x, y, _ in points])[0]


def fitted_drift_percent(points: list[tuple[int, float]]) -> float:
    """The least-squares line's change from the first to the last iteration, in percent of its first value."""
    slope, first = least_squares(points)
    return 100 * slope * (points[-1][0] - points[0][0]) / first


def figures(rss: list[tuple[int, int, float]], records: list[dict], kinds: list[dict[str, int]],
            warmup: int) -> dict:
    by_kind = {kind: slope_mb_per_100([(i, split.get(kind, 0), 0.0) for (i, _, _), split in zip(rss, kinds)
                                       if i > warmup]) for kind in RSS_KINDS}
    measured = [r for r in records if r["iteration"] > warmup]
    first, last = (statistics.median(r["timing/all"] for r in part) for part in (measured[:WINDOW], measured[-WINDOW:]))
    cpu = [(i, now - before) for (_, _, before), (i, _, now) in zip(rss, rss[1:]) if i > warmup]
    cpu_first, cpu_last = (statistics.median(s for _, s in part) for part in (cpu[:WINDOW], cpu[-WINDOW:]))
    return {
        "rss_mb_first": rss[warmup][1] / 1e6, "rss_mb_last": rss[-1][1] / 1e6,
        "rss_slope_mb_per_100_iterations": slope_mb_per_100([p for p in rss if p[0] > warmup]),
        "seconds_per_iteration_first": first, "seconds_per_iteration_last": last,
        "drift_percent": 100 * (last - first) / first,
        "fitted_drift_percent": fitted_drift_percent([(r["iteration"], r["timing/all"]) for r in measured]),
        "cpu_seconds_per_iteration_first": cpu_first, "cpu_seconds_per_iteration_last": cpu_last,
        "cpu_drift_percent": 100 * (cpu_last - cpu_first) / cpu_first,
        "rss_slope_mb_per_100_iterations_by_kind": by_kind,
    }


def print_figures(label: str, result: dict) -> None:
    print(f"{label}: RSS {result['rss_mb_first']:.1f} -> {result['rss_mb_last']:.1f} MB, slope "
          f"{result['rss_slope_mb_per_100_iterations']:.3f} MB per 100 iterations (target <= 0.2); of which "
          + ", ".join(f"{kind} {slope:.3f}" for kind, slope in result["rss_slope_mb_per_100_iterations_by_kind"].items()))
    print(f"{label}: seconds per iteration, median of the first / last {WINDOW} after the warm-up: "
          f"{result['seconds_per_iteration_first']:.3f} / {result['seconds_per_iteration_last']:.3f} "
          f"({result['drift_percent']:+.1f}%, target <= 2%); least-squares drift over the run "
          f"{result['fitted_drift_percent']:+.1f}%")
    print(f"{label}: CPU seconds per iteration (the process's own), first / last {WINDOW}: "
          f"{result['cpu_seconds_per_iteration_first']:.3f} / {result['cpu_seconds_per_iteration_last']:.3f} "
          f"({result['cpu_drift_percent']:+.1f}%)")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", type=Path)
    parser.add_argument("--iterations", type=int, default=2000)
    parser.add_argument("--warmup", type=int, default=100)
    parser.add_argument("--policy", choices=("fixed", "learning"), default="fixed",
                        help="fixed: the same work every iteration (learning rate 1e-30); learning: the demo as it learns")
    parser.add_argument("--keep-free-heap-too", action="store_true",
                        help="a second run beside the first with the heap trim off")
    args = parser.parse_args(argv)
    if args.iterations < args.warmup + 2 * WINDOW:
        parser.error(f"--iterations must be at least --warmup + {2 * WINDOW}")
    load_before = os.getloadavg()[0]
    started = time.perf_counter()
    root = Path(tempfile.mkdtemp(prefix="bench_soak-"))
    sides = {"heap trimmed": False} | ({"free heap kept": True} if args.keep_free_heap_too else {})
    outcomes: dict[str, tuple] = {}

    def run(label: str, keep: bool) -> None:
        # Side by side, each run gets its share of the cores: oversubscribed threads spin and slow both 5x.
        threads = max(1, (os.cpu_count() or 2) // len(sides)) if len(sides) > 1 else 0
        outcomes[label] = soak(args.iterations, root / label.replace(" ", "_") / "run", keep_free_heap=keep,
                               threads=threads, fixed_policy=args.policy == "fixed")

    threads = [threading.Thread(target=run, args=side) for side in sides.items()]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    if len(outcomes) != len(sides):
        raise SystemExit("a soak run failed")
    result = {"iterations": args.iterations, "warmup": args.warmup, "policy": args.policy,
              "wall_seconds": time.perf_counter() - started, "load_average": (load_before, os.getloadavg()[0]),
              **{label: figures(*outcomes[label], args.warmup) for label in sides}}
    for label in sides:
        print_figures(label, result[label])
    print(f"load {result['load_average'][0]:.1f} -> {result['load_average'][1]:.1f}; {result['wall_seconds']:.0f} s"
          + ("; the two runs shared the machine" if len(sides) > 1 else ""))
    if args.json:
        args.json.write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
