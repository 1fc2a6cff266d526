"""PPO training with a critic: ``python cli/train_ppo.py [--config-name NAME] [key=value ...]``.

MindSpeed-RL's entry point for its `ppo_*` recipes (`megatron_training.stage: ray_ppo`): the same trainer as
GRPO's, with `rl_config.adv_estimator: gae` and a `critic_config` section: the critic's values of each rollout,
GAE advantages, the critic's update after the actor's (trainer/critic_step.py, docs/algorithms.md). The
default config is MindSpeed-RL's ppo_qwen25_32b_A3 (shipped verbatim) where an NPU/GPU is present, the CPU demo
ppo_tiny_cpu elsewhere. Exit codes as cli/train_grpo.py's.
"""
from mindspeed_rl.config.loader import accelerator_present
from mindspeed_rl.trainer.launch import launch

if __name__ == "__main__":
    launch("ray_ppo", "ppo_qwen25_32b_A3" if accelerator_present() else "ppo_tiny_cpu")
