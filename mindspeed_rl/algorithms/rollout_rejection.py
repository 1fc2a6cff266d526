"""Rollout-correction rejection (`rl_config.rollout_correction.rollout_rs`), verl's compute_rollout_rejection_mask
and compute_rs_metrics as of its 97eac9048 (2026-01-14). With log r_t = log pi_old(y_t) - log pi_rollout(y_t),
clamped to +-20 (verl's SAFETY_BOUND), three per-token divergence estimators:

    k1 = -log r_t,    k2 = 0.5 (log r_t)^2,    k3 = r_t - 1 - log r_t

An option `<level>_k<n>` rejects a token (`token_`) or a whole sequence by the sum (`seq_sum_`), the mean
(`seq_mean_`) or the max (`seq_max_`) of k<n> over its sampled tokens: k1 outside [log lower, log upper] (a
"lower_upper" threshold: the kept ratios are 1 / upper <= r <= 1 / lower, the product of the sequence's for
seq_sum, its geometric mean for seq_mean), k2 / k3 above the upper bound. A comma list applies every option: a token
stays only if it passes them all.

Metrics (`rollout_corr/` + verl's names), per option `rollout_rs_<option>_`: the statistic's mean, max, min, std
(clamped to the bounds), fraction_high / fraction_low, the per-sequence values' seq_mean, seq_std, seq_max, seq_min,
seq_max_deviation, seq_fraction_high (/ low for k1), and masked_fraction / seq_masked_fraction; for all options
together rollout_rs_masked_fraction (tokens) and rollout_rs_seq_masked_fraction (sequences with one rejected token).
"""
from __future__ import annotations

import math
from typing import Optional

import torch
from torch import Tensor

from mindspeed_rl.algorithms.grpo import masked_mean
from mindspeed_rl.config.rollout_correction import rs_thresholds

SAFETY_BOUND = 20.0  # |log ratio| clamp before exp, as verl's


def token_estimators(log_ratio: Tensor) -> dict[str, Tensor]:
    """verl's token_k1, token_k2, token_k3 of the clamped log ratio, by estimator name."""
    safe = log_ratio.clamp(-SAFETY_BOUND, SAFETY_BOUND)
    return {"k1": -safe, "k2": 0.5 * safe.square(), "k3": safe.exp() - 1.0 - safe}


def option_statistic(option: str, estimators: dict[str, Tensor], mask: Tensor) -> tuple[Tensor, Optional[Tensor]]:
    """(the option's statistic per token [B, R], its per-sequence value [B] or None at token level)."""
    values = estimators[option.rsplit("_", 1)[1]]
    if option.startswith("token_"):
        return values, None
    if option.startswith("seq_sum_"):
        per_sequence = (torch.where(mask.bool(), values, 0.0) * mask).sum(-1)
    elif option.startswith("seq_mean_"):
        per_sequence = masked_mean(values, mask, -1)
    else:  # seq_max_: 0 for a sequence with no sampled token
        best = values.masked_fill(~mask.bool(), float("-inf")).max(-1).values
        per_sequence = torch.where(best == float("-inf"), torch.zeros_like(best), best)
    return per_sequence[:, None].expand_as(mask), per_sequence


def _kept(statistic: Tensor, lower_log: Optional[float], upper: float) -> Tensor:
    inside = statistic <= upper
    return inside if lower_log is None else inside & (statistic >= lower_log)


