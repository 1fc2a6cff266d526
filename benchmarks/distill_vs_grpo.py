"""On-policy distillation vs GRPO from the same start, on the CPU demo (docs/distillation.md).

Runs `cli/train_distill.py` (the demo: the student starts as the untrained demo model, its teacher is that model after
100 GRPO iterations, made once); the GRPO curve is the teacher's own training run, which started from the same
checkpoint with the same seed and data. Prints, for each, the first iteration at which the 10-iteration mean accuracy
reaches 90% of the teacher's (its last 10 iterations' mean), the distillation KL of the first and last 10 iterations,
and draws both curves.

    python benchmarks/distill_vs_grpo.py [--iterations 100] [--out docs/distill_tiny_curves.png]
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
WINDOW = 10


def _records(path: Path) -> list[dict]:
    return [r for r in map(json.loads, path.read_text().splitlines()) if r.get("iteration", 0) >= 1]


def _rolling(values: list[float]) -> list[float]:
    return [sum(values[max(0, i - WINDOW + 1):i + 1]) / len(values[max(0, i - WINDOW + 1):i + 1])
            for i in range(len(values))]


def first_reaching(accuracy: list[float], target: float) -> int | None:
    """The first iteration (1-based) whose trailing 10-iteration mean accuracy is >= target."""
    return next((i + 1 for i, value in enumerate(_rolling(accuracy)) if i + 1 >= WINDOW and value >= target), None)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--iterations", type=int, default=100)
    parser.add_argument("--out", type=Path, default=REPO / "docs" / "distill_tiny_curves.png")
    parser.add_argument("--run-dir", type=Path, help="a finished demo run to read instead of running one")
    parser.add_argument("--data-dir", type=Path, default=REPO / "data" / "tiny", help="the demo's asset cache")
    args = parser.parse_args(argv)
    run_dir = args.run_dir
    if run_dir is None:
        run_dir = Path(tempfile.mkdtemp(prefix="distill-demo-"))
        subprocess.run([sys.executable, "cli/train_distill.py", f"megatron_training.train_iters={args.iterations}",
                        f"hydra.run.dir={run_dir}"], cwd=REPO, check=True, stdout=subprocess.DEVNULL)
    distill = _records(run_dir / "metrics.jsonl")
    teacher_dir = next(args.data_dir.glob("grpo_teacher-*"))
    grpo = _records(teacher_dir / "teacher_training_metrics.jsonl")[:args.iterations]
    teacher_accuracy = sum(r["reward/accuracy"] for r in grpo[-WINDOW:]) / WINDOW
    target = 0.9 * teacher_accuracy
    kl = [r["distill/kl_mean"] for r in distill]
    result = {"teacher_accuracy_last10": teacher_accuracy, "target_accuracy": target,
              "distill_iterations_to_target": first_reaching([r["reward/accuracy"] for r in distill], target),
              "grpo_iterations_to_target": first_reaching([r["reward/accuracy"] for r in grpo], target),
              "distill_kl_first10": sum(kl[:WINDOW]) / WINDOW, "distill_kl_last10": sum(kl[-WINDOW:]) / WINDOW,
              "distill_accuracy_last10": sum(r["reward/accuracy"] for r in distill[-WINDOW:]) / WINDOW}
    print(json.dumps(result, indent=2))
    _plot(distill, grpo, target, args.out)
    print(f"curves: {args.out}")


def _plot(distill: list[dict], grpo: list[dict], target: float, out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (acc, kl) = plt.subplots(1, 2, figsize=(11, 4))
    for records, label in ((distill, "on-policy distillation (PG OPD, k1)"), (grpo, "GRPO (the teacher's own run)")):
        acc.plot([r["iteration"] for r in records], _rolling([r["reward/accuracy"] for r in records]), label=label)
    acc.axhline(target, color="grey", linestyle="--", label="90% of the teacher's accuracy")
    acc.set(xlabel="iteration", ylabel=f"training accuracy ({WINDOW}-iteration mean)", title="Student accuracy")
    acc.legend()
    kl.plot([r["iteration"] for r in distill], [r["distill/kl_mean"] for r in distill])
    kl.set(xlabel="iteration", ylabel="distill/kl_mean", title="Per-token KL(student || teacher), sampled tokens")
    fig.tight_layout()
    fig.savefig(out, dpi=90)


if __name__ == "__main__":
    main()
