"""Synchronous rollouts against partial rollout and run-ahead, side by side at the long-tailed shape, and the DAPO
demo's accuracy.

    python benchmarks/bench_partial_rollout.py --json FILE [--modes 1,2,4,ahead2,ahead4] [--iterations 6]
                                               [--warmup 1] [--repeats 1] [--eos-mean 200] [--accuracy-iterations 100]

A mode is a split N (`rl_config.partial_rollout_max_split=N`: cut at max_tokens // N; 1 is the synchronous run) or
`aheadN` (run-ahead: that split with `rl_config.async_engine=true`, the generate stopped once a global batch of groups
is complete, the rest aborted and resumed after the push).

- Speed: `make bench-long-iteration`'s shape (bench_long_assets.py's 20.7M-parameter Qwen2 checkpoint whose responses
  end with a long tail, up to 512 tokens; 4 prompts x 8 samples per update; packed micro-batches), through
  `cli/train_grpo.py` in each of `--modes`, the runs alternating (1, 2, 4, ahead2, ahead4, 1, 2, ...). Per run, over
  the iterations after `--warmup`: trained response tokens per second (the updates' response tokens, `response_length/mean` x samples, over the iterations' wall seconds),
  seconds per iteration (median), the generate's seconds and its decode batch occupancy
  (`rollout/decode_occupancy`), and the trained tokens' age (`rollout/token_age_mean`, `_max`).
  Prints `partial/sync trained tokens per second: X`, the best other mode over the synchronous runs.
- Accuracy (`--accuracy-iterations` > 0): the DAPO demo (`cli/train_dapo.py`, dapo_tiny_math_cpu: held-out
  accuracy every 10 updates) trained that many iterations in each mode: its last held-out `eval/accuracy`, and the
  mean of the last three evaluations.

The machine's load average is recorded beside each run: compare runs taken under the same load.
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

BENCH_DIR = Path(__file__).resolve().parent
REPO = BENCH_DIR.parent
sys.path.insert(0, str(BENCH_DIR))
sys.path.insert(0, str(REPO))

from bench_long_assets import make_assets  # noqa: E402
from bench_long_iteration import PROMPTS, SAMPLES, ours_overrides  # noqa: E402


def _run(script: str, config_name: str, overrides: list[str], run_dir: Path) -> list[dict]:
    argv = [sys.executable, script, "--config-name", config_name, *overrides, "runtime.training_curves=false",
            "runtime.memory_timeline=false", f"hydra.run.dir={run_dir}"]
    done = subprocess.run(argv, cwd=REPO, capture_output=True, text=True, timeout=3600)
    if done.returncode != 0:
        raise SystemExit(f"{' '.join(argv[1:])} exited {done.returncode}:\n{done.stderr[-3000:]}")
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]


def mode_overrides(mode: str) -> list[str]:
    """`N` or `aheadN` as the run's overrides."""
    ahead = mode.startswith("ahead")
    return [f"rl_config.partial_rollout_max_split={int(mode.removeprefix('ahead'))}",
            f"rl_config.async_engine={str(ahead).lower()}"]


def speed_run(mode: str, assets: dict, iterations: int, warmup: int, workdir: Path) -> dict:
    run_dir = workdir / f"mode{mode}-{time.strftime('%H%M%S')}-{len(list(workdir.iterdir()))}"
    load_before = os.getloadavg()[0]
    rows = _run("cli/train_grpo.py", "grpo_tiny_cpu", [*ours_overrides(assets, padded=False),
                                                       f"megatron_training.train_iters={iterations}",
                                                       *mode_overrides(mode)], run_dir)
    measured = [r for r in rows if "reward/mean" in r and r["iteration"] > warmup]
    tokens = sum(r["response_length/mean"] * PROMPTS * SAMPLES for r in measured)
    seconds = sum(r["timing/all"] for r in measured)
    return {
        "mode": mode,
        "old_logprob_seconds": statistics.median(r.get("timing/old_logprob/total", 0.0) for r in measured),
        "trained_tokens_per_second": tokens / seconds,
        "seconds_per_iteration": statistics.median(r["timing/all"] for r in measured),
        "generate_seconds": statistics.median(r["timing/rollout"] for r in measured),
        "decode_occupancy": statistics.mean(r["rollout/decode_occupancy"] for r in measured),
        "token_age_mean": statistics.mean(r["rollout/token_age_mean"] for r in measured),
        "token_age_max": max(r["rollout/token_age_max"] for r in measured),
        "resumed_samples": sum(r["rollout/resumed_samples"] for r in measured),
        "response_length_mean": statistics.mean(r["response_length/mean"] for r in measured),
        "load_average": (load_before, os.getloadavg()[0]),
    }


