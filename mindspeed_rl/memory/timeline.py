"""The memory timeline: stacked device bytes per category across the phases of the last iterations.

Drawn from the `memory/<phase>/<category>_bytes` figures of `metrics.jsonl` (a real run's
ledger), so the picture is what the run measured. Redraw one from a finished run with

    python -m mindspeed_rl.memory.timeline RUN_DIR/metrics.jsonl [OUT.png] [--last N]
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from dataclasses import dataclass
from pathlib import Path

from mindspeed_rl.memory.ledger import CATEGORIES, PHASES

COLORS = {  # one hue per role: train (blues), inference (oranges), reference (green), reward (purple), teacher (gold)
    "train_params": "#1f4e79", "train_grads": "#5b9bd5", "optimizer_states": "#9dc3e6",
    "inference_weights": "#c55a11", "kv_cache": "#f4b183", "reference_params": "#548235",
    "reward_params": "#7030a0", "teacher_params": "#bf9000",
    "activations": "#a5a5a5",
}


@dataclass(frozen=True)
class Timeline:
    labels: list[str]              # one per bar: "it 7\ngenerate"
    iterations: list[int]
    bytes_by_category: dict[str, list[int]]  # category -> one value per bar

    def totals(self) -> list[int]:
        return [sum(values[i] for values in self.bytes_by_category.values()) for i in range(len(self.labels))]


def build_timeline(records: list[dict], last_iterations: int) -> Timeline:
    """The bars to draw: for each of the last iterations, one bar per phase it recorded."""
    chosen = [r for r in records if any(k.startswith("memory/") for k in r)][-last_iterations:]
    labels, iterations = [], []
    columns: dict[str, list[int]] = {c: [] for c in CATEGORIES}
    for record in chosen:
        for phase in PHASES:
            if f"memory/{phase}/total_bytes" not in record:
                continue
            labels.append(f"it {record.get('iteration', '?')}\n{phase}")
            iterations.append(int(record.get("iteration", 0)))
            for category in CATEGORIES:
                columns[category].append(int(record.get(f"memory/{phase}/{category}_bytes", 0)))
    return Timeline(labels=labels, iterations=iterations,
                    bytes_by_category={c: v for c, v in columns.items() if any(v)})


def _unit(max_bytes: int) -> tuple[str, int]:
    for name, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if max_bytes >= size:
            return name, size
    return "bytes", 1


def _draw(ax, timeline: Timeline, unit: int, ylim: float | None) -> None:
    xs = list(range(len(timeline.labels)))
    bottom = [0.0] * len(xs)
    for category, values in timeline.bytes_by_category.items():
        heights = [v / unit for v in values]
        ax.bar(xs, heights, bottom=bottom, color=COLORS.get(category), label=category, width=0.75,
               edgecolor="white", linewidth=0.5)
        bottom = [b + h for b, h in zip(bottom, heights)]
    top = ylim if ylim is not None else max(bottom) * 1.12
    for x, total in zip(xs, bottom):
        clipped = total > top
        ax.annotate(f"{'^ ' if clipped else ''}{total:.1f}", (x, min(total, top * 0.97)), ha="center",
                    va="top" if clipped else "bottom", fontsize=7)
    for x in range(1, len(xs)):  # a dashed line where one iteration ends and the next begins
        if timeline.iterations[x] != timeline.iterations[x - 1]:
            ax.axvline(x - 0.5, color="#444444", linewidth=0.8, linestyle="--")
    ax.set_ylim(0, top)


def plot_memory_timeline(records: list[dict], path: str | Path, *, last_iterations: int = 3,
                         title: str = "Device memory per phase (memory ledger)") -> Timeline:
    """Stacked bars per phase; when one phase dwarfs the others (a large KV cache next to a small
    model), a second panel zooms on the small ones so that every category stays readable."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    timeline = build_timeline(records, last_iterations)
    if not timeline.labels:
        raise ValueError("no memory/<phase>/... figures in the records: was the ledger on?")
    totals = timeline.totals()
    small = [t for t in totals if 0 < t < 0.2 * max(totals)]
    panels = 2 if small else 1
    unit_name, unit = _unit(max(totals))
    fig, axes = plt.subplots(panels, 1, sharex=True, squeeze=False, dpi=120,
                             figsize=(max(7.0, 0.9 * len(timeline.labels) + 3.0), 3.0 + 2.2 * panels))
    _draw(axes[0][0], timeline, unit, None)
    axes[0][0].set_title(title, fontsize=10)
    axes[0][0].set_ylabel(f"device-resident {unit_name}")
    if small:
        zoom_name, zoom_unit = _unit(max(small))
        _draw(axes[1][0], timeline, zoom_unit, max(small) / zoom_unit * 1.3)
        axes[1][0].set_ylabel(f"zoom: {zoom_name}")
    axes[-1][0].set_xticks(range(len(timeline.labels)), timeline.labels, fontsize=7)
    axes[0][0].legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8, frameon=False)
    fig.tight_layout()
    path = Path(path)
    partial = path.with_name(path.name + ".partial.png")
    fig.savefig(partial)  # then renamed: a reader never sees a half-written picture
    os.replace(partial, path)
    plt.close(fig)
    return timeline


def read_jsonl(path: str | Path) -> list[dict]:
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("metrics", type=Path, help="a run's metrics.jsonl")
    parser.add_argument("out", type=Path, nargs="?", help="PNG to write (default: memory_timeline.png beside it)")
    parser.add_argument("--last", type=int, default=3, help="iterations to draw (default 3)")
    args = parser.parse_args(argv)
    if not args.metrics.is_file():
        parser.error(f"metrics: {args.metrics} is not a file")  # exits with code 2
    if args.last < 1:
        parser.error(f"--last: must be >= 1, got {args.last}")
    out = args.out or args.metrics.with_name("memory_timeline.png")
    plot_memory_timeline(read_jsonl(args.metrics), out, last_iterations=args.last)
    print(out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
