"""Per-iteration metrics under MindSpeed-RL's names, computed from the batch and the phase timings.

Pure functions of tensors and floats: the loop collects, these name and derive.
"""
from __future__ import annotations

import torch

# MindSpeed-RL's timing names, each made of the phases our workers time (ROLL's per-RPC timings).
RESHARDING_TO_INFER_PARTS = ("timing/resharding_enter_infer", "timing/resharding_exit_infer")
RESHARDING_TO_TRAIN_PARTS = ("timing/onload_forward", "timing/onload_train")


def length_stats(name: str, lengths: torch.Tensor) -> dict[str, float]:
    """`{name}/mean`, `/min`, `/max` of integer lengths (MindSpeed-RL's response_length/*, prompt_length/*)."""
    values = lengths.to(torch.float64)
    return {f"{name}/mean": values.mean().item(), f"{name}/min": values.min().item(),
            f"{name}/max": values.max().item()}


def throughput(*, prompt_lengths: torch.Tensor, response_lengths: torch.Tensor, world_size: int,
               seconds_all: float, seconds_rollout: float, seconds_update: float,
               use_max_lengths: bool) -> dict[str, float]:
    """Tokens per second per device, MindSpeed-RL's formula (utils.compute_tps):
    `(response_len + prompt_len) * samples / world_size / seconds`, lengths as means, or as maxima with
    `rl_config.log_max_throughput` (which overstates: padding is not work)."""
    reduce = torch.max if use_max_lengths else torch.mean
    tokens_per_sample = (reduce(prompt_lengths.to(torch.float64)) + reduce(response_lengths.to(torch.float64))).item()
    tokens_per_device = tokens_per_sample * len(prompt_lengths) / world_size

    def per_second(seconds: float) -> float:
        return tokens_per_device / seconds if seconds > 0 else 0.0

    return {"e2e_tps": per_second(seconds_all), "vllm_tps": per_second(seconds_rollout),
            "update_tps": per_second(seconds_update)}


def phase_timings(metrics: dict[str, float]) -> dict[str, float]:
    """MindSpeed-RL's `timing/update`, `timing/resharding_to_infer`, `timing/resharding_to_train` from ours."""
    return {
        "timing/update": metrics.get("timing/update/total", 0.0),
        "timing/resharding_to_infer": sum(metrics.get(key, 0.0) for key in RESHARDING_TO_INFER_PARTS),
        "timing/resharding_to_train": sum(metrics.get(key, 0.0) for key in RESHARDING_TO_TRAIN_PARTS),
    }


def reward_metrics(total: torch.Tensor, per_verifier: dict[str, torch.Tensor], accuracy: float) -> dict[str, float]:
    metrics = {"reward/mean": total.mean().item(), "reward/accuracy": accuracy}
    for name, scores in per_verifier.items():
        metrics[f"{name}_rewards/mean"] = scores.mean().item()
    return metrics


def rollout_mismatch(rollout_logprobs: torch.Tensor, old_logprobs: torch.Tensor,
                     response_mask: torch.Tensor) -> dict[str, float]:
    """|vLLM log-prob - Megatron log-prob| over sampled tokens: max and mean. After an exact weight push
    the two differ only by the arithmetic of the two engines (fp32: ~1e-6; bf16: see docs/bf16_logprobs.md)."""
    diff = (rollout_logprobs - old_logprobs).abs() * response_mask
    tokens = response_mask.sum().clamp(min=1)
    return {"rollout/logprob_max_abs_diff": diff.max().item(),
            "rollout/logprob_mean_abs_diff": (diff.sum() / tokens).item()}
