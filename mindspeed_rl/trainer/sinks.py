"""Where each iteration's metrics go: one JSON line in metrics.jsonl, and TensorBoard event files
(`rl_config.use_tensorboard`, the real `tensorboard` writer through torch's SummaryWriter)."""
from __future__ import annotations

import json
import os
from pathlib import Path

TENSORBOARD_SUBDIR = "tensorboard"


class MetricsSinks:
    def __init__(self, run_dir: Path, *, metrics_file: str, use_tensorboard: bool):
        self.metrics_path = run_dir / metrics_file
        self.tensorboard = None
        if use_tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            self.tensorboard = SummaryWriter(log_dir=str(run_dir / TENSORBOARD_SUBDIR))

    def write(self, record: dict) -> None:
        append_jsonl(self.metrics_path, record)
        if self.tensorboard is not None:
            step = int(record["iteration"])
            for key, value in record.items():
                if key != "iteration" and isinstance(value, (int, float)):
                    self.tensorboard.add_scalar(key, value, global_step=step)
            self.tensorboard.flush()

    def close(self) -> None:
        if self.tensorboard is not None:
            self.tensorboard.close()


def append_jsonl(path: Path, record: dict) -> None:
    # One complete line per write + flush + fsync: a crash leaves whole records only.
    with open(path, "a", encoding="utf-8") as f:
        f.write(json.dumps(record) + "\n")
        f.flush()
        os.fsync(f.fileno())
