"""The table printed when a run ends: how long, per phase; the device bytes each phase held at its peak; the reward
and accuracy at the start and the end; and where the run's files are."""
from __future__ import annotations

from pathlib import Path
from statistics import mean

from mindspeed_rl.memory.residency import PHASES

MISMATCH_KEYS = ("mismatch/staleness", "mismatch/push", "mismatch/numerics", "mismatch/routing", "mismatch/total")
# First and last this many iterations are averaged for "start -> end".
ENDS_WINDOW = 10
_MIB = 1 << 20


def summary_lines(history: list[dict], *, run_dir: Path, artefacts: list[str], restarts: int = 0) -> list[str]:
    """`[summary]` lines for this run's records (empty without any); `restarts`: runtime.max_restarts used."""
    if not history:
        return []
    lines = [f"[summary] {len(history)} iterations, {sum(r.get('timing/all', 0.0) for r in history):.1f} s "
             f"({mean(r.get('timing/all', 0.0) for r in history):.2f} s each)"
             + (f", {restarts} restart(s) from a checkpoint (runtime.max_restarts)" if restarts else "")]
    lines.append(f"  {'phase':<14}{'seconds/iter':>14}{'peak device MiB':>18}")
    for phase in PHASES:
        seconds = [r[f"timing/{phase}/total"] for r in history if f"timing/{phase}/total" in r]
        peaks = [r[f"memory/{phase}/total_bytes"] for r in history if f"memory/{phase}/total_bytes" in r]
        if seconds or peaks:
            lines.append(f"  {phase:<14}{mean(seconds) if seconds else 0.0:>14.3f}"
                         f"{max(peaks) / _MIB if peaks else 0.0:>18.1f}")
    for key, name in (("reward/mean", "reward"), ("reward/accuracy", "accuracy")):
        values = [r[key] for r in history if key in r]
        if values:
            lines.append(f"  {name}: {mean(values[:ENDS_WINDOW]):.3f} -> {mean(values[-ENDS_WINDOW:]):.3f} "
                         f"(mean of the first -> last {min(ENDS_WINDOW, len(values))} iterations)")
    ledger = [key for key in MISMATCH_KEYS if any(key in r for r in history)]
    if ledger:  # rl_config.mismatch_ledger: the run's mean per cause
        lines.append("  mismatch (mean |d log p| per token): " + " ".join(
            f"{key.split('/')[1]}={mean(r[key] for r in history if key in r):.2e}" for key in ledger))
    lines.append(f"  files: {run_dir}" + "".join(f"\n    {artefact}" for artefact in artefacts))
    return lines
