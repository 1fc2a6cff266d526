"""Rollout correction (verl's `algorithm.rollout_correction`, its names and formulas as of its 97eac9048): the samples
come from the rollout engine's policy (vLLM, maybe bf16, maybe a version behind), the update's ratio is against the
old policy (Megatron's). With r_t = pi_old(y_t) / pi_rollout(y_t) per token (from log-probs, exponents clamped to
+-20 where verl clamps them):

* importance sampling (`rollout_is`): each token's PPO loss is weighted by a truncated weight w = min(rho, threshold),
  detached: rho = r_t (`token`, biased, low variance) or prod_t r_t (`sequence`, unbiased, high variance);
  `rollout_is_batch_normalize` rescales the weights to mean 1 over the batch;
* rejection (`rollout_rs`): verl's k1 / k2 / k3 options per token or per sequence (algorithms/rollout_rejection.py);
  the rejected tokens leave the loss mask;
* the veto (`rollout_token_veto_threshold`, verl's before 97eac9048, kept with its meaning): a sequence with any token
  whose r_t is below it leaves the loss mask.

Metrics, `rollout_corr/` + verl's names: the IS weights' mean, max, min, std, effective sample size, the share above
and below the thresholds and their per-sequence statistics, the rejection's (rollout_rejection.py), the veto's, and
the divergence between the two policies (KL(pi_rollout || pi_old) by k1 and k3, perplexities, chi-square per token
and per sequence). Every statistic is over the batch's sampled tokens (its loss mask).
"""
from __future__ import annotations

import math
from typing import Optional

import torch
from torch import Tensor

from mindspeed_rl.algorithms.grpo import masked_mean
from mindspeed_rl.algorithms.rollout_rejection import SAFETY_BOUND, rejection_mask
from mindspeed_rl.config.rollout_correction import RolloutCorrectionConfig


def rollout_mismatch(rollout_logprobs: Tensor, old_logprobs: Tensor, mask: Tensor,
                     tokens: Optional[float] = None) -> dict[str, float]:
    """|vLLM log-prob - Megatron log-prob| over the sampled tokens: max and mean. The mean is over `tokens` (default:
    this mask's); an update's micro-batch passes its mini-batch's, so that the micro-batches' means add up (their
    max reduced by max: engines/megatron_engine.MAX_REDUCED_STATS). After an exact weight push the two differ only by
    the arithmetic of the two engines (fp32: ~1e-6; bf16: see docs/bf16_logprobs.md)."""
    diff = (rollout_logprobs.to(old_logprobs.dtype) - old_logprobs).abs() * mask
    count = mask.sum().clamp(min=1) if tokens is None else tokens
    return {"rollout/logprob_max_abs_diff": diff.max().item() if diff.numel() else 0.0,
            "rollout/logprob_mean_abs_diff": (diff.sum() / count).item()}


def _ratios(log_ratio: Tensor, mask: Tensor, level: str) -> tuple[Tensor, Tensor]:
    """(per-token weights broadcast over the response, the unclamped log of each unit: token or sequence)."""
    if level == "token":
        return log_ratio.clamp(-SAFETY_BOUND, SAFETY_BOUND).exp(), log_ratio
    per_sequence = (log_ratio * mask).sum(-1, keepdim=True)
    return per_sequence.clamp(-SAFETY_BOUND, SAFETY_BOUND).exp().expand_as(log_ratio), per_sequence


def _is_metrics(weights: Tensor, log_units: Tensor, mask: Tensor, level: str, threshold: float) -> dict[str, float]:
    """verl's compute_is_metrics, of the weights before truncation."""
    valid, lower, upper = mask.bool(), 1.0 / threshold, threshold
    out = {"rollout_is_mean": masked_mean(weights, mask).item()}
    if level == "token":
        out["rollout_is_max"] = weights[valid].max().item()
        out["rollout_is_min"] = weights[valid].min().item()
        high, low = masked_mean((weights > upper).float(), mask), masked_mean((weights < lower).float(), mask)
    else:
        out["rollout_is_max"] = math.exp(min(log_units.max().item(), SAFETY_BOUND))
        out["rollout_is_min"] = math.exp(log_units.min().item())
        high, low = (log_units > math.log(upper)).float().mean(), (log_units < math.log(lower)).float().mean()
    out["rollout_is_ratio_fraction_high"], out["rollout_is_ratio_fraction_low"] = high.item(), low.item()
    bounded = weights.clamp(lower, upper)
    mean = masked_mean(bounded, mask)
    out["rollout_is_std"] = ((masked_mean(bounded.square(), mask) - mean.square()).clamp(min=0).sqrt().item()
                             if mask.sum() > 1 else 0.0)
    out["rollout_is_eff_sample_size"] = 1.0 / masked_mean((bounded / (mean + 1e-8)).square(), mask).item()
    per_sequence = masked_mean(weights, mask, -1)
    out |= {"rollout_is_seq_mean": per_sequence.mean().item(),
            "rollout_is_seq_std": per_sequence.std().item() if per_sequence.numel() > 1 else 0.0,
            "rollout_is_seq_max": per_sequence.max().item(), "rollout_is_seq_min": per_sequence.min().item(),
            "rollout_is_seq_max_deviation": (per_sequence - 1.0).abs().max().item(),
            "rollout_is_seq_fraction_high": (per_sequence > upper).float().mean().item(),
            "rollout_is_seq_fraction_low": (per_sequence < lower).float().mean().item()}
    return out


