"""Experiment trackers beside metrics.jsonl, with MindSpeed-RL's keys: TensorBoard (`rl_config.use_tensorboard`),
Weights & Biases (`use_wandb`, `wandb_project`, `wandb_exp_name`, `wandb_save_dir`) and SwanLab (`use_swanlab`,
`swanlab_mode`, `swanlab_project`, `swanlab_exp_name`, `swanlab_save_dir`); and MLflow (ours: `use_mlflow`,
`mlflow_tracking_uri`, `mlflow_project`, `mlflow_exp_name`). Each gets every numeric scalar of each iteration's
record at step = iteration.

wandb: online when the machine is logged in and reaches the server; otherwise (or with WANDB_MODE=offline) the
run is written offline under `<wandb_save_dir>/wandb` (default `<run dir>/wandb`) for a later `wandb sync`, as
MindSpeed-RL falls back to offline. SwanLab likewise: `swanlab_mode: cloud` without a login or a network, and
`local` without SwanLab's dashboard package, write the run offline under `swanlab_save_dir` (default
`<run dir>/swanlab`) for a later `swanlab sync`, saying so in one warning line. MLflow: the SQLite store
`<run dir>/mlflow.db` unless `mlflow_tracking_uri` names another; one that cannot be reached falls back to it.
"""
from __future__ import annotations

import dataclasses
import logging
import importlib.util
import json
import os
import time
from pathlib import Path
from typing import Protocol

from mindspeed_rl.trainer.sinks import TENSORBOARD_SUBDIR, errors_name, quiet_tensorboard_thread_errors

logger = logging.getLogger(__name__)
WANDB_SUBDIR = "wandb"  # wandb's own folder under its `dir`
SWANLAB_SUBDIR = "swanlab"  # the default swanlab_save_dir under the run dir (MindSpeed-RL's: ./swanlab)
MLFLOW_DB = "mlflow.db"  # the default MLflow store under the run dir (MLflow 3's own default file name)
MLFLOW_ARTIFACTS = "mlartifacts"  # its runs' artifacts (MLflow's default folder name, but under the run dir)
MLFLOW_BATCH = 1000  # MLflow's most metrics per log_batch call


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
                           _first_line(error), directory / WANDB_SUBDIR)
            self.run = wandb.init(mode="offline", **settings)

    def log(self, scalars: dict[str, float], step: int) -> None:
        self.run.log(scalars, step=step)

    def close(self) -> None:
        self.run.finish()


class SwanLabTracker:
    def __init__(self, run_dir: Path, *, mode: str, project: str, name: str, save_dir: str, config: dict):
        import swanlab

        self.swanlab = swanlab
        directory = Path(save_dir) if save_dir else run_dir / SWANLAB_SUBDIR
        directory.mkdir(parents=True, exist_ok=True)
        # interactive=False: without a login, swanlab's cloud mode would otherwise wait on input() for a key.
        settings = dict(project=project, experiment_name=name, logdir=str(directory), config=config,
                        settings=swanlab.Settings(interactive=False))
        if mode == "local" and importlib.util.find_spec("swanboard") is None:
            # swanlab 0.10's local mode (deprecated there) fills its dashboard's database through swanboard
            # (swanlab[dashboard], not installed: it pins rich < 14); without it `swanlab watch` has nothing to show
            # and an error goes to the run's debug log, so the run is written offline, which `swanlab sync` uploads.
            logger.warning("swanlab_mode local needs swanboard (pip install 'swanlab[dashboard]'); writing the "
                           "run offline under %s for `swanlab sync`", directory)
            mode = "offline"
        try:
            swanlab.init(mode=mode, **settings)
        except Exception as error:  # cloud without a login or a network: keep the metrics offline
            if mode != "cloud":
                raise
            logger.warning("swanlab could not start in the cloud (%s); writing the run offline under %s for "
                           "`swanlab sync`", _first_line(error), directory)
            swanlab.init(mode="offline", reinit=True, **settings)

    def log(self, scalars: dict[str, float], step: int) -> None:
        self.swanlab.log(scalars, step=step)

    def close(self) -> None:
        self.swanlab.finish()


