"""DAPO training: ``python cli/train_dapo.py [--config-name NAME] [key=value ...]``.

MindSpeed-RL's entry point for its `dapo_*` recipes (`megatron_training.stage: ray_dapo`): the GRPO trainer,
whose DAPO steps are rl_config keys (clip-higher, the token-level loss, overlong reward shaping, dynamic
sampling; no reference model with init_kl_coef 0); see README "DAPO". The default config is
dapo_qwen25_7b_A3 where an NPU/GPU is present, the CPU demo dapo_tiny_math_cpu elsewhere. Exit codes as
cli/train_grpo.py's.
"""
from mindspeed_rl.config.loader import accelerator_present
from mindspeed_rl.trainer.launch import launch

if __name__ == "__main__":
    launch("ray_dapo", "dapo_qwen25_7b_A3" if accelerator_present() else "dapo_tiny_math_cpu")
