"""PPO training with a critic: ``python cli/train_ppo.py [--config-name NAME] [key=value ...]``.

MindSpeed-RL's entry point for its `ppo_*` recipes (`megatron_training.stage: ray_ppo`): the same trainer as
GRPO's, with `rl_config.adv_estimator: gae` and a `critic_config` section: the critic's values of each rollout,
GAE advantages, the critic's update after the actor's (trainer/advantage_step.py, docs/algorithms.md). The
default config is MindSpeed-RL's ppo_qwen25_32b_A3 (shipped verbatim) where an NPU/GPU is present, the CPU demo
ppo_tiny_cpu elsewhere. Exit codes as cli/train_grpo.py's.
"""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import train_dapo  # noqa: E402  (beside this file: the default-config helper)
import train_grpo  # noqa: E402  (the launcher)

from mindspeed_rl.config.loader import accelerator_present  # noqa: E402

DEFAULT_CONFIG = "ppo_qwen25_32b_A3" if accelerator_present() else "ppo_tiny_cpu"

if __name__ == "__main__":
    train_grpo.STAGE = "ray_ppo"
    train_dapo.DEFAULT_CONFIG = DEFAULT_CONFIG
    sys.argv = train_dapo._with_default_config(sys.argv)
    train_grpo.launch()
