from mindspeed_rl.trainer.grpo_trainer import run_grpo

__all__ = ["run_grpo"]