class MLflowTracker:
    """One MLflow run (experiment `project`, run name `name`) through MlflowClient, so no global active run."""

    def __init__(self, run_dir: Path, *, tracking_uri: str, project: str, name: str, config: dict):
        # MLflow 3 refuses its file store (./mlruns) unless MLFLOW_ALLOW_FILE_STORE=true, and that store cannot
        # hold our names anyway: a metric is a file named by its key, so timing/update and timing/update/total
        # (a file and a directory) collide. SQLite needs no server and no network, only SQLAlchemy and Alembic.
        local = run_dir.resolve()
        local_uri = f"sqlite:///{local / MLFLOW_DB}"
        try:
            self.client, self.run_id = _start_mlflow_run(tracking_uri or local_uri, project, name, config,
                                                         artifacts=None if tracking_uri else local / MLFLOW_ARTIFACTS)
        except Exception as error:  # the named store is not reachable: keep the metrics in the local one
            if not tracking_uri or tracking_uri == local_uri:
                raise
            logger.warning("mlflow could not reach %s (%s); writing the run to %s", tracking_uri,
                           _first_line(error), local_uri)
            self.client, self.run_id = _start_mlflow_run(local_uri, project, name, config,
                                                         artifacts=local / MLFLOW_ARTIFACTS)

    def log(self, scalars: dict[str, float], step: int) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        metrics = [Metric(key, float(value), now, step) for key, value in scalars.items()]
        for start in range(0, len(metrics), MLFLOW_BATCH):
            self.client.log_batch(self.run_id, metrics=metrics[start:start + MLFLOW_BATCH])

    def close(self) -> None:
        self.client.set_terminated(self.run_id)


def _start_mlflow_run(uri: str, project: str, name: str, config: dict, *, artifacts: Path | None):
    """`artifacts`: where a new experiment keeps its runs' files (None: the store's default; for a local
    database MLflow's default is ./mlartifacts in the working directory, so the run dir's is given)."""
    from mlflow import MlflowClient

    # MLflow's import gives its logger a stderr handler of its own; through the root's handlers instead, its INFO
    # notes (creating the database's tables) reach the run's log file only, as other libraries' do (console.py).
    mlflow_logger = logging.getLogger("mlflow")
    mlflow_logger.handlers.clear()
    mlflow_logger.propagate = True
    client = MlflowClient(tracking_uri=uri)
    experiment = client.get_experiment_by_name(project)
    experiment_id = experiment.experiment_id if experiment else client.create_experiment(
        project, artifact_location=artifacts.as_uri() if artifacts else None)
    run_id = client.create_run(experiment_id, run_name=name).info.run_id
    # The whole config as one artifact: as params it would be hundreds of keys, each capped in length.
    client.log_text(run_id, json.dumps(config, indent=1, default=str), "config.json")
    return client, run_id


def _first_line(error: Exception) -> str:
    return str(error).splitlines()[0] if str(error) else type(error).__name__


def build_trackers(run_dir: Path, config) -> list[Tracker]:
    """The trackers the GRPOConfig's rl_config asks for; wandb, SwanLab and MLflow also record the whole config."""
    rl = config.rl_config
    trackers: list[Tracker] = []
    if rl.use_tensorboard:
        trackers.append(TensorBoardTracker(run_dir))
    if rl.use_wandb:
        trackers.append(WandbTracker(run_dir, project=rl.wandb_project, name=rl.wandb_exp_name,
                                     save_dir=rl.wandb_save_dir, config=dataclasses.asdict(config)))
    if rl.use_swanlab:
        trackers.append(SwanLabTracker(run_dir, mode=rl.swanlab_mode, project=rl.swanlab_project,
                                       name=rl.swanlab_exp_name, save_dir=rl.swanlab_save_dir,
                                       config=dataclasses.asdict(config)))
    if rl.use_mlflow:
        trackers.append(MLflowTracker(run_dir, tracking_uri=rl.mlflow_tracking_uri, project=rl.mlflow_project,
                                      name=rl.mlflow_exp_name, config=dataclasses.asdict(config)))
    return trackers
