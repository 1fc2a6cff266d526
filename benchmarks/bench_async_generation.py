"""Synchronous vs one-step off-policy rollouts on the disaggregated demo, side by side.

    python benchmarks/bench_async_generation.py --json FILE [--repeats 2] [--iterations 12] [--warmup 2]

Runs `cli/train_grpo.py --config-name grpo_tiny_cpu_disaggregated` (training on slot 0, vLLM on slot 1)
with `async_generation_ratio=0` and `=1` alternately, `--repeats` times each, and reports per setting the
median seconds per iteration (`timing/all`, warm-up iterations left out), the median of the loop's total,
the rollout's own seconds and the seconds the trainer waited for an overlapped rollout, then the ratio
async / sync. The machine's load average is printed beside each run: compare runs taken under the same load.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
CONFIG_NAME = "grpo_tiny_cpu_disaggregated"


def run_once(ratio: int, iterations: int, warmup: int, workdir: Path) -> dict:
    run_dir = workdir / f"ratio{ratio}-{time.strftime('%H%M%S')}-{len(list(workdir.iterdir()))}"
    argv = [sys.executable, "cli/train_grpo.py", "--config-name", CONFIG_NAME, f"megatron_training.train_iters={iterations}",
            f"async_generation_ratio={ratio}", f"hydra.run.dir={run_dir}"]
    load_before = os.getloadavg()[0]
    done = subprocess.run(argv, cwd=REPO, capture_output=True, text=True, timeout=1800)
    if done.returncode != 0:
        raise SystemExit(f"the demo with async_generation_ratio={ratio} exited {done.returncode}:\n{done.stderr[-2000:]}")
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    measured = [r for r in rows if r["iteration"] > warmup]
    return {
        "ratio": ratio,
        "seconds_per_iteration": statistics.median(r["timing/all"] for r in measured),
        "loop_seconds": sum(r["timing/all"] for r in measured),
        "rollout_seconds": statistics.median(r.get("timing/rollout", 0.0) for r in measured),
        "rollout_wait_seconds": statistics.median(r.get("timing/rollout_wait", 0.0) for r in measured),
        "update_seconds": statistics.median(r["timing/update"] for r in measured),
        "staleness": sorted({r["rollout/staleness"] for r in measured}),
        "load_average": (load_before, os.getloadavg()[0]),
    }


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", type=Path)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--iterations", type=int, default=12)
    parser.add_argument("--warmup", type=int, default=2)
    args = parser.parse_args(argv)
    workdir = Path(tempfile.mkdtemp(prefix="bench_async_generation-"))
    runs = []
    for _ in range(args.repeats):
        for ratio in (0, 1):
            run = run_once(ratio, args.iterations, args.warmup, workdir)
            runs.append(run)
            print(f"async_generation_ratio={ratio}: {run['seconds_per_iteration']:.3f} s/iteration, loop "
                  f"{run['loop_seconds']:.1f} s, rollout {run['rollout_seconds']:.3f} s, waited "
                  f"{run['rollout_wait_seconds']:.3f} s, update {run['update_seconds']:.3f} s, staleness "
                  f"{run['staleness']}, load {run['load_average'][0]:.1f} -> {run['load_average'][1]:.1f}", flush=True)
    summary = {}
    for ratio in (0, 1):
        mine = [r for r in runs if r["ratio"] == ratio]
        summary[ratio] = {key: statistics.median(r[key] for r in mine)
                          for key in ("seconds_per_iteration", "loop_seconds", "rollout_seconds", "update_seconds")}
    ratio = summary[1]["seconds_per_iteration"] / summary[0]["seconds_per_iteration"]
    print(f"median s/iteration: sync {summary[0]['seconds_per_iteration']:.3f}, one-step off-policy "
          f"{summary[1]['seconds_per_iteration']:.3f}: {ratio:.2f}x ({args.repeats} runs each, "
          f"{args.iterations - args.warmup} measured iterations per run)")
    if args.json:
        args.json.write_text(json.dumps({"runs": runs, "summary": summary, "async_over_sync": ratio}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
