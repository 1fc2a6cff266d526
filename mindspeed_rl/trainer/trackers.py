"""Experiment trackers beside metrics.jsonl, with MindSpeed-RL's keys: TensorBoard (`rl_config.use_tensorboard`)
and Weights & Biases (`use_wandb`, `wandb_project`, `wandb_exp_name`, `wandb_save_dir`). Each gets every
numeric scalar of each iteration's record at step = iteration.

wandb: online when the machine is logged in and reaches the server; otherwise (or with WANDB_MODE=offline) the
run is written offline under `<wandb_save_dir>/wandb` (default `<run dir>/wandb`) for a later `wandb sync`, as
MindSpeed-RL falls back to offline.
"""
from __future__ import annotations

import dataclasses
import logging
import os
from pathlib import Path
from typing import Protocol

from mindspeed_rl.trainer.sinks import TENSORBOARD_SUBDIR, errors_name, quiet_tensorboard_thread_errors

logger = logging.getLogger(__name__)
WANDB_SUBDIR = "wandb"  # wandb's own folder under its `dir`


class Tracker(Protocol):
    def log(self, scalars: dict[str, float], step: int) -> None: ...
    def close(self) -> None: ...


class TensorBoardTracker:
    def __init__(self, run_dir: Path):
        from torch.utils.tensorboard import SummaryWriter

        self.directory = run_dir / TENSORBOARD_SUBDIR
        quiet_tensorboard_thread_errors()
        with errors_name(self.directory):
            self.writer = SummaryWriter(log_dir=str(self.directory))

    def log(self, scalars: dict[str, float], step: int) -> None:
        with errors_name(self.directory):
            for key, value in scalars.items():
                self.writer.add_scalar(key, value, global_step=step)
            self.writer.flush()

    def close(self) -> None:
        with errors_name(self.directory):
            self.writer.close()


class WandbTracker:
    def __init__(self, run_dir: Path, *, project: str, name: str, save_dir: str, config: dict):
        import wandb

        directory = Path(save_dir) if save_dir else run_dir
        directory.mkdir(parents=True, exist_ok=True)
        os.environ.setdefault("WANDB_SILENT", "true")
        settings = dict(project=project, name=name, dir=str(directory), config=config)
        try:
            self.run = wandb.init(**settings)
        except Exception as error:  # no login or no network: keep the metrics offline, as MindSpeed-RL does
            logger.warning("wandb could not start online (%s); writing the run offline under %s for `wandb sync`",
                           str(error).splitlines()[0] if str(error) else type(error).__name__, directory / WANDB_SUBDIR)
            self.run = wandb.init(mode="offline", **settings)

    def log(self, scalars: dict[str, float], step: int) -> None:
        self.run.log(scalars, step=step)

    def close(self) -> None:
        self.run.finish()


def build_trackers(run_dir: Path, config) -> list[Tracker]:
    """The trackers the GRPOConfig's rl_config asks for; wandb also records the whole config."""
    rl = config.rl_config
    trackers: list[Tracker] = []
    if rl.use_tensorboard:
        trackers.append(TensorBoardTracker(run_dir))
    if rl.use_wandb:
        trackers.append(WandbTracker(run_dir, project=rl.wandb_project, name=rl.wandb_exp_name,
                                     save_dir=rl.wandb_save_dir, config=dataclasses.asdict(config)))
    return trackers
