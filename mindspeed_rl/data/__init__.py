"""Data: the prompt datasets and templates, the rule verifiers, and the CPU demos' locally generated
assets. Names are imported on first use, so the preprocessing CLI does not pay for torch or transformers."""
from importlib import import_module

_EXPORTS = {
    "ensure_demo_assets": "arith_task", "make_arith_prompts": "arith_task", "read_prompts_jsonl": "arith_task",
    "write_prompts_jsonl": "arith_task",
    "VERIFIERS": "rewards", "RuleRewards": "rewards", "accuracy": "rewards", "answer_is_correct": "rewards",
    "arith_acc": "rewards", "compute_rule_rewards": "rewards",
    "create_tiny_qwen2_checkpoint": "tiny_model",
    "EOS_TOKEN": "tokenizer", "EOS_TOKEN_ID": "tokenizer", "train_arith_tokenizer": "tokenizer",
}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module 'mindspeed_rl.data' has no attribute {name!r}")
    return getattr(import_module(f"mindspeed_rl.data.{_EXPORTS[name]}"), name)
