"""PPO's pieces against hand computations of verl's core_algos formulas: token-level rewards, KL in the reward,
GAE with masks, whitening, the clipped value loss and the KL controllers. In the pytest process, no model."""

import math

import pytest
import torch

from mindspeed_rl.algorithms.ppo import (AdaptiveKLController, apply_kl_penalty, clipped_value_loss,
                                         explained_variance, gae_advantages_and_returns, kl_controller,
                                         token_level_rewards)

MASK = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])


def _whitened(values: list[float]) -> list[float]:
    mean = sum(values) / len(values)
    var = sum((v - mean) ** 2 for v in values) / (len(values) - 1)
    return [(v - mean) / math.sqrt(var + 1e-8) for v in values]


def test_the_score_sits_on_each_responses_last_token():
    rewards = token_level_rewards(torch.tensor([2.0, -1.0]), MASK)
    torch.testing.assert_close(rewards, torch.tensor([[0.0, 0.0, 2.0], [0.0, -1.0, 0.0]], dtype=torch.float64))


def test_kl_in_the_reward_is_subtracted_per_token_and_reported_as_the_mean_of_sample_means():
    old = torch.tensor([[-1.0, -2.0, -1.0], [-1.0, -1.0, -7.0]])
    ref = torch.tensor([[-1.5, -1.0, -1.0], [-2.0, -1.0, 0.0]])  # kl = old - ref: [.5, -1, 0], [1, 0, pad]
    rewards, current_kl = apply_kl_penalty(torch.zeros(2, 3, dtype=torch.float64), old, ref, MASK, kl_coef=0.1,
                                           kind="kl")
    torch.testing.assert_close(rewards, torch.tensor([[-0.05, 0.1, 0.0], [-0.1, 0.0, 0.0]], dtype=torch.float64))
    assert current_kl == pytest.approx(((0.5 - 1 + 0) / 3 + (1 + 0) / 2) / 2)


def test_gae_matches_a_hand_table_with_a_padded_response():
    rewards = torch.tensor([[0.0, 0.0, 1.0], [0.0, 2.0, 0.0]])
    values = torch.tensor([[0.5, 0.4, 0.3], [0.1, 0.2, 9.0]])  # 9.0: a padded position's value must not leak
    gamma, lam = 0.9, 0.8
    # sample 0: delta_2 = 1 - .3 = .7; delta_1 = .9*.3 - .4 = -.13; delta_0 = .9*.4 - .5 = -.14
    a0 = [-0.14 + 0.72 * (-0.13 + 0.72 * 0.7), -0.13 + 0.72 * 0.7, 0.7]
    # sample 1 ends at t=1: delta_1 = 2 - .2 = 1.8; delta_0 = .9*.2 - .1 = .08
    a1 = [0.08 + 0.72 * 1.8, 1.8]
    advantages, returns = gae_advantages_and_returns(rewards, values, MASK, gamma=gamma, lam=lam)
    torch.testing.assert_close(returns, torch.tensor([[a0[0] + 0.5, a0[1] + 0.4, a0[2] + 0.3],
                                                      [a1[0] + 0.1, a1[1] + 0.2, 0.0]]))
    white = _whitened(a0 + a1)
    torch.testing.assert_close(advantages, torch.tensor([white[:3], white[3:] + [0.0]]))


def test_gae_with_gamma_and_lam_one_is_the_return_minus_the_value():
    rewards = token_level_rewards(torch.tensor([1.0, 3.0]), MASK)
    values = torch.tensor([[0.2, 0.4, 0.6], [1.0, 2.0, 0.0]])
    _, returns = gae_advantages_and_returns(rewards, values, MASK, gamma=1.0, lam=1.0)
    torch.testing.assert_close(returns, torch.tensor([[1.0, 1.0, 1.0], [3.0, 3.0, 0.0]]))


