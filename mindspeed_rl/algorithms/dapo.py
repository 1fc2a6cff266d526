"""DAPO's reward shaping (Yu et al. 2025, "DAPO: An Open-Source LLM Reinforcement Learning System at Scale"):
the soft overlong punishment. Clip-higher and the token-level loss are the PPO loss's options
(algorithms/grpo.py: `clip_ratio_high`, `loss_agg_mode`)."""
from __future__ import annotations

import torch


def overlong_penalty(response_lengths: torch.Tensor, *, max_length: int, buffer: int, factor: float) -> torch.Tensor:
    """Per-sample reward added for length, float32 [n]: 0 up to `max_length - buffer` tokens, then falling
    linearly to `-factor` at `max_length`, and `-factor` beyond (MindSpeed-RL's `rollout_max_tokens`,
    `overlong_buffer`, `overlong_buffer_penalty_factor`; its rule_verifier and verl's DAPO reward compute the same):

        penalty(L) = min(-min(L - (max_length - buffer), buffer) / buffer * factor, 0)
    """
    if buffer <= 0 or buffer > max_length:
        raise ValueError(f"buffer must be in (0, max_length={max_length}], got {buffer}")
    exceed = (response_lengths.to(torch.float32) - (max_length - buffer)).clamp(max=buffer)
    return (-exceed / buffer * factor).clamp(max=0.0)
