"""What each candidate change would save, measured by config overrides on the unchanged demo.

    python benchmarks/ablate_demo.py --json FILE [--repeats 2] [--iterations 12] [--warmup 2] [--only NAME ...]

Runs `cli/train_grpo.py --config-name grpo_tiny_cpu` with each override set below, round-robin (baseline,
A, B, ..., baseline, A, B, ...), `--repeats` times, and reports the median iteration time and per-phase
medians (metrics.jsonl) of each set against the baseline's, with the load of every run. The overrides stand
in for code changes named in docs/overhead.md: where a knob already exists its effect is the saving the change
would bring by default on this demo.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
from pathlib import Path

BENCH_DIR = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH_DIR))
sys.path.insert(0, str(BENCH_DIR.parent))

from bench_vs_trl import code_state, run_ours  # noqa: E402

SETS = {
    "baseline": (),
    "no_fingerprint": ("generate_config.check_weights_after_switch=false",),
    "kv_cache_16MiB": ("generate_config.cpu_kvcache_space_gb=0.015625",),
    "no_train_offload": ("generate_config.offload_train_param=false", "generate_config.offload_train_grad=false",
                         "generate_config.offload_train_optimizer=false"),
    "one_logprob_micro_batch": ("rl_config.ref_forward_micro_batch_size=256",
                                "rl_config.actor_forward_micro_batch_size=256"),
    "max_num_seqs_256": ("generate_config.max_num_seqs=256",),
    "all_of_the_above": ("generate_config.check_weights_after_switch=false",
                         "generate_config.cpu_kvcache_space_gb=0.015625",
                         "generate_config.offload_train_param=false", "generate_config.offload_train_grad=false",
                         "generate_config.offload_train_optimizer=false",
                         "rl_config.ref_forward_micro_batch_size=256", "rl_config.actor_forward_micro_batch_size=256",
                         "generate_config.max_num_seqs=256"),
}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", type=Path)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--iterations", type=int, default=12)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--only", nargs="*", choices=sorted(SETS), help="these sets (baseline always runs)")
    parser.add_argument("--keep", type=Path)
    args = parser.parse_args(argv)
    names = ["baseline"] + [n for n in SETS if n != "baseline" and (not args.only or n in args.only)]
    workdir = args.keep or Path(tempfile.mkdtemp(prefix="ablate_demo-"))
    workdir.mkdir(parents=True, exist_ok=True)
    runs: dict[str, list[dict]] = {n: [] for n in names}
    for repeat in range(args.repeats):
        for name in names:
            run = run_ours(args.iterations, args.warmup, workdir, False, SETS[name])
            lw = run["load_measured_window"]
            print(f"[ablate] {repeat + 1}/{args.repeats} {name}: {run['median_iteration_s']:.3f}s/iter "
                  f"(load1 {lw.get('load1_max', 0):.2f}, foreign cores {lw.get('foreign_cores_busy', 0):.2f})",
                  flush=True)
            run["code"] = code_state()
            runs[name].append(run)
    med = lambda xs: statistics.median(xs)  # noqa: E731
    summary = {}
    for name in names:
        rs = runs[name]
        summary[name] = {
            "overrides": list(SETS[name]),
            "median_iteration_s": med([r["median_iteration_s"] for r in rs]),
            "per_run": [r["median_iteration_s"] for r in rs],
            "quiet_iterations": f"{sum(r['quiet_iterations'] for r in rs)}/{sum(r['measured_iterations'] for r in rs)}",
            "median_iteration_quiet_s": (med(q) if (q := [x for r in rs for x in r["quiet_iteration_seconds"]]) else None),
            "phases_median_quiet_s": ({k: med([r["phases_median_quiet_s"][k] for r in rs if r["phases_median_quiet_s"]])
                                       for k in rs[0]["phases_median_s"]}
                                      if any(r["phases_median_quiet_s"] for r in rs) else None),
            "phases_median_s": {k: med([r["phases_median_s"][k] for r in rs]) for k in rs[0]["phases_median_s"]},
            "foreign_cores_busy": [round(r["load_measured_window"].get("foreign_cores_busy", 0), 2) for r in rs],
            "load1_max": [round(r["load_measured_window"].get("load1_max", 0), 2) for r in rs],
            "peak_pss_sum_mib": med([r["memory"]["peak_pss_sum_mib"] for r in rs]),
        }
    base = summary["baseline"]
    for label, total_key, phase_key in (("all measured iterations", "median_iteration_s", "phases_median_s"),
                                        ("quiet iterations only", "median_iteration_quiet_s", "phases_median_quiet_s")):
        print(f"\n{label}:")
        print(f"{'set':26s} {'s/iter':>7s} {'saved':>7s}  " + " ".join(f"{k[:14]:>14s}" for k in base["phases_median_s"])
              + "  quiet  foreign cores per run")
        for name, s in summary.items():
            if s[total_key] is None or base[total_key] is None:
                print(f"{name:26s} (no quiet iterations)")
                continue
            saved = base[total_key] - s[total_key]
            print(f"{name:26s} {s[total_key]:7.3f} {saved:+7.3f}  "
                  + " ".join(f"{v:14.3f}" for v in (s[phase_key] or {}).values())
                  + f"  {s['quiet_iterations']}  {s['foreign_cores_busy']}")
    if args.json:
        args.json.write_text(json.dumps({"iterations": args.iterations, "warmup": args.warmup,
                                         "repeats": args.repeats, "summary": summary, "runs": runs}, indent=2))
        print(f"[ablate] wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