def importance_weights(log_ratio: Tensor, mask: Tensor, config: RolloutCorrectionConfig) -> tuple[Tensor, dict]:
    weights, log_units = _ratios(log_ratio, mask, config.rollout_is)
    weights = weights * mask
    threshold = config.rollout_is_threshold
    metrics = _is_metrics(weights, log_units, mask, config.rollout_is, threshold)
    weights = weights.clamp(max=threshold).detach()
    if config.rollout_is_batch_normalize:
        unit_mask = mask if config.rollout_is == "token" else (mask.sum(-1, keepdim=True) > 0).to(mask.dtype)
        unit_weights = weights if config.rollout_is == "token" else masked_mean(weights, mask, -1)[:, None]
        factor = masked_mean(unit_weights, unit_mask)
        if factor > 1e-8:
            weights = weights / factor
        metrics["rollout_is_batch_norm_factor"] = factor.item() if factor > 1e-8 else 1.0
    return weights, metrics


def token_veto(log_ratio: Tensor, mask: Tensor, threshold: float) -> tuple[Tensor, dict[str, float]]:
    """The veto verl had before 97eac9048 (`rollout_token_veto_threshold`): [B, 1] 0 for a sequence with a sampled
    token whose r_t < threshold, 1 otherwise; its metrics under verl's old names."""
    bad_tokens = (log_ratio < math.log(threshold)) & mask.bool()
    vetoed = bad_tokens.any(-1, keepdim=True)
    return (~vetoed).to(mask.dtype), {"rollout_is_veto_fraction": vetoed.float().mean().item(),
                                      "rollout_is_catastrophic_token_fraction":
                                          masked_mean(bad_tokens.float(), mask).item()}


def divergence_metrics(old_logprobs: Tensor, rollout_logprobs: Tensor, mask: Tensor) -> dict[str, float]:
    """How far the rollout's policy is from the old one (verl's compute_offpolicy_metrics; k3_kl unclamped, as
    there)."""
    log_ratio = old_logprobs - rollout_logprobs
    old_seq, rollout_seq = masked_mean(old_logprobs, mask, -1), masked_mean(rollout_logprobs, mask, -1)
    log_ppl_diff = rollout_seq - old_seq
    rho = log_ratio.clamp(-SAFETY_BOUND, SAFETY_BOUND).exp()
    sequence_log_ratio = (log_ratio * mask).sum(-1).clamp(-SAFETY_BOUND, SAFETY_BOUND)
    return {"training_ppl": (-old_seq).exp().mean().item(), "training_log_ppl": (-old_seq).mean().item(),
            "kl": masked_mean(rollout_logprobs - old_logprobs, mask).item(),
            "k3_kl": masked_mean(log_ratio.exp() - log_ratio - 1, mask).item(),
            "rollout_ppl": (-rollout_seq).exp().mean().item(), "rollout_log_ppl": (-rollout_seq).mean().item(),
            "log_ppl_diff": log_ppl_diff.mean().item(), "log_ppl_abs_diff": log_ppl_diff.abs().mean().item(),
            "log_ppl_diff_max": log_ppl_diff.max().item(), "log_ppl_diff_min": log_ppl_diff.min().item(),
            "ppl_ratio": log_ppl_diff.exp().mean().item(),
            "chi2_token": (masked_mean(rho.square(), mask) - 1.0).item(),
            "chi2_seq": ((2.0 * sequence_log_ratio).exp().mean() - 1.0).item()}


def rollout_correction(old_logprobs: Tensor, rollout_logprobs: Tensor, mask: Tensor,
                       config: RolloutCorrectionConfig) -> tuple[Optional[Tensor], Tensor, dict[str, float]]:
    """(IS weights or None, the loss mask less the rejected tokens, `rollout_corr/` metrics) of a batch."""
    mask = mask.to(torch.float32)
    if not mask.bool().any():
        raise ValueError("rollout correction needs at least one sampled token")
    log_ratio = (old_logprobs - rollout_logprobs).to(torch.float32)
    weights, kept, metrics = None, mask.clone(), {}
    if config.rollout_is is not None:
        weights, is_metrics = importance_weights(log_ratio, mask, config)
        metrics |= is_metrics
    if config.rollout_rs is not None:
        kept, rs_metrics = rejection_mask(log_ratio, mask, config.rs_options, config.rollout_rs_threshold)
        metrics |= rs_metrics
    if config.rollout_token_veto_threshold is not None:
        kept_sequences, veto_metrics = token_veto(log_ratio, mask, config.rollout_token_veto_threshold)
        kept, metrics = kept * kept_sequences, metrics | veto_metrics
    metrics |= divergence_metrics(old_logprobs.float(), rollout_logprobs.float(), mask)
    return weights, kept, {f"rollout_corr/{key}": value for key, value in metrics.items()}
