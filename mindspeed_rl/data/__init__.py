"""The CPU demo's locally generated assets: tokenizer, tiny Qwen2 checkpoint, arithmetic task,
rule rewards. transformers is imported lazily, only when a checkpoint or tokenizer is written."""

from mindspeed_rl.data.arith_task import (
    ensure_demo_assets,
    make_arith_prompts,
    read_prompts_jsonl,
    write_prompts_jsonl,
)
from mindspeed_rl.data.rewards import VERIFIERS, accuracy, arith_acc, compute_rule_rewards
from mindspeed_rl.data.tiny_model import create_tiny_qwen2_checkpoint
from mindspeed_rl.data.tokenizer import EOS_TOKEN, EOS_TOKEN_ID, train_arith_tokenizer

__all__ = [
    "EOS_TOKEN",
    "EOS_TOKEN_ID",
    "VERIFIERS",
    "accuracy",
    "arith_acc",
    "compute_rule_rewards",
    "create_tiny_qwen2_checkpoint",
    "ensure_demo_assets",
    "make_arith_prompts",
    "read_prompts_jsonl",
    "train_arith_tokenizer",
    "write_prompts_jsonl",
]
