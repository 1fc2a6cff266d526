"""Advantage estimators without a critic (``rl_config.adv_estimator``), formulas as verl's ``core_algos``.

``rewards`` is the outcome reward per sample ``[num_samples]``, the ``n`` samples of one prompt contiguous;
``response_mask`` ``[num_samples, response_len]`` marks the generated tokens. Statistics are taken in float64
and the result is float32: per sample ``[num_samples]`` (broadcast over its tokens by the loss) or per token.
"""
from __future__ import annotations

import torch
from torch import Tensor

from mindspeed_rl.algorithms.grpo import group_normalized_advantages, grouped_rewards

# verl's masked_whiten epsilon (under the square root).
WHITEN_EPS = 1e-8


def rloo_advantages(rewards: Tensor, n_samples_per_prompt: int) -> Tensor:
    """RLOO (Ahmadian et al. 2024, "Back to Basics: Revisiting REINFORCE Style Optimization for Learning from
    Human Feedback in LLMs"): each sample's baseline is the mean reward of the other samples of its prompt,

        A_i = r_i - 1/(n-1) * sum_{j != i} r_j  =  n/(n-1) * (r_i - mean_g);   A_i = r_i for a group of one.
    """
    grouped = grouped_rewards(rewards, n_samples_per_prompt)
    n = n_samples_per_prompt
    if n == 1:  # no other sample: no baseline (verl)
        return grouped.reshape(-1).to(torch.float32)
    others_mean = (grouped.sum(dim=1, keepdim=True) - grouped) / (n - 1)
    return (grouped - others_mean).reshape(-1).to(torch.float32)


def reinforce_plus_plus_advantages(rewards: Tensor, response_mask: Tensor, gamma: float) -> Tensor:
    """REINFORCE++ (Hu 2025, "REINFORCE++: A Simple and Efficient Approach for Aligning Large Language Models"):
    the outcome reward sits on each response's last token, the return of token t is the discounted sum of the
    rewards after it, and the returns are whitened over every response token of the batch (global
    normalisation, no per-prompt group):

        G_t = gamma^(T-1-t) * r,   A_t = (G_t - mean(G)) / sqrt(var(G) + 1e-8)   (mean, unbiased var: valid tokens)

    Per token ``[num_samples, response_len]``, 0 on padding.

    A mask with holes (the tool outputs of a multi-turn response) is discounted over the valid tokens only: a token
    before a tool output still sees the reward, ``gamma`` to the number of generated tokens after it. verl resets
    its running return at every masked token, so there the tokens before a tool output get return 0; the two agree
    wherever the mask has no holes (docs/algorithms.md).
    """
    mask = _token_mask(rewards, response_mask)
    # Steps from each token to its response's last token (the reward), counted over valid tokens only.
    steps_to_end = mask.flip(-1).cumsum(-1).flip(-1) - 1.0
    returns = rewards.to(torch.float64).unsqueeze(-1) * gamma ** steps_to_end.clamp(min=0) * mask
    return (masked_whiten(returns, mask) * mask).to(torch.float32)


def reinforce_plus_plus_baseline_advantages(rewards: Tensor, response_mask: Tensor,
                                            n_samples_per_prompt: int) -> Tensor:
    """REINFORCE++ with a baseline (verl's ``reinforce_plus_plus_baseline``): the reward minus its prompt's mean
    reward (0 for a group of one), on every response token, whitened over every response token of the batch:

        A_t = whiten_batch(r_i - mean_g)    (mean, unbiased var: valid tokens)

    Per token ``[num_samples, response_len]``, 0 on padding.
    """
    grouped = grouped_rewards(rewards, n_samples_per_prompt)
    mask = _token_mask(rewards, response_mask)
    baseline = grouped.mean(dim=1, keepdim=True) if n_samples_per_prompt > 1 else torch.zeros_like(grouped)
    scores = (grouped - baseline).reshape(-1, 1) * mask
    return (masked_whiten(scores, mask) * mask).to(torch.float32)


def _token_mask(rewards: Tensor, response_mask: Tensor) -> Tensor:
    """The response mask in float64, checked against the per-sample rewards."""
    mask = response_mask.to(torch.float64)
    if rewards.shape != mask.shape[:1]:
        raise ValueError(f"rewards {tuple(rewards.shape)} and response_mask {tuple(mask.shape)} disagree")
    return mask


def masked_whiten(values: Tensor, mask: Tensor) -> Tensor:
    """(x - mean) / sqrt(var + 1e-8) over the valid positions, with the unbiased variance (verl's masked_whiten)."""
    mask = mask.to(torch.float64)
    count = mask.sum()
    mean = (values * mask).sum() / count
    var = (((values - mean) ** 2) * mask).sum() / (count - 1).clamp(min=1)
    return (values - mean) * torch.rsqrt(var + WHITEN_EPS)


def compute_advantages(rl, rewards: Tensor, response_mask: Tensor) -> Tensor:
    """The advantages ``rl_config.adv_estimator`` names (config/rl.py ADV_ESTIMATORS)."""
    if rl.adv_estimator == "group_norm":
        return group_normalized_advantages(rewards, rl.n_samples_per_prompt, normalize_by_std=rl.norm_adv_by_std_in_grpo)
    if rl.adv_estimator == "rloo":
        return rloo_advantages(rewards, rl.n_samples_per_prompt)
    if rl.adv_estimator == "reinforce_plus_plus":
        return reinforce_plus_plus_advantages(rewards, response_mask, rl.gamma)
    if rl.adv_estimator == "reinforce_plus_plus_baseline":
        return reinforce_plus_plus_baseline_advantages(rewards, response_mask, rl.n_samples_per_prompt)
    raise ValueError(f"unknown adv_estimator {rl.adv_estimator!r}")

