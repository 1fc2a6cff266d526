"""DPO as pure tensor functions: MindSpeed-LLM's DPOTrainer losses (the ones MindSpeed-RL's `cli/train_dpo.py` runs),
which are TRL's DPOTrainer formulas.

A preference batch is laid out pair-major: rows 2i and 2i+1 are the chosen and the rejected response of pair i. The
inputs are per-row log-probs of the response tokens summed over the response (`summed_logprobs`); `ipo` uses their
per-token means instead, as MindSpeed-LLM and TRL do.

- sigmoid: -(1 - ls) * logsigmoid(beta * z) - ls * logsigmoid(-beta * z), z = (pi_c - pi_r) - (ref_c - ref_r)
- hinge:   relu(1 - beta * z)
- ipo:     (z - 1 / (2 * beta))^2 on per-token mean log-probs
- kto_pair: 1 - sigmoid(beta * (pi_c - ref_c - KL_r)) and 1 - sigmoid(beta * (KL_c - (pi_r - ref_r))), KL_* the
  batch's clamped mean log-ratio (the HALOs paper's eqn 7, MindSpeed-LLM's kto_pair)
- pref_ftx > 0 adds pref_ftx * (the chosen response's mean negative log-likelihood) per pair.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from mindspeed_rl.config.dpo import DPO_LOSS_TYPES  # the names the config checks
# Loss types that compare per-token mean log-probs instead of sums (MindSpeed-LLM's `_compute_log_probs`).
MEAN_LOGPROB_LOSS_TYPES = frozenset({"ipo"})


@dataclass(frozen=True, kw_only=True)
class DPOLossConfig:
    loss_type: str = "sigmoid"
    beta: float = 0.1
    label_smoothing: float = 0.0
    # The SFT term's coefficient on the chosen responses (MindSpeed-LLM's pref_ftx).
    pref_ftx: float = 0.0

    def __post_init__(self) -> None:
        if self.loss_type not in DPO_LOSS_TYPES:
            raise ValueError(f"loss_type must be one of {', '.join(DPO_LOSS_TYPES)}, got {self.loss_type!r}")
        if self.beta <= 0:
            raise ValueError(f"beta must be > 0, got {self.beta}")
        if not 0.0 <= self.label_smoothing <= 0.5:
            raise ValueError(f"label_smoothing must be in [0, 0.5], got {self.label_smoothing}")
        if self.pref_ftx < 0:
            raise ValueError(f"pref_ftx must be >= 0, got {self.pref_ftx}")


def summed_logprobs(token_logprobs: torch.Tensor, response_mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """([B] the response's summed log-prob, [B] its token count) from [B, R] per-token values and their mask."""
    mask = response_mask.to(token_logprobs.dtype)
    return (token_logprobs * mask).sum(-1), mask.sum(-1)


def split_pairs(rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(chosen, rejected) of a pair-major [2P, ...] tensor."""
    if rows.shape[0] % 2:
        raise ValueError(f"a preference batch has an even number of rows (chosen, rejected), got {rows.shape[0]}")
    return rows[0::2], rows[1::2]


def dpo_pair_losses(policy_chosen: torch.Tensor, policy_rejected: torch.Tensor, ref_chosen: torch.Tensor,
                    ref_rejected: torch.Tensor, config: DPOLossConfig) -> tuple[torch.Tensor, torch.Tensor,
                                                                               torch.Tensor]:
    """([P] loss per pair, [P] chosen rewards, [P] rejected rewards) from [P] log-probs (sums, or means for ipo)."""
    beta = config.beta
    logits = (policy_chosen - policy_rejected) - (ref_chosen - ref_rejected)
    if config.loss_type == "sigmoid":
        ls = config.label_smoothing
        losses = -F.logsigmoid(beta * logits) * (1 - ls) - F.logsigmoid(-beta * logits) * ls
    elif config.loss_type == "hinge":
        losses = torch.relu(1 - beta * logits)
    elif config.loss_type == "ipo":
        losses = (logits - 1 / (2 * beta)) ** 2
    else:  # kto_pair: each half's KL estimated from the other half of the batch
        chosen_ratio, rejected_ratio = policy_chosen - ref_chosen, policy_rejected - ref_rejected
        chosen_kl = chosen_ratio.mean().clamp(min=0).detach()
        rejected_kl = rejected_ratio.mean().clamp(min=0).detach()
        # Their loss concatenates the halves (2P values, then a mean): a pair's share is the halves' mean.
        losses = 0.5 * ((1 - torch.sigmoid(beta * (chosen_ratio - rejected_kl)))
                        + (1 - torch.sigmoid(beta * (chosen_kl - rejected_ratio))))
    chosen_rewards = beta * (policy_chosen - ref_chosen).detach()
    rejected_rewards = beta * (policy_rejected - ref_rejected).detach()
    return losses, chosen_rewards, rejected_rewards


def dpo_loss(token_logprobs: torch.Tensor, ref_token_logprobs: torch.Tensor, response_mask: torch.Tensor,
             config: DPOLossConfig, *, pairs_in_mini_batch: float) -> tuple[torch.Tensor, dict[str, float]]:
    """The loss of a pair-major micro-batch as its share of the mini-batch's mean over `pairs_in_mini_batch` pairs
    (so the micro-batches' losses and stats add up to the mini-batch's means), and those stats."""
    policy_sums, lengths = summed_logprobs(token_logprobs, response_mask)
    ref_sums, _ = summed_logprobs(ref_token_logprobs.to(token_logprobs.dtype), response_mask)
    policy, ref = policy_sums, ref_sums
    if config.loss_type in MEAN_LOGPROB_LOSS_TYPES:
        policy, ref = policy_sums / lengths.clamp(min=1), ref_sums / lengths.clamp(min=1)
    (policy_c, policy_r), (ref_c, ref_r) = split_pairs(policy), split_pairs(ref)
    losses, chosen_rewards, rejected_rewards = dpo_pair_losses(policy_c, policy_r, ref_c, ref_r, config)
    chosen_sums, _ = split_pairs(policy_sums)
    chosen_lengths, _ = split_pairs(lengths)
    sft_losses = -chosen_sums / chosen_lengths.clamp(min=1)
    if config.pref_ftx > 0:
        losses = losses + config.pref_ftx * sft_losses
    share = 1.0 / pairs_in_mini_batch
    stats = {
        "dpo/loss": float(losses.detach().sum()) * share,
        "dpo/reward_margin": float((chosen_rewards - rejected_rewards).sum()) * share,
        "dpo/chosen_reward": float(chosen_rewards.sum()) * share,
        "dpo/rejected_reward": float(rejected_rewards.sum()) * share,
        "dpo/accuracy": float((chosen_rewards > rejected_rewards).float().sum()) * share,
        "dpo/sft_loss": float(sft_losses.detach().sum()) * share,
    }
    return losses.sum() * share, stats


def preference_accuracy(policy_sums: torch.Tensor, ref_sums: torch.Tensor, *, beta: float) -> dict[str, float]:
    """Held-out pairs' metrics from pair-major [2P] summed log-probs: the share of pairs whose implicit reward
    (beta x the log-ratio to the reference) is higher for the chosen response, and the mean reward margin."""
    (policy_c, policy_r), (ref_c, ref_r) = split_pairs(policy_sums), split_pairs(ref_sums)
    margins = beta * ((policy_c - ref_c) - (policy_r - ref_r))
    return {"accuracy": float((margins > 0).float().mean()), "reward_margin": float(margins.mean()),
            "chosen_logprob": float(policy_c.mean()), "rejected_logprob": float(policy_r.mean())}


def dpo_loss_config(megatron_training) -> DPOLossConfig:
    """The loss megatron_training's DPO keys (MindSpeed-LLM's) describe."""
    mt = megatron_training
    return DPOLossConfig(loss_type=mt.dpo_loss_type, beta=mt.dpo_beta, label_smoothing=mt.dpo_label_smoothing,
                         pref_ftx=mt.pref_ftx)
