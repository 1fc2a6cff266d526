"""DAPO training: ``python cli/train_dapo.py [--config-name NAME] [key=value ...]``.

MindSpeed-RL's entry point for its `dapo_*` recipes (`megatron_training.stage: ray_dapo`): the GRPO trainer,
whose DAPO steps are rl_config keys (clip-higher, the token-level loss, overlong reward shaping, dynamic
sampling; no reference model with init_kl_coef 0); see README "DAPO". The default config is
dapo_qwen25_7b_A3 where an NPU/GPU is present, the CPU demo dapo_tiny_math_cpu elsewhere. Exit codes as
cli/train_grpo.py's.
"""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import train_grpo  # noqa: E402  (the launcher, beside this file)

from mindspeed_rl.config.loader import accelerator_present  # noqa: E402

DEFAULT_CONFIG = "dapo_qwen25_7b_A3" if accelerator_present() else "dapo_tiny_math_cpu"


def _with_default_config(argv: list[str]) -> list[str]:
    """Hydra's decorator fixed train_grpo's default config; DAPO's is given on the command line unless the user
    names one."""
    if any(arg.startswith(("--config-name", "-cn")) for arg in argv[1:]):
        return argv
    return [argv[0], "--config-name", DEFAULT_CONFIG, *argv[1:]]


if __name__ == "__main__":
    train_grpo.STAGE = "ray_dapo"
    sys.argv = _with_default_config(sys.argv)
    train_grpo.launch()
