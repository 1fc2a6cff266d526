"""The training CLIs' one launcher: `launch(stage, default_config)` is all of cli/train_grpo.py, train_dapo.py and
train_ppo.py (MindSpeed-RL's entry points, one per `megatron_training.stage`).

Exit codes: 0 on success (also ``--help`` and ``--cfg job``, which only print); 2 on any config error, ours (one line
``config error: <key>: <message>`` on stderr) or Hydra's (unknown config name, override of a key that does not exist,
bad override syntax); otherwise whatever the run exits with. Overrides are Hydra's, with two differences
(config/overrides.py): ``a.b=v`` also sets a key the YAML leaves out (every section of ours is optional), and
``--config-dir DIR`` makes DIR's files win over ours.

Only the config's own modules are imported before the config is read: config errors, ``--help`` and ``--cfg`` do not
pay for importing torch, vLLM or Megatron.
"""
from __future__ import annotations

import atexit
import os
import sys
import warnings
from pathlib import Path
from typing import Callable, NoReturn

import hydra
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig

from mindspeed_rl.config import ConfigError, error_lines, load_config
from mindspeed_rl.config.dpo import DPO_STAGE
from mindspeed_rl.config.no_effect import no_effect_notice
from mindspeed_rl.config.overrides import hydra_argv
from mindspeed_rl.config.tolerated import warning_lines
from mindspeed_rl.console import quiet_console
from mindspeed_rl.interrupts import RunInterrupted, stop_signals
from mindspeed_rl.trainer.stopping import RunStopped

CONFIG_ERROR_EXIT_CODE = 2
ENTRY_POINTS = {"ray_grpo": "cli/train_grpo.py", "ray_dapo": "cli/train_dapo.py", "ray_ppo": "cli/train_ppo.py",
                "dpo": "cli/train_dpo.py"}
# Absolute: Hydra resolves a relative config path against the task function's module.
CONFIG_DIR = str(Path(__file__).resolve().parents[2] / "configs")
# Hydra names the job after the task function's module; the job names the run's log, <run dir>/train_grpo.log, as
# every entry point's runs have always had it.
JOB_NAME = "train_grpo"


def launch(stage: str, default_config: str) -> None:
    """Run the `stage` entry point on the command line's config (`default_config` unless --config-name names one)."""
    sys.argv = hydra_argv(sys.argv, our_config_dir=CONFIG_DIR)
    # MindSpeed-RL's recipes have no `_self_` in their defaults; Hydra then composes them as they expect
    # (the recipe over its model block) and warns about it before every run.
    warnings.filterwarnings("ignore", message=".*Defaults list is missing `_self_`", category=UserWarning)
    started: list[bool] = []  # the task function ran: Hydra's own composition errors exit before it
    main = hydra.main(config_path=CONFIG_DIR, config_name=default_config, version_base="1.3")(_task(stage, started))
    try:
        main()
    except SystemExit as exit_request:
        if not started and exit_request.code not in (0, None):
            sys.exit(CONFIG_ERROR_EXIT_CODE)
        if started and isinstance(exit_request.code, int):
            _exit_without_teardown(exit_request.code)
        raise
    if started:
        _exit_without_teardown(0)


def _exit_without_teardown(code: int) -> NoReturn:
    """Exit once what must run at exit has run (atexit: trackers, logging, the verifier's pool), skipping the
    interpreter's teardown: after a run it is one garbage collection over torch's, vLLM's and Megatron's heap, 2-4 s of
    a tiny run's 20 (measured 2026-11-29), and it frees nothing the OS would not."""
    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def _task(stage: str, started: list[bool]) -> Callable[[DictConfig], None]:
    def task(cfg: DictConfig) -> None:
        started.append(True)
        quiet_console()  # until the config is read: runtime.log_level may show more
        with stop_signals():
            try:
                _run(cfg, stage)
            except ConfigError as error:
                print("\n".join(error_lines(error)), file=sys.stderr)
                sys.exit(CONFIG_ERROR_EXIT_CODE)
            except RunStopped as stop:
                print(stop.message, file=sys.stderr, flush=True)
                sys.exit(stop.exit_code)
            except RunInterrupted as interrupt:  # before the run started anything
                print(f"interrupted by {interrupt} before the run started", file=sys.stderr, flush=True)
                sys.exit(128 + interrupt.signum)

    task.__module__ = JOB_NAME
    return task


def _run(cfg: DictConfig, stage: str) -> None:
    notices: list[str] = []
    config = load_config(cfg, notices=notices)
    quiet_console(config.runtime.log_level)
    if notices:
        print(no_effect_notice(notices), flush=True)
    for line in warning_lines(config):
        print(line, flush=True)
    if config.megatron_training.stage != stage:
        raise ConfigError("megatron_training.stage", f"is {config.megatron_training.stage}: run the recipe with "
                                                     f"{ENTRY_POINTS[config.megatron_training.stage]}, as its "
                                                     f"authors did (this is {ENTRY_POINTS[stage]})")
    run_dir = Path(HydraConfig.get().runtime.output_dir)
    # torch's allocator reads this at its first allocation, so it is set before torch is imported: a one-rank run's
    # rank lives in this process (workers/local_group.py). A user's own value wins.
    os.environ.setdefault("THP_MEM_ALLOC_ENABLE", "1")
    # Imported late so that config errors and --cfg/--help do not pay for importing torch, vLLM, Megatron.
    # Paths and data files are checked before any worker starts; those errors are config errors too.
    if stage == DPO_STAGE:  # no rollout: its own loop (trainer/dpo_run.py)
        from mindspeed_rl.trainer.dpo_run import run_dpo

        run_dpo(config, run_dir=run_dir)
        return
    from mindspeed_rl.trainer import run_grpo

    run_grpo(config, run_dir=run_dir)
