"""The critic-free advantage estimators (rl_config.adv_estimator) against hand computations of their papers'
formulas (verl's core_algos)."""

import math

import pytest
import torch

from mindspeed_rl.algorithms.advantages import (
    compute_advantages,
    reinforce_plus_plus_advantages,
    reinforce_plus_plus_baseline_advantages,
    rloo_advantages,
)
from mindspeed_rl.algorithms.grpo import group_normalized_advantages


def test_rloo_baseline_is_the_mean_of_the_other_samples():
    rewards = torch.tensor([1.0, 0.0, 0.0, 1.0, 2.0, 2.0, 2.0, 5.0])
    # prompt 1: 1 - (0+0+1)/3, 0 - (1+0+1)/3, ...; prompt 2: 2 - (2+2+5)/3, ..., 5 - 2
    want = [1 - 1 / 3, -2 / 3, -2 / 3, 1 - 1 / 3, 2 - 3, 2 - 3, 2 - 3, 5 - 2]
    torch.testing.assert_close(rloo_advantages(rewards, 4), torch.tensor(want))


def test_rloo_of_a_group_of_one_is_the_reward():
    """verl's compute_rloo_outcome_advantage leaves a group of one sample's score as it is."""
    torch.testing.assert_close(rloo_advantages(torch.tensor([1.0, 0.0, 2.0]), 1), torch.tensor([1.0, 0.0, 2.0]))


def _verl_masked_whiten(values, mask):
    mean = (values * mask).sum() / mask.sum()
    var = (((values - mean) ** 2) * mask).sum() / (mask.sum() - 1)
    return (values - mean) * torch.rsqrt(var + 1e-8)


@pytest.mark.parametrize("n", [1, 2])
def test_reinforce_plus_plus_baseline_as_verl(n):
    """verl's compute_reinforce_plus_plus_baseline_outcome_advantage, written from its loop: the score minus the
    group's mean (0 for a group of one), tiled over the response, whitened over the valid tokens."""
    rewards = torch.tensor([1.0, 0.0, 3.0, 1.0], dtype=torch.float64)
    mask = torch.tensor([[1, 1, 1], [1, 1, 0], [1, 0, 0], [1, 1, 1]], dtype=torch.float64)
    scores = rewards.clone()
    for start in range(0, 4, n):
        group = rewards[start:start + n]
        scores[start:start + n] = group - (group.mean() if n > 1 else 0.0)
    want = _verl_masked_whiten(scores.unsqueeze(-1) * mask, mask) * mask
    got = reinforce_plus_plus_baseline_advantages(rewards.float(), mask.float(), n)
    torch.testing.assert_close(got, want.float())
    if n == 2:  # by hand: scores 0.5, -0.5, 1, -1 over 3, 2, 1, 3 tokens
        assert got[0, 0] > 0 > got[1, 0] and got[0, 0] == got[0, 2] and got[1, 2] == 0


def _verl_reinforce_plus_plus(rewards, mask, gamma):
    """verl's compute_reinforce_plus_plus_outcome_advantage: the running return resets at every masked token."""
    token_rewards = torch.zeros_like(mask)
    for i, row in enumerate(mask):
        token_rewards[i, int(row.nonzero().max())] = rewards[i]
    returns, running = torch.zeros_like(mask), torch.zeros(mask.shape[0], dtype=mask.dtype)
    for t in reversed(range(mask.shape[1])):
        running = token_rewards[:, t] + gamma * running
        returns[:, t] = running
        running = running * mask[:, t]
    return _verl_masked_whiten(returns, mask) * mask


def test_reinforce_plus_plus_equals_verls_where_the_mask_has_no_holes():
    rewards = torch.tensor([1.0, -1.0, 0.5], dtype=torch.float64)
    mask = torch.tensor([[1, 1, 1, 1], [1, 1, 0, 0], [1, 1, 1, 0]], dtype=torch.float64)
    torch.testing.assert_close(reinforce_plus_plus_advantages(rewards.float(), mask.float(), 0.9),
                               _verl_reinforce_plus_plus(rewards, mask, 0.9).float())


