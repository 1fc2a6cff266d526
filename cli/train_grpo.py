"""GRPO training: ``python cli/train_grpo.py [--config-name NAME] [key=value ...]``.

The default config is the Qwen2.5-7B recipe where an NPU/GPU is present, the tiny CPU demo elsewhere.
Exit codes: 0 on success (also ``--help`` and ``--cfg job``, which only print); 2 on any config
error, ours (one line ``config error: <key>: <message>`` on stderr) or Hydra's (unknown config name,
override of a key that does not exist, bad override syntax); otherwise whatever the run exits with.
Overrides are Hydra's, with two differences (config/overrides.py): ``a.b=v`` also sets a key the YAML
leaves out (every section of ours is optional), and ``--config-dir DIR`` makes DIR's files win over ours.
"""

import os
import sys
import warnings
from pathlib import Path

import hydra
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig

from mindspeed_rl.config import ConfigError, default_config_name, error_lines, load_config
from mindspeed_rl.config.no_effect import no_effect_notice
from mindspeed_rl.config.tolerated import warning_lines
from mindspeed_rl.console import quiet_console
from mindspeed_rl.config.overrides import hydra_argv
from mindspeed_rl.interrupts import RunInterrupted, stop_signals
from mindspeed_rl.trainer.stopping import RunStopped

CONFIG_ERROR_EXIT_CODE = 2

# Hydra reports its own composition errors by printing them and calling sys.exit(1) before our task
# function runs; this flag tells those exits apart from the run's.
_task_started = False


# The training stage this entry point runs (megatron_training.stage); cli/train_dapo.py sets ray_dapo.
STAGE = "ray_grpo"
ENTRY_POINTS = {"ray_grpo": "cli/train_grpo.py", "ray_dapo": "cli/train_dapo.py", "ray_ppo": "cli/train_ppo.py"}


# Absolute: cli/train_dapo.py imports this module, and Hydra resolves a relative path against the importer.
CONFIG_DIR = str(Path(__file__).resolve().parents[1] / "configs")


@hydra.main(config_path=CONFIG_DIR, config_name=default_config_name(), version_base="1.3")
def main(cfg: DictConfig) -> None:
    global _task_started
    _task_started = True
    quiet_console()  # until the config is read: runtime.log_level may show more
    with stop_signals():
        try:
            notices: list[str] = []
            config = load_config(cfg, notices=notices)
            quiet_console(config.runtime.log_level)
            if notices:
                print(no_effect_notice(notices), flush=True)
            for line in warning_lines(config):
                print(line, flush=True)
            if config.megatron_training.stage != STAGE:
                raise ConfigError("megatron_training.stage", f"is {config.megatron_training.stage}: run the recipe with "
                                                             f"{ENTRY_POINTS[config.megatron_training.stage]}, as its "
                                                             f"authors did (this is {ENTRY_POINTS[STAGE]})")
            run_dir = Path(HydraConfig.get().runtime.output_dir)
            # torch's allocator reads this at its first allocation, so it is set before torch is imported: a
            # one-rank run's rank lives in this process (workers/local_group.py). A user's own value wins.
            os.environ.setdefault("THP_MEM_ALLOC_ENABLE", "1")
            # Imported late so that config errors and --cfg/--help do not pay for importing torch, vLLM, Megatron.
            from mindspeed_rl.trainer import run_grpo

            # Paths and data files are checked before any worker starts; those errors are config errors too.
            run_grpo(config, run_dir=run_dir)
        except ConfigError as error:
            print("\n".join(error_lines(error)), file=sys.stderr)
            sys.exit(CONFIG_ERROR_EXIT_CODE)
        except RunStopped as stop:
            print(stop.message, file=sys.stderr, flush=True)
            sys.exit(stop.exit_code)
        except RunInterrupted as interrupt:  # before the run started anything
            print(f"interrupted by {interrupt} before the run started", file=sys.stderr, flush=True)
            sys.exit(128 + interrupt.signum)


def launch() -> None:
    sys.argv = hydra_argv(sys.argv, our_config_dir=CONFIG_DIR)
    # MindSpeed-RL's recipes have no `_self_` in their defaults; Hydra then composes them as they expect
    # (the recipe over its model block) and warns about it before every run.
    warnings.filterwarnings("ignore", message=".*Defaults list is missing `_self_`", category=UserWarning)
    try:
        main()
    except SystemExit as exit_request:
        if not _task_started and exit_request.code not in (0, None):
            sys.exit(CONFIG_ERROR_EXIT_CODE)
        raise


if __name__ == "__main__":
    launch()