def test_the_value_loss_takes_the_larger_of_the_clipped_and_unclipped_errors():
    values = torch.tensor([[1.0, 2.0, 1.0]], requires_grad=True)
    old = torch.tensor([[0.0, 2.0, 0.0]])
    returns = torch.tensor([[0.5, 3.0, 1.0]])
    # clipped values (c = 0.2): [0.2, 2.0, 0.2]; squared errors unclipped [.25, 1, 0], clipped [.09, 1, .64]
    loss, stats = clipped_value_loss(values, old, returns, torch.ones(1, 3), cliprange_value=0.2,
                                     loss_agg_mode="token-mean", denominator=3.0, mini_batch_tokens=3.0)
    assert loss.item() == pytest.approx(0.5 * (0.25 + 1.0 + 0.64) / 3)
    assert stats["critic/vf_clipfrac"] == pytest.approx(1 / 3)
    loss.backward()
    # the third token's larger error is the clipped one, which does not move with the value: no gradient
    torch.testing.assert_close(values.grad, torch.tensor([[0.5 / 3, -1 / 3, 0.0]]))


def test_a_value_inside_the_clip_range_is_never_counted_as_clipped():
    # fp32 values where V_old + clamp(V - V_old) is one ulp from V and farther from the return: the old form counted
    # this token as clipped; clamping V into [V_old - c, V_old + c] (verl) leaves V itself.
    old, values, returns = (torch.tensor([[x]]) for x in (-0.200565367937088, -0.07197696715593338,
                                                          -0.09864220023155212))
    assert (old + (values - old).clamp(-0.2, 0.2) - returns) ** 2 > (values - returns) ** 2
    _, stats = clipped_value_loss(values, old, returns, torch.ones(1, 1), cliprange_value=0.2,
                                  loss_agg_mode="token-mean", denominator=1.0, mini_batch_tokens=1.0)
    assert stats["critic/vf_clipfrac"] == 0.0


def test_the_clip_fractions_of_micro_batches_add_up_to_the_mini_batchs():
    """Each micro-batch's statistic is its share of the mini-batch's (the engine sums them over micro-batches and DP
    ranks): 3 clipped tokens of 8 is 0.375, not the sum of per-micro-batch means."""
    values = torch.tensor([[1.0, 1.0, 1.0, 0.0], [1.0, 1.0, 0.0, 0.0], [0.0, 0.0, 0.0, 0.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0, 1.0], [1.0, 1.0, 0.0, 0.0], [1.0, 1.0, 0.0, 0.0]])
    old, returns = torch.zeros(3, 4), torch.full((3, 4), 0.5)  # V = 1 clips to 0.2, whose error is the smaller
    old[0, :2] = 2.0  # ... except where V_old = 2 clips V = 1 to 1.8: larger error, clipped
    old[1, 0] = 2.0
    total = 0.0
    for rows in (slice(0, 1), slice(1, 3)):
        _, stats = clipped_value_loss(values[rows], old[rows], returns[rows], mask[rows], cliprange_value=0.2,
                                      loss_agg_mode="token-mean", denominator=8.0, mini_batch_tokens=8.0)
        total += stats["critic/vf_clipfrac"]
    assert total == pytest.approx(3 / 8)


def test_the_explained_variance_is_one_for_exact_values_and_zero_for_the_mean():
    returns, mask = torch.tensor([[1.0, 2.0, 9.0], [3.0, 0.0, 9.0]]), torch.tensor([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0]])
    assert explained_variance(returns, returns, mask) == pytest.approx(1.0)
    assert explained_variance(torch.full_like(returns, 2.0), returns, mask) == pytest.approx(0.0)


def test_the_adaptive_controller_moves_the_coefficient_toward_the_target_by_at_most_20_percent():
    controller = kl_controller("adaptive", init_kl_coef=0.1, kl_target=0.05, kl_horizon=100)
    controller.update(current_kl=0.1, n_steps=10)  # KL twice the target: error clipped to +0.2
    assert controller.value == pytest.approx(0.1 * (1 + 0.2 * 10 / 100))
    controller.update(current_kl=0.045, n_steps=10)  # error -0.1
    assert controller.value == pytest.approx(0.1 * 1.02 * (1 - 0.1 * 10 / 100))
    fixed = kl_controller("fixed", init_kl_coef=0.1)
    fixed.update(current_kl=5.0, n_steps=10)
    assert fixed.value == 0.1


def test_the_adaptive_controller_needs_a_target_and_a_horizon():
    with pytest.raises(ValueError, match="kl_target and kl_horizon must be > 0"):
        AdaptiveKLController(0.1, 0.0, 100)