def test_reinforce_plus_plus_discounts_over_generated_tokens_across_a_tool_output():
    """A multi-turn response: tokens 0-1 generated, 2-3 a tool's output (masked), 4-5 generated. Ours gives the
    tokens before the tool output gamma^(generated tokens after them) x r; verl's resets at the masked token and
    gives them 0 before whitening (docs/algorithms.md says which)."""
    rewards = torch.tensor([1.0, 0.0], dtype=torch.float64)
    mask = torch.tensor([[1, 1, 0, 0, 1, 1], [1, 1, 1, 1, 1, 1]], dtype=torch.float64)
    gamma = 0.5
    returns = torch.tensor([[gamma ** 3, gamma ** 2, 0, 0, gamma, 1.0], [0.0] * 6], dtype=torch.float64)
    want = _verl_masked_whiten(returns, mask) * mask
    torch.testing.assert_close(reinforce_plus_plus_advantages(rewards.float(), mask.float(), gamma), want.float())
    verl = _verl_reinforce_plus_plus(rewards, mask, gamma)
    assert verl[0, 0] == verl[0, 1] == verl[1, 0], "verl: the tokens before the tool output get the zero return"


def test_dr_grpo_is_group_norm_without_the_std():
    rewards = torch.tensor([1.0, 0.0, 0.0, 0.0])
    torch.testing.assert_close(group_normalized_advantages(rewards, 4, normalize_by_std=False),
                               torch.tensor([0.75, -0.25, -0.25, -0.25]))
    std = math.sqrt((0.75 ** 2 + 3 * 0.25 ** 2) / 3)  # unbiased
    torch.testing.assert_close(group_normalized_advantages(rewards, 4),
                               torch.tensor([0.75, -0.25, -0.25, -0.25]) / (std + 1e-6))


def test_reinforce_plus_plus_whitens_discounted_returns_over_every_token():
    rewards = torch.tensor([1.0, -1.0])
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])
    gamma = 0.5
    # returns: sample 0 ends at t=2: [0.25, 0.5, 1]; sample 1 ends at t=1: [-0.5, -1, pad]
    returns = [0.25, 0.5, 1.0, -0.5, -1.0]
    mean = sum(returns) / 5
    var = sum((g - mean) ** 2 for g in returns) / 4
    whitened = [(g - mean) / math.sqrt(var + 1e-8) for g in returns]
    want = torch.tensor([whitened[:3], whitened[3:] + [0.0]])
    torch.testing.assert_close(reinforce_plus_plus_advantages(rewards, mask, gamma), want)


def test_reinforce_plus_plus_with_gamma_1_gives_each_token_its_outcome():
    got = reinforce_plus_plus_advantages(torch.tensor([2.0, 0.0]), torch.ones(2, 3), 1.0)
    assert torch.equal(got[:, 0:1].expand(2, 3), got) and got[0, 0] > 0 > got[1, 0]


@pytest.mark.parametrize("estimator, normalize, want", [
    ("group_norm", True, "group"), ("group_norm", False, "dr"), ("rloo", True, "rloo"),
    ("reinforce_plus_plus", True, "rpp"), ("reinforce_plus_plus_baseline", True, "rppb"),
])
def test_the_config_picks_the_estimator(estimator, normalize, want):
    from types import SimpleNamespace

    rewards, mask = torch.tensor([1.0, 0.0, 3.0, 1.0]), torch.ones(4, 2)
    rl = SimpleNamespace(adv_estimator=estimator, norm_adv_by_std_in_grpo=normalize, n_samples_per_prompt=2, gamma=1.0)
    expected = {"group": group_normalized_advantages(rewards, 2),
                "dr": group_normalized_advantages(rewards, 2, normalize_by_std=False),
                "rloo": rloo_advantages(rewards, 2), "rpp": reinforce_plus_plus_advantages(rewards, mask, 1.0),
                "rppb": reinforce_plus_plus_baseline_advantages(rewards, mask, 2)}[want]
    torch.testing.assert_close(compute_advantages(rl, rewards, mask), expected)


def test_the_estimator_keys_load():
    from mindspeed_rl.config import ConfigError
    from tests.test_config import TINY, load

    config = load(TINY, "rl_config.adv_estimator=reinforce_plus_plus", "rl_config.gamma=0.99")
    assert (config.rl_config.adv_estimator, config.rl_config.gamma) == ("reinforce_plus_plus", 0.99)
    assert load(TINY, "rl_config.norm_adv_by_std_in_grpo=false").rl_config.norm_adv_by_std_in_grpo is False
    with pytest.raises(ConfigError, match="rl_config.gamma: must be in"):
        load(TINY, "rl_config.adv_estimator=reinforce_plus_plus", "rl_config.gamma=0")


def test_gamma_is_listed_as_no_effect_for_a_group_estimator():
    from mindspeed_rl.config import load_config
    from tests.test_config import TINY, compose_cfg

    notices: list[str] = []
    config = load_config(compose_cfg(TINY, ["rl_config.gamma=0.9"]), notices=notices)
    assert config.rl_config.gamma == 1.0
    assert [notice.split(" ", 1)[0] for notice in notices] == ["rl_config.gamma"]
