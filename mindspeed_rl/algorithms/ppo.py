"""PPO with a critic: token-level rewards (the outcome score on the last response token, the KL penalty on
every token when ``rl_config.use_kl_in_reward``), GAE, whitening, the clipped value loss and the KL
coefficient's controllers. Formulas as verl's ``trainer/ppo/core_algos.py`` (``compute_gae_advantage_return``,
``masked_whiten``, ``compute_value_loss``, ``AdaptiveKLController``), which MindSpeed-RL's PPO follows too.

Shapes: ``[num_samples, response_len]`` per token, ``response_mask`` marking the generated tokens (left-aligned:
a response's tokens come first, its padding after). Statistics in float64, results float32.
"""
from __future__ import annotations

import math

import torch
from torch import Tensor

from mindspeed_rl.algorithms.advantages import masked_whiten
from mindspeed_rl.algorithms.grpo import aggregate_loss, kl_penalty, masked_mean

KL_CONTROLLERS = ("fixed", "adaptive")


def token_level_rewards(scores: Tensor, response_mask: Tensor) -> Tensor:
    """The outcome score of each sample on its last response token, 0 elsewhere (verl's token_level_scores)."""
    mask = response_mask.to(torch.float64)
    if scores.shape != mask.shape[:1]:
        raise ValueError(f"scores {tuple(scores.shape)} and response_mask {tuple(mask.shape)} disagree")
    last = (mask.sum(-1).long() - 1).clamp(min=0)
    rewards = torch.zeros_like(mask)
    rewards[torch.arange(mask.shape[0]), last] = scores.to(torch.float64) * (mask.sum(-1) > 0)
    return rewards


def apply_kl_penalty(rewards: Tensor, old_logprobs: Tensor, ref_logprobs: Tensor, response_mask: Tensor, *,
                     kl_coef: float, kind: str) -> tuple[Tensor, float]:
    """KL in the reward (verl's apply_kl_penalty): r_t - beta * KL_t on every response token. Returns the rewards
    and the batch's KL (the mean over samples of each sample's token-mean KL), what the adaptive controller reads."""
    kl = kl_penalty(old_logprobs.to(torch.float64), ref_logprobs.to(torch.float64), kind) * response_mask
    current_kl = masked_mean(kl, response_mask, dim=-1).mean().item()
    return rewards - kl_coef * kl, current_kl


def gae_advantages_and_returns(rewards: Tensor, values: Tensor, response_mask: Tensor, *, gamma: float,
                               lam: float) -> tuple[Tensor, Tensor]:
    """Generalised advantage estimation (Schulman et al. 2016) over the response tokens:

        delta_t = r_t + gamma V_{t+1} - V_t,    A_t = delta_t + gamma lam A_{t+1},    R_t = A_t + V_t

    with V and A past a response's last token taken as 0 (masked positions carry the next valid token's value
    and advantage through, as verl does). The advantages are whitened over the batch's response tokens (verl's
    masked_whiten: unbiased variance, eps 1e-8 under the root); the returns, the value loss's target, are not.
    """
    mask = response_mask.to(torch.float64)
    rewards, values = rewards.to(torch.float64), values.to(torch.float64)
    next_value = torch.zeros(mask.shape[0], dtype=torch.float64)
    next_advantage = torch.zeros_like(next_value)
    advantages = torch.zeros_like(mask)
    for t in reversed(range(mask.shape[1])):
        delta = rewards[:, t] + gamma * next_value - values[:, t]
        advantage = delta + gamma * lam * next_advantage
        keep = mask[:, t]
        next_value = values[:, t] * keep + (1 - keep) * next_value
        next_advantage = advantage * keep + (1 - keep) * next_advantage
        advantages[:, t] = advantage
    returns = (advantages + values) * mask
    return (masked_whiten(advantages, mask) * mask).to(torch.float32), returns.to(torch.float32)


