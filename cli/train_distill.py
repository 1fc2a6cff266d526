"""On-policy distillation: ``python cli/train_distill.py [--config-name NAME] [key=value ...]``.

verl's OPD (`distillation:` section, config/distillation.py, docs/distillation.md): the student samples, the teacher
scores each sampled token, the update adds the distillation loss. The loop is GRPO's (`megatron_training.stage:
ray_grpo`; cli/train_grpo.py with distillation.enabled=true runs the same); the default config is the CPU demo.
"""
from mindspeed_rl.trainer.launch import launch

if __name__ == "__main__":
    launch("ray_grpo", "distill_tiny_cpu")