def accuracy_run(mode: str, iterations: int, workdir: Path) -> dict:
    run_dir = workdir / f"dapo-mode{mode}"
    rows = _run("cli/train_dapo.py", "dapo_tiny_math_cpu", [f"megatron_training.train_iters={iterations}",
                                                            *mode_overrides(mode)], run_dir)
    evaluations = [(r["iteration"], r["eval/accuracy"]) for r in rows if "eval/accuracy" in r]
    return {"mode": mode, "evaluations": evaluations, "last_eval_accuracy": evaluations[-1][1],
            "last_three_mean": statistics.mean(a for _, a in evaluations[-3:])}


def _print_speed(run: dict) -> None:
    print(f"mode {run['mode']}: {run['trained_tokens_per_second']:.1f} trained tokens/s, "
          f"{run['seconds_per_iteration']:.2f} s/iteration (generate {run['generate_seconds']:.2f} s, decode occupancy "
          f"{run['decode_occupancy']:.2f}, old-log-prob pass {run['old_logprob_seconds']:.2f} s), "
          f"token age mean {run['token_age_mean']:.2f} max {run['token_age_max']}, "
          f"resumed {run['resumed_samples']}, response length {run['response_length_mean']:.0f}, load "
          f"{run['load_average'][0]:.1f} -> {run['load_average'][1]:.1f}", flush=True)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", type=Path)
    parser.add_argument("--modes", default="1,2,4,ahead2,ahead4")
    parser.add_argument("--iterations", type=int, default=6)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--eos-mean", type=float, default=200.0)
    parser.add_argument("--accuracy-iterations", type=int, default=100)
    args = parser.parse_args(argv)
    modes = args.modes.split(",")
    assert modes[0] == "1", "the first mode is the synchronous run (1)"
    workdir = Path(tempfile.mkdtemp(prefix="bench_partial_rollout-"))
    assets = make_assets(workdir / "assets", eos_mean=args.eos_mean)
    runs = []
    for _ in range(args.repeats):
        for mode in modes:
            runs.append(speed_run(mode, assets, args.iterations, args.warmup, workdir))
            _print_speed(runs[-1])
    rate = {m: statistics.median(r["trained_tokens_per_second"] for r in runs if r["mode"] == m) for m in modes}
    best = max(modes[1:], key=rate.get)
    print(f"partial/sync trained tokens per second: {rate[best] / rate['1']:.2f} (mode {best}: {rate[best]:.1f} "
          f"against {rate['1']:.1f}; {args.repeats} run(s) each, {args.iterations - args.warmup} measured iterations "
          f"per run)")
    accuracy = []
    if args.accuracy_iterations > 0:
        for mode in modes:
            accuracy.append(accuracy_run(mode, args.accuracy_iterations, workdir))
            print(f"DAPO demo, mode {mode}, {args.accuracy_iterations} iterations: held-out accuracy "
                  f"{accuracy[-1]['last_eval_accuracy']:.3f} (mean of the last three evaluations "
                  f"{accuracy[-1]['last_three_mean']:.3f})", flush=True)
    if args.json:
        args.json.write_text(json.dumps({"speed_runs": runs, "tokens_per_second": rate,
                                         "partial_over_sync": rate[best] / rate["1"], "best_mode": best,
                                         "accuracy": accuracy}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
