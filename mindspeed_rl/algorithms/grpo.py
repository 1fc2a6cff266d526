"""GRPO as pure tensor functions: advantages, KL estimators, PPO-clip loss, entropy, aggregation.

Shapes: per-token tensors are ``[batch, response_len]`` and padded; ``response_mask`` (bool or
0/1 float, same shape) marks the valid response tokens. Nothing here knows about devices,
process groups or micro-batching; the trainer passes ``loss_scale_denominator`` when it splits a
mini-batch into micro-batches (see :func:`grpo_loss`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
from torch import Tensor

# verl's names (core_algos.agg_loss; formulas: aggregate_loss) and the KL estimators' (kl_penalty)
from mindspeed_rl.config.rl import KL_PENALTIES as KL_PENALTY_KINDS
from mindspeed_rl.config.rl import LOSS_AGG_MODES

_KL_ALIASES = {"k1": "kl", "k2": "mse", "k3": "low_var_kl"}  # verl's names of the same estimators

# exp() of a log-ratio beyond this overflows float32 long before it carries information.
_LOG_RATIO_CLAMP = 20.0
# Bound of the k3 estimator, as in MindSpeed-RL / verl: one outlier token must not dominate.
_LOW_VAR_KL_CLAMP = 10.0


def group_normalized_advantages(
    rewards: Tensor, n_samples_per_prompt: int, eps: float = 1e-6, *, normalize_by_std: bool = True
) -> Tensor:
    """Per-sample GRPO advantage ``(r - mean_g) / (std_g + eps)`` over each prompt's group.

    ``normalize_by_std=False`` is Dr. GRPO (Liu et al. 2025, "Understanding R1-Zero-Like Training: A Critical
    Perspective"; verl's ``norm_adv_by_std_in_grpo: false``): ``r - mean_g``, so that groups of nearly equal
    rewards (too easy or too hard prompts) are not weighted up.

    The ``n_samples_per_prompt`` samples of one prompt are contiguous in ``rewards``; a group of one sample
    takes mean 0 and std 1, as verl does (its advantage is its reward). std is
    torch's unbiased default; the statistics are computed in float64 (small groups of nearly
    equal rewards lose precision in float32) and the result is float32.
    """
    grouped = grouped_rewards(rewards, n_samples_per_prompt)
    if n_samples_per_prompt == 1:  # a group of one has no baseline: verl's mean 0 and std 1
        mean, std = torch.zeros_like(grouped), torch.ones_like(grouped)
    else:
        mean, std = grouped.mean(dim=1, keepdim=True), grouped.std(dim=1, keepdim=True)
    centered = grouped - mean
    if normalize_by_std:
        centered = centered / (std + eps)
    return centered.reshape(-1).to(torch.float32)


def grouped_rewards(rewards: Tensor, n_samples_per_prompt: int) -> Tensor:
    """``rewards`` [num_samples] as float64 [prompts, n_samples_per_prompt] (each prompt's samples contiguous),
    for the estimators whose baseline comes from the other samples of the prompt."""
    if rewards.dim() != 1:
        raise ValueError(f"rewards must be 1-D [num_samples], got shape {tuple(rewards.shape)}")
    if n_samples_per_prompt < 1:
        raise ValueError(f"n_samples_per_prompt must be >= 1, got {n_samples_per_prompt}")
    num_samples = rewards.numel()
    if num_samples % n_samples_per_prompt != 0:
        raise ValueError(
            f"num_samples={num_samples} is not a multiple of "
            f"n_samples_per_prompt={n_samples_per_prompt}"
        )
    return rewards.to(torch.float64).view(-1, n_samples_per_prompt)


def kl_penalty(logprobs: Tensor, ref_logprobs: Tensor, kind: str) -> Tensor:
    """Per-token KL estimate between the policy and the reference, by estimator ``kind`` (verl's names too:
    k1 = kl, k2 = mse, k3 = low_var_kl).

    A ``+`` kind (``k3+``, verl's straight-through form) has the base estimator's value and k2's gradient: k1's
    and k3's expectation is the KL, but their expected gradient is not the KL's gradient, while k2's is.
    """
    if kind not in KL_PENALTY_KINDS:
        raise ValueError(f"unknown kl_penalty {kind!r}; valid kinds: {list(KL_PENALTY_KINDS)}")
    base = kind.removesuffix("+")
    value = _kl_estimate(logprobs - ref_logprobs, _KL_ALIASES.get(base, base))
    if not kind.endswith("+"):
        return value
    k2 = 0.5 * (logprobs - ref_logprobs).square()
    return k2 - k2.detach() + value.detach()


def _kl_estimate(log_ratio: Tensor, kind: str) -> Tensor:
    if kind == "kl":
        return log_ratio
    if kind == "abs":
        return log_ratio.abs()
    if kind == "mse":
        return 0.5 * log_ratio.square()
    # low_var_kl (Schulman's k3): unbiased, always >= 0, low variance.
    ref_minus_logp = (-log_ratio).clamp(-_LOG_RATIO_CLAMP, _LOG_RATIO_CLAMP)
    k3 = ref_minus_logp.exp() - ref_minus_logp - 1.0
    return k3.clamp(-_LOW_VAR_KL_CLAMP, _LOW_VAR_KL_CLAMP)


def masked_sum(values: Tensor, mask: Tensor, dim: Optional[int] = None) -> Tensor:
    """Sum of ``values`` where ``mask`` is set; padded positions never leak (even inf/nan)."""
    kept = torch.where(mask.bool(), values, torch.zeros_like(values))
    return kept.sum() if dim is None else kept.sum(dim=dim)


def masked_mean(values: Tensor, mask: Tensor, dim: Optional[int] = None) -> Tensor:
    """Mean of ``values`` over the valid positions; 0 where no position is valid (not nan)."""
    count = mask.bool().sum() if dim is None else mask.bool().sum(dim=dim)
    return masked_sum(values, mask, dim) / count.clamp(min=1).to(values.dtype)


def ppo_clip_policy_loss(
    logprobs: Tensor,
    old_logprobs: Tensor,
    advantages: Tensor,
    response_mask: Tensor,
    clip_ratio: float,
    clip_ratio_high: Optional[float] = None,
    clip_ratio_c: Optional[float] = None,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Per-token PPO-clip loss ``max(-A*ratio, -A*clip(ratio, 1-eps_low, 1+eps_high))``.

    ``clip_ratio`` is eps_low and, unless ``clip_ratio_high`` is given, eps_high too; DAPO's clip-higher
    (Yu et al. 2025) raises eps_high alone, so low-probability tokens of good samples can grow.
    ``clip_ratio_c`` turns on dual-clip PPO (Ye et al. 2020, verl's formula): where A < 0 the loss is at most
    ``-A * clip_ratio_c``, so a ratio far above 1 cannot grow it without bound.
    ``advantages`` is per token ``[batch, len]`` or per sequence ``[batch]`` (broadcast over
    the response). Returns ``(loss, clipfrac, approx_kl, clipfrac_lower)`` per token, zero at padded positions:
    ``clipfrac`` is 1 where the clipped branch was taken, ``approx_kl = old - logp``, ``clipfrac_lower`` is 1
    where the dual clip's bound was taken (always 0 without ``clip_ratio_c``).
    """
    clip_ratio_high = clip_ratio if clip_ratio_high is None else clip_ratio_high
    if clip_ratio <= 0 or clip_ratio_high <= 0:
        raise ValueError(f"clip ratios must be > 0, got {clip_ratio} and {clip_ratio_high}")
    if advantages.dim() == logprobs.dim() - 1:
        advantages = advantages.unsqueeze(-1)
    log_ratio = (logprobs - old_logprobs).clamp(-_LOG_RATIO_CLAMP, _LOG_RATIO_CLAMP)
    ratio = log_ratio.exp()
    unclipped = -advantages * ratio
    clipped = -advantages * ratio.clamp(1.0 - clip_ratio, 1.0 + clip_ratio_high)
    valid = response_mask.bool()
    zeros = torch.zeros_like(logprobs)
    loss = torch.maximum(unclipped, clipped)
    lower = torch.zeros_like(valid)
    if clip_ratio_c is not None:
        bound = -advantages * clip_ratio_c
        lower = (advantages < 0) & (loss > bound)
        loss = torch.where(advantages < 0, torch.minimum(loss, bound), loss)
    loss = torch.where(valid, loss, zeros)
    clipfrac = torch.where(valid, (clipped > unclipped).to(logprobs.dtype), zeros)
    approx_kl = torch.where(valid, old_logprobs - logprobs, zeros)
    clipfrac_lower = torch.where(valid, lower.to(logprobs.dtype), zeros)
    return loss, clipfrac, approx_kl, clipfrac_lower


def entropy_from_logits(logits: Tensor) -> Tensor:
    """Per-position entropy of ``softmax(logits)`` over the last dim: ``lse(z) - E_p[z]``.

    Written with logsumexp so large logits neither overflow nor produce ``0 * -inf``.
    """
    log_normalizer = torch.logsumexp(logits, dim=-1)
    probs = torch.softmax(logits, dim=-1)
    return log_normalizer - (probs * logits).sum(dim=-1)


@dataclass(kw_only=True, frozen=True)
class GRPOLossConfig:
    """GRPO actor-loss knobs (MindSpeed-RL ``rl_config`` names and defaults)."""

    clip_ratio: float = 0.2  # eps_low, and eps_high unless clip_ratio_high is set
    clip_ratio_high: Optional[float] = None
    kl_penalty: str = "low_var_kl"
    kl_coef: float = 0.001
    entropy_coeff: float = 0.0
    loss_agg_mode: str = "token-mean"  # LOSS_AGG_MODES
    # seq-mean-token-sum-norm's constant length (Dr. GRPO: the maximum response length).
    norm_length: Optional[int] = None
    clip_ratio_c: Optional[float] = None  # dual-clip PPO's bound (verl); None: off

    def __post_init__(self) -> None:
        if self.clip_ratio <= 0 or (self.clip_ratio_high is not None and self.clip_ratio_high <= 0):
            raise ValueError(f"clip ratios must be > 0, got {self.clip_ratio} and {self.clip_ratio_high}")
        if self.clip_ratio_c is not None and not self.clip_ratio_c > 1.0:
            raise ValueError(f"clip_ratio_c must be > 1, got {self.clip_ratio_c}")
        if self.loss_agg_mode not in LOSS_AGG_MODES:
            raise ValueError(f"unknown loss_agg_mode {self.loss_agg_mode!r}; valid: {list(LOSS_AGG_MODES)}")
        if self.loss_agg_mode == "seq-mean-token-sum-norm" and not (self.norm_length or 0) > 0:
            raise ValueError("seq-mean-token-sum-norm needs norm_length > 0 (the maximum response length)")
        if self.kl_penalty not in KL_PENALTY_KINDS:
            raise ValueError(
                f"unknown kl_penalty {self.kl_penalty!r}; valid kinds: {list(KL_PENALTY_KINDS)}"
            )
        if self.kl_coef < 0:
            raise ValueError(f"kl_coef must be >= 0, got {self.kl_coef}")
        if self.entropy_coeff < 0:
            raise ValueError(f"entropy_coeff must be >= 0, got {self.entropy_coeff}")


def count_loss_units(response_mask: Tensor, loss_agg_mode: str, norm_length: Optional[int] = None) -> float:
    """The loss's denominator over a whole mini-batch: its valid tokens (token-mean), its sequences with a valid
    token (the seq-mean modes), times `norm_length` for seq-mean-token-sum-norm.

    A trainer splitting a mini-batch into micro-batches calls this on the whole mini-batch's mask
    and passes the result as ``loss_scale_denominator`` to every micro-batch's :func:`grpo_loss`.
    """
    valid = response_mask.bool()
    if loss_agg_mode == "token-mean":
        return float(valid.sum().item())
    sequences = float(valid.any(dim=-1).sum().item())
    return sequences * norm_length if loss_agg_mode == "seq-mean-token-sum-norm" else sequences


def aggregate_loss(values: Tensor, response_mask: Tensor, loss_agg_mode: str, denominator: float) -> Tensor:
    """One number from per-token values ``x[i, t]`` (mask ``m``), with the denominator of the whole mini-batch:

    token-mean               sum_i sum_t m x / sum_i sum_t m           (every token weighs alike; DAPO)
    seq-mean-token-mean      sum_i (sum_t m x / sum_t m) / N_seq        (every sequence weighs alike; GRPO)
    seq-mean-token-sum       sum_i sum_t m x / N_seq
    seq-mean-token-sum-norm  sum_i sum_t m x / (N_seq L)               (L constant: Dr. GRPO, no length bias)
    """
    if loss_agg_mode == "seq-mean-token-mean":
        return masked_mean(values, response_mask, dim=-1).sum() / denominator
    return masked_sum(values, response_mask) / denominator


def grpo_loss(
    *,
    logprobs: Tensor,
    old_logprobs: Tensor,
    ref_logprobs: Optional[Tensor],
    advantages: Tensor,
    response_mask: Tensor,
    entropy: Optional[Tensor],
    config: GRPOLossConfig,
    loss_scale_denominator: Optional[float] = None,
    mini_batch_tokens: Optional[float] = None,
    is_weights: Optional[Tensor] = None,
) -> tuple[Tensor, dict[str, float]]:
    """GRPO actor loss ``pg + kl_coef * kl - entropy_coeff * entropy`` and its logged stats.

    Every term is aggregated the same way (``config.loss_agg_mode``), divided by
    ``loss_scale_denominator``, which defaults to :func:`count_loss_units` of this call. Passing
    the whole mini-batch's count to each micro-batch makes the sum of micro-batch losses (and of
    each stat) exactly the mini-batch mean. The clip fractions and ``ppo_kl`` are token means whatever the loss
    mode (verl's ``masked_mean``: a fraction stays a fraction), over ``mini_batch_tokens`` (default: this call's
    valid tokens). ``is_weights`` (rollout correction's truncated importance weights, detached) weigh each token's
    policy loss, as verl's ``pg_losses * rollout_is_weights``. ``ref_logprobs`` may be None only when
    ``kl_coef == 0``; ``entropy`` may be None only when ``entropy_coeff == 0``.
    """
    if ref_logprobs is None and config.kl_coef != 0:
        raise ValueError(f"ref_logprobs is required when kl_coef != 0 (kl_coef={config.kl_coef})")
    if entropy is None and config.entropy_coeff != 0:
        raise ValueError(
            f"entropy is required when entropy_coeff != 0 (entropy_coeff={config.entropy_coeff})"
        )
    denominator = _resolve_denominator(response_mask, config, loss_scale_denominator)

    def aggregate(values: Tensor) -> Tensor:
        return aggregate_loss(values, response_mask, config.loss_agg_mode, denominator)

    pg_tokens, clipfrac_tokens, ppo_kl_tokens, clipfrac_lower_tokens = ppo_clip_policy_loss(
        logprobs, old_logprobs, advantages, response_mask, config.clip_ratio, config.clip_ratio_high,
        config.clip_ratio_c,
    )
    if is_weights is not None:
        pg_tokens = pg_tokens * is_weights
    pg_loss = aggregate(pg_tokens)
    zero = pg_loss.new_zeros(())
    kl_loss = (
        zero if ref_logprobs is None
        else aggregate(kl_penalty(logprobs, ref_logprobs, config.kl_penalty))
    )
    entropy_mean = zero if entropy is None else aggregate(entropy)
    loss = pg_loss + config.kl_coef * kl_loss - config.entropy_coeff * entropy_mean
    stats = {"actor/pg_loss": pg_loss.item(), "actor/kl_loss": kl_loss.item(), "actor/entropy": entropy_mean.item()}
    fractions = {"actor/pg_clipfrac": clipfrac_tokens, "actor/ppo_kl": ppo_kl_tokens}
    if config.clip_ratio_c is not None:
        fractions["actor/pg_clipfrac_lower"] = clipfrac_lower_tokens
    return loss, stats | _token_means(fractions, response_mask, mini_batch_tokens)


def _token_means(values: dict[str, Tensor], response_mask: Tensor, tokens: Optional[float]) -> dict[str, float]:
    """Each value's sum over the valid tokens over `tokens` (the mini-batch's; default: these valid tokens)."""
    count = float(max(response_mask.bool().sum().item(), 1)) if tokens is None else float(tokens)
    return {key: (masked_sum(tokens_of, response_mask) / count).item() for key, tokens_of in values.items()}


def _resolve_denominator(
    response_mask: Tensor, config: GRPOLossConfig, loss_scale_denominator: Optional[float]
) -> float:
    if loss_scale_denominator is None:
        # An all-padding micro-batch contributes 0, not nan.
        return float(max(count_loss_units(response_mask, config.loss_agg_mode, config.norm_length), 1))
    if loss_scale_denominator <= 0:
        raise ValueError(f"loss_scale_denominator must be > 0, got {loss_scale_denominator}")
    return float(loss_scale_denominator)
