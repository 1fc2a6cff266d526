"""DPO training: ``python cli/train_dpo.py [--config-name NAME] [key=value ...]``.

MindSpeed-RL's entry point for its `dpo_*` recipe (`megatron_training.stage: dpo`, MindSpeed-LLM's DPO): the policy
trains with Megatron on preference pairs (chosen, rejected) against a frozen reference beside it on the same ranks;
nothing is generated (docs/dpo.md). The default config is MindSpeed-RL's dpo_qwen3_30b_a3b_A3 where an NPU/GPU is
present, the CPU demo dpo_tiny_cpu elsewhere. Exit codes as cli/train_grpo.py's.
"""
from mindspeed_rl.config.loader import accelerator_present
from mindspeed_rl.trainer.launch import launch

if __name__ == "__main__":
    launch("dpo", "dpo_qwen3_30b_a3b_A3" if accelerator_present() else "dpo_tiny_cpu")
