"""The driver's side of a reward model (rewards.<name>.model_path): its checkpoint resolved and checked at
start, before any worker starts, and its scores combined with the rule rewards each iteration.

reward = rule verifiers' total (rl_config.verifier_weight) + rewards.<name>.weight x the model's score.
"""
from __future__ import annotations

import json
import os
from dataclasses import replace
from pathlib import Path

import torch

from mindspeed_rl.config import ConfigError, GRPOConfig
from mindspeed_rl.registries import SYNTHETIC_REWARD_MODEL
from mindspeed_rl.data.rewards import RuleRewards


def resolve_reward_model(config: GRPOConfig, model_dir: str, tokenizer_size: int) -> str | None:
    """The reward model's HF directory (generated first for `synthetic`), checked against the actor's layout
    and tokenizer, and written back into the config as an absolute path so that the ranks read the same
    directory. None without a reward model."""
    if config.reward_model is None:
        return None
    from mindspeed_rl.trainer.setup import check_hf_model_dir

    name, section = config.reward_model
    key = f"rewards.{name}.model_path"
    path = section.model_path
    if path == SYNTHETIC_REWARD_MODEL:
        from mindspeed_rl.data.tiny_reward_model import ensure_tiny_reward_model

        synthetic = config.synthetic_data
        path = str(ensure_tiny_reward_model(synthetic.data_dir, base_model_dir=model_dir, seed=synthetic.seed))
    check_hf_model_dir(path, key)
    check_reward_model_config(config, json.loads((Path(path) / "config.json").read_text(encoding="utf-8")), key,
                              tokenizer_size)
    path = os.path.abspath(path)
    config.rewards[name] = replace(section, model_path=path)
    return path


def check_reward_model_config(config: GRPOConfig, hf_config: dict, key: str, tokenizer_size: int) -> None:
    """A dense Qwen2 sequence classifier with one label that the actor's TP/PP layout can shard and whose
    embedding has a row for every token id of the actor's tokenizer. Raises ConfigError naming `key`."""
    architectures = hf_config.get("architectures") or []
    if not any(a.endswith("ForSequenceClassification") for a in architectures):
        raise ConfigError(key, f"must be a sequence-classification checkpoint (Qwen2ForSequenceClassification), its "
                               f"config.json lists architectures {architectures}")
    labels = hf_config.get("num_labels", len(hf_config.get("id2label") or {}) or 2)
    if labels != 1:
        raise ConfigError(key, f"must have num_labels=1 (one scalar score), got {labels}")
    check_shards_like_the_actor(config, hf_config, key, what="the reward model", tokenizer_size=tokenizer_size)


def check_shards_like_the_actor(config: GRPOConfig, hf_config: dict, key: str, *, what: str,
                                tokenizer_size: int, layout: tuple[int, int, str] | None = None) -> None:
    """A model that runs in the actor's TP/PP layout (its heads over TP, its layers over PP), or in `layout` (tp, pp,
    the section that sizes them), and scores the actor's token ids (an embedding row for each). Raises ConfigError
    naming `key`."""
    ac = config.actor_config
    tp, pp, section = layout or (ac.tensor_model_parallel_size, ac.pipeline_model_parallel_size, "actor_config")
    whose = "its own layout" if layout else "the actor's layout"
    for field, size, sized_by in (("num_attention_heads", tp, f"{section}.tensor_model_parallel_size"),
                                  ("num_key_value_heads", tp, f"{section}.tensor_model_parallel_size"),
                                  ("num_hidden_layers", pp, f"{section}.pipeline_model_parallel_size")):
        value = hf_config.get(field)
        if value is not None and value % size:
            raise ConfigError(key, f"{field}={value} is not divisible by {sized_by}={size}: {what} runs in {whose}")
    vocab_size = hf_config.get("vocab_size", 0)
    if tokenizer_size > vocab_size:
        raise ConfigError(key, f"has vocab_size {vocab_size}, but the actor's tokenizer has {tokenizer_size} tokens: "
                               f"{what} scores the actor's token ids, which need an embedding row each")


def with_model_scores(rule: RuleRewards, scores: torch.Tensor, weight: float) -> RuleRewards:
    """The rule rewards with the model's weighted scores added to their total (summed in float64, as the rule
    total is); the per-verifier scores stay the rule verifiers' own."""
    if scores.shape != rule.total.shape:
        raise ValueError(f"{tuple(scores.shape)} reward-model scores for {tuple(rule.total.shape)} samples")
    total = rule.total.to(torch.float64) + weight * scores.to(torch.float64)
    return RuleRewards(total=total.to(torch.float32), per_verifier=rule.per_verifier)


def model_score_metrics(scores: torch.Tensor) -> dict[str, float]:
    return {"reward/model_score": scores.mean().item(), "reward/model_score_std": scores.std().item()
            if scores.numel() > 1 else 0.0}
