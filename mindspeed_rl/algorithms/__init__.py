"""GRPO algorithm pieces as pure tensor functions (no devices, no process groups)."""

from mindspeed_rl.algorithms.grpo import (
    KL_PENALTY_KINDS,
    LOSS_AGG_MODES,
    GRPOLossConfig,
    aggregate_loss,
    count_loss_units,
    entropy_from_logits,
    group_normalized_advantages,
    grpo_loss,
    kl_penalty,
    masked_mean,
    masked_sum,
    ppo_clip_policy_loss,
)

__all__ = [
    "KL_PENALTY_KINDS",
    "LOSS_AGG_MODES",
    "GRPOLossConfig",
    "aggregate_loss",
    "count_loss_units",
    "entropy_from_logits",
    "group_normalized_advantages",
    "grpo_loss",
    "kl_penalty",
    "masked_mean",
    "masked_sum",
    "ppo_clip_policy_loss",
]
