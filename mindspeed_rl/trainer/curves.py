"""Training curves of a run: reward per verifier, accuracy, KL, response length, tokens/s per iteration, the
held-out evaluation's accuracy when the run evaluates, the mismatch ledger's causes when it is on, and PPO's value loss and explained variance with a critic.

Drawn at the end of a run beside metrics.jsonl, and redrawable from any run's file:

    python -m mindspeed_rl.trainer.curves RUN_DIR/metrics.jsonl [OUT.png] [--window N]
"""
from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from mindspeed_rl.memory.timeline import read_jsonl

# (title, [metric keys or a key suffix matched against every key], y label)
PANELS = (
    ("reward", ["reward/mean", "*_rewards/mean"], "mean per sample"),
    ("accuracy", ["reward/accuracy"], "fraction correct"),
    ("KL to the reference", ["actor/kl_loss"], "low_var_kl"),
    ("response length", ["response_length/mean", "response_length/max"], "tokens"),
    ("throughput", ["e2e_tps", "vllm_tps", "update_tps"], "tokens/s per device"),
    ("learning rate", ["actor/lr"], "lr"),
    # rl_config.mismatch_ledger's split of the vLLM-vs-Megatron log-prob gap (docs/mismatch.md).
    ("train-rollout mismatch", ["mismatch/staleness", "mismatch/push", "mismatch/numerics", "mismatch/routing",
                                "mismatch/total"], "mean |d log p| per token"),
    # MoE: vLLM's recorded experts against the trainer's (docs/mismatch.md "Routing replay").
    ("routing vs the rollout", ["mismatch/routing_flips", "mismatch/router_disagreement"],
     "share of (token, MoE layer) pairs"),
    ("held-out evaluation", ["eval/pass@*"], "fraction correct"),
    # PPO's critic (drawn where the run has one).
    ("value loss", ["critic/vf_loss"], "0.5 x squared error"),
    ("value function", ["critic/explained_variance", "critic/vf_clipfrac"], "explained variance, clip fraction"),
)
# Panels whose points are sparse (every eval_interval-th iteration): drawn as they are, with markers.
SPARSE_PANELS = ("held-out evaluation",)


def series_keys(records: list[dict], patterns: list[str]) -> list[str]:
    """The keys a panel draws, in pattern order; a `*suffix` pattern matches every key ending in suffix, a
    `prefix*` one every key starting with prefix."""
    present = {key for record in records for key in record}
    keys: list[str] = []
    for pattern in patterns:
        if pattern.startswith("*"):
            keys += sorted(k for k in present if k.endswith(pattern[1:]) and k not in keys)
        elif pattern.endswith("*"):
            keys += sorted(k for k in present if k.startswith(pattern[:-1]) and k not in keys)
        elif pattern in present:
            keys.append(pattern)
    return keys


def moving_average(values: list[float], window: int) -> list[float]:
    out, total = [], 0.0
    for index, value in enumerate(values):
        total += value
        if index >= window:
            total -= values[index - window]
        out.append(total / min(index + 1, window))
    return out


def plot_training_curves(records: list[dict], path: str | Path, *, window: int = 10) -> list[str]:
    """One panel per quantity; raw values faint, a `window`-iteration moving average on top. Returns the
    keys drawn. Written to a temporary file and renamed, so a reader never sees half a picture."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    records = [r for r in records if "iteration" in r]
    if not records:
        raise ValueError("no iteration records to draw")
    panels = [(title, series_keys(records, patterns), unit) for title, patterns, unit in PANELS]
    panels = [panel for panel in panels if panel[1]]
    columns = 3
    rows = -(-len(panels) // columns)
    fig, axes = plt.subplots(rows, columns, squeeze=False, dpi=110, figsize=(4.2 * columns, 3.0 * rows))
    drawn = []
    for ax, (title, keys, unit) in zip(axes.flat, panels):
        for key in keys:
            points = [(r["iteration"], r[key]) for r in records if key in r]
            xs, ys = [p[0] for p in points], [p[1] for p in points]
            if title in SPARSE_PANELS:
                ax.plot(xs, ys, marker="o", markersize=3, linewidth=1.4, label=key)
                drawn.append(key)
                continue
            line, = ax.plot(xs, ys, alpha=0.25, linewidth=0.8)
            ax.plot(xs, moving_average(ys, window), color=line.get_color(), linewidth=1.6, label=key)
            drawn.append(key)
        ax.set_title(title, fontsize=10)
        ax.set_xlabel("iteration", fontsize=8)
        ax.set_ylabel(unit, fontsize=8)
        ax.tick_params(labelsize=7)
        ax.legend(fontsize=7, frameon=False)
    for ax in list(axes.flat)[len(panels):]:
        ax.axis("off")
    fig.suptitle(f"Training curves (moving average over {window} iterations)", fontsize=11)
    fig.tight_layout()
    path = Path(path)
    partial = path.with_name(path.name + ".partial.png")
    fig.savefig(partial)
    os.replace(partial, path)
    plt.close(fig)
    return drawn


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("metrics", type=Path, help="a run's metrics.jsonl")
    parser.add_argument("out", type=Path, nargs="?", help="PNG to write (default: training_curves.png beside it)")
    parser.add_argument("--window", type=int, default=10, help="moving-average window in iterations (default 10)")
    args = parser.parse_args(argv)
    if not args.metrics.is_file():
        parser.error(f"metrics: {args.metrics} is not a file")
    if args.window < 1:
        parser.error(f"--window: must be >= 1, got {args.window}")
    out = args.out or args.metrics.with_name("training_curves.png")
    plot_training_curves(read_jsonl(args.metrics), out, window=args.window)
    print(out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