def _option_metrics(prefix: str, statistic: Tensor, per_sequence: Optional[Tensor], mask: Tensor,
                    lower: Optional[float], upper: float) -> dict[str, float]:
    """verl's compute_rs_metrics (`lower` None: no lower bound, k2 / k3; in log space for k1)."""
    valid, rows = mask.bool(), mask.sum(-1) > 0
    by_sequence = (masked_mean(statistic, mask, -1) if per_sequence is None else per_sequence)[rows]
    out = {f"{prefix}_mean": masked_mean(statistic, mask).item()}
    if per_sequence is not None and by_sequence.numel():
        out[f"{prefix}_max"], out[f"{prefix}_min"] = by_sequence.max().item(), by_sequence.min().item()
        high = (by_sequence > upper).float().mean().item()
        low = (by_sequence < lower).float().mean().item() if lower is not None else 0.0
    else:
        out[f"{prefix}_max"] = statistic.masked_fill(~valid, float("-inf")).max().item()
        out[f"{prefix}_min"] = statistic.masked_fill(~valid, float("inf")).min().item()
        high = masked_mean((statistic > upper).float(), mask).item()
        low = masked_mean((statistic < lower).float(), mask).item() if lower is not None else 0.0
    out[f"{prefix}_fraction_high"], out[f"{prefix}_fraction_low"] = high, low
    out[f"{prefix}_std"] = 0.0
    if mask.sum() > 1:
        bounded = statistic.clamp(min=0.0 if lower is None else lower, max=upper)
        variance = masked_mean(bounded.square(), mask) - masked_mean(bounded, mask).square()
        out[f"{prefix}_std"] = variance.clamp(min=0.0).sqrt().item()
    return out | _sequence_metrics(prefix, by_sequence, lower, upper)


def _sequence_metrics(prefix: str, by_sequence: Tensor, lower: Optional[float], upper: float) -> dict[str, float]:
    if not by_sequence.numel():
        names = ("seq_mean", "seq_std", "seq_max", "seq_min", "seq_max_deviation", "seq_fraction_high",
                 "seq_fraction_low")
        return {f"{prefix}_{name}": 0.0 for name in names}
    out = {f"{prefix}_seq_mean": by_sequence.mean().item(),
           f"{prefix}_seq_std": by_sequence.std().item() if by_sequence.numel() > 1 else 0.0,
           f"{prefix}_seq_max": by_sequence.max().item(), f"{prefix}_seq_min": by_sequence.min().item(),
           f"{prefix}_seq_max_deviation": by_sequence.abs().max().item(),
           f"{prefix}_seq_fraction_high": (by_sequence > upper).float().mean().item()}
    if lower is not None:
        out[f"{prefix}_seq_fraction_low"] = (by_sequence < lower).float().mean().item()
    return out


def _rejected_sequences(keep: Tensor, mask: Tensor) -> Tensor:
    """[B] whether a sequence has a sampled token that `keep` drops."""
    return (~keep.bool() & mask.bool()).any(-1)


def rejection_mask(log_ratio: Tensor, mask: Tensor, options: list[str], threshold) -> tuple[Tensor, dict]:
    """(`mask` less the tokens some option rejects, the metrics), verl's compute_rollout_rejection_mask:
    `options` rollout_rs's (config.rs_options), `threshold` rollout_rs_threshold's spec."""
    bounds = rs_thresholds(options, threshold)
    estimators, rows = token_estimators(log_ratio), mask.sum(-1) > 0
    combined, metrics = torch.ones_like(mask), {}
    for option in options:
        lower, upper = bounds[option]
        k1 = option.endswith("k1")
        lower_log, upper_cut = (math.log(lower), math.log(upper)) if k1 else (None, upper)
        statistic, per_sequence = option_statistic(option, estimators, mask)
        keep = _kept(statistic, lower_log, upper_cut).to(mask.dtype)
        combined = combined * keep
        prefix = f"rollout_rs_{option}"
        metrics |= _option_metrics(prefix, statistic, per_sequence, mask, lower_log, upper_cut)
        metrics[f"{prefix}_masked_fraction"] = masked_mean(1 - keep, mask).item()
        rejected = _rejected_sequences(keep, mask)[rows]
        metrics[f"{prefix}_seq_masked_fraction"] = rejected.float().mean().item() if rejected.numel() else 0.0
    metrics["rollout_rs_masked_fraction"] = masked_mean(1 - combined, mask).item()
    metrics["rollout_rs_seq_masked_fraction"] = _rejected_sequences(combined, mask).float().mean().item()
    return mask * combined, metrics