def clipped_value_loss(values: Tensor, old_values: Tensor, returns: Tensor, response_mask: Tensor, *,
                       cliprange_value: float, loss_agg_mode: str, denominator: float,
                       mini_batch_tokens: float) -> tuple[Tensor, dict]:
    """PPO's value loss with the update clipped around the values the rollout saw (verl's compute_value_loss):

        V_clip = clip(V, V_old - c, V_old + c),   L = 0.5 * agg(max((V - R)^2, (V_clip - R)^2))

    Returns the loss (``denominator``: the whole mini-batch's, as for the policy loss) and its statistics, each this
    micro-batch's share of the mini-batch's value (the engine sums them over micro-batches and DP ranks):
    ``critic/vf_loss`` and ``critic/vf_clipfrac``, the fraction of the mini-batch's ``mini_batch_tokens`` valid tokens
    where the clipped term was the larger. V is clamped into the range, as verl does: a value inside it is its own
    clipped value, bit for bit, and never counts as clipped."""
    clipped = torch.clamp(values, old_values - cliprange_value, old_values + cliprange_value)
    unclipped_loss = (values - returns) ** 2
    clipped_loss = (clipped - returns) ** 2
    loss = 0.5 * aggregate_loss(torch.maximum(unclipped_loss, clipped_loss), response_mask, loss_agg_mode,
                                denominator)
    clipped_tokens = ((clipped_loss > unclipped_loss) & response_mask.bool()).sum().item()
    return loss, {"critic/vf_loss": loss.detach().item(), "critic/vf_clipfrac": clipped_tokens / mini_batch_tokens}


def explained_variance(values: Tensor, returns: Tensor, response_mask: Tensor) -> float:
    """1 - Var(R - V) / Var(R) over the valid tokens (`critic/explained_variance`, verl's critic/vf_explained_var): 1
    where the values predict the returns, 0 for their mean, below 0 for worse."""
    valid = response_mask.bool()
    r, v = returns[valid].double(), values[valid].double()
    total = r.var(unbiased=False)
    return float(1.0 - (r - v).var(unbiased=False) / total) if total > 0 else 0.0


class FixedKLController:
    """The KL coefficient stays ``init_kl_coef`` (rl_config.kl_ctrl_type: fixed)."""

    def __init__(self, init_kl_coef: float):
        self.value = init_kl_coef

    def update(self, current_kl: float, n_steps: int) -> None:
        pass


class AdaptiveKLController:
    """Ziegler et al. 2019 ("Fine-Tuning Language Models from Human Preferences"), as verl: the coefficient moves
    the observed KL toward ``kl_target`` over ``kl_horizon`` samples,

        e = clip(KL / target - 1, -0.2, 0.2),    beta <- beta * (1 + e * n_steps / horizon)

    with ``n_steps`` the samples of the batch."""

    def __init__(self, init_kl_coef: float, kl_target: float, kl_horizon: int):
        if kl_target <= 0 or kl_horizon <= 0:
            raise ValueError(f"kl_target and kl_horizon must be > 0, got {kl_target}, {kl_horizon}")
        self.value, self.target, self.horizon = init_kl_coef, kl_target, kl_horizon

    def update(self, current_kl: float, n_steps: int) -> None:
        if not math.isfinite(current_kl):
            return  # a non-finite KL says nothing about the coefficient; the step's own checks report it
        error = min(max(current_kl / self.target - 1.0, -0.2), 0.2)
        self.value *= 1.0 + error * n_steps / self.horizon


def kl_controller(kind: str, *, init_kl_coef: float, kl_target: float | None = None,
                  kl_horizon: int | None = None) -> FixedKLController | AdaptiveKLController:
    if kind == "fixed":
        return FixedKLController(init_kl_coef)
    if kind == "adaptive":
        return AdaptiveKLController(init_kl_coef, kl_target, kl_horizon)
    raise ValueError(f"unknown kl_ctrl_type {kind!r}; valid: {list(KL_CONTROLLERS)}")
