"""GRPO tensor functions against hand-computed values."""

import math

import pytest
import torch

from mindspeed_rl.algorithms import (
    LOSS_AGG_MODES,
    GRPOLossConfig,
    count_loss_units,
    entropy_from_logits,
    group_normalized_advantages,
    grpo_loss,
    kl_penalty,
    masked_mean,
    masked_sum,
    ppo_clip_policy_loss,
)


def test_group_advantages_hand_example():
    rewards = torch.tensor([1.0, 0.0, 0.0, 1.0, 0.0, 0.0, 0.0, 0.0])
    advantages = group_normalized_advantages(rewards, n_samples_per_prompt=4)
    # group 1: mean 0.5, unbiased std sqrt(4 * 0.25 / 3) = sqrt(1/3); group 2: all equal.
    a = 0.5 / (math.sqrt(1.0 / 3.0) + 1e-6)
    expected = torch.tensor([a, -a, -a, a, 0.0, 0.0, 0.0, 0.0])
    assert advantages.dtype == torch.float32
    torch.testing.assert_close(advantages, expected)
    assert abs(a - 0.8660) < 1e-4


def test_group_advantages_reject_bad_group_size():
    with pytest.raises(ValueError, match="not a multiple"):
        group_normalized_advantages(torch.zeros(6), n_samples_per_prompt=4)
    with pytest.raises(ValueError, match=">= 1"):
        group_normalized_advantages(torch.zeros(4), n_samples_per_prompt=0)


@pytest.mark.parametrize("by_std", [True, False], ids=["grpo", "dr_grpo"])
def test_a_group_of_one_takes_mean_0_and_std_1_as_verl(by_std):
    """verl's compute_grpo_outcome_advantage: a group of one sample has mean 0 and std 1."""
    rewards = torch.tensor([1.0, 0.0, 0.5])
    got = group_normalized_advantages(rewards, n_samples_per_prompt=1, normalize_by_std=by_std)
    want = rewards / (1.0 + 1e-6) if by_std else rewards
    assert torch.allclose(got, want, atol=0, rtol=1e-7)


@pytest.mark.parametrize(
    "kind, expected",
    [
        ("kl", lambda d: d),
        ("abs", lambda d: abs(d)),
        ("mse", lambda d: 0.5 * d * d),
        # k3 with x = ref - logp = -d
        ("low_var_kl", lambda d: math.exp(-d) - (-d) - 1.0),
        # verl's aliases of the same estimators
        ("k1", lambda d: d),
        ("k2", lambda d: 0.5 * d * d),
        ("k3", lambda d: math.exp(-d) - (-d) - 1.0),
    ],
)
def test_kl_penalty_kinds(kind, expected):
    logprobs = torch.tensor([-1.0, -2.0, -0.5])
    ref_logprobs = torch.tensor([-1.5, -1.0, -0.5])
    got = kl_penalty(logprobs, ref_logprobs, kind)
    want = [expected(lp - rp) for lp, rp in zip(logprobs.tolist(), ref_logprobs.tolist())]
    torch.testing.assert_close(got, torch.tensor(want))


@pytest.mark.parametrize("kind, base", [("k3+", "low_var_kl"), ("low_var_kl+", "low_var_kl"), ("k1+", "kl"),
                                        ("kl+", "kl")])
def test_a_plus_kl_has_the_estimators_value_and_k2s_gradient(kind, base):
    """verl's straight-through form: the value of k3 (or k1), the gradient of 0.5 (logp - ref)^2, i.e. logp - ref."""
    logprobs = torch.tensor([-1.0, -2.0, -0.5], requires_grad=True)
    ref_logprobs = torch.tensor([-1.5, -1.0, -0.5])
    got = kl_penalty(logprobs, ref_logprobs, kind)
    torch.testing.assert_close(got.detach(), kl_penalty(logprobs.detach(), ref_logprobs, base))
    got.sum().backward()
    torch.testing.assert_close(logprobs.grad, torch.tensor([0.5, -1.0, 0.0]))


def test_low_var_kl_clamps():
    # ref - logp = 30 is clamped to 20, then exp(20) - 21 is clamped to 10.
    assert kl_penalty(torch.tensor([-30.0]), torch.tensor([0.0]), "low_var_kl").item() == 10.0
    # ref - logp = -30 -> -20: exp(-20) + 20 - 1 = 19.000000002 -> clamped to 10.
    assert kl_penalty(torch.tensor([0.0]), torch.tensor([-30.0]), "low_var_kl").item() == 10.0
    # inside both clamps: ref - logp = -2 -> exp(-2) + 1.
    value = kl_penalty(torch.tensor([0.0]), torch.tensor([-2.0]), "low_var_kl").item()
    assert value == pytest.approx(math.exp(-2.0) + 1.0, rel=1e-6)


def test_kl_penalty_unknown_kind_names_valid_ones():
    with pytest.raises(ValueError, match=r"'full'.*low_var_kl"):
        kl_penalty(torch.zeros(1), torch.zeros(1), "full")


def test_masked_mean_and_sum():
    values = torch.tensor([[1.0, 2.0, float("inf")], [4.0, 0.0, 0.0]])
    mask = torch.tensor([[1, 1, 0], [1, 0, 0]], dtype=torch.float32)
    assert masked_sum(values, mask).item() == 7.0
    assert masked_mean(values, mask).item() == pytest.approx(7.0 / 3.0)
    torch.testing.assert_close(masked_mean(values, mask, dim=-1), torch.tensor([1.5, 4.0]))
    assert masked_mean(values, torch.zeros_like(mask)).item() == 0.0


def test_ppo_clip_inside_and_outside_range():
    eps = 0.2
    ratios = torch.tensor([[1.1, 1.5, 0.5, 1.5, 0.5]])
    advantages = torch.tensor([[1.0, 1.0, 1.0, -1.0, -1.0]])
    old = torch.zeros(1, 5)
    logprobs = ratios.log()
    mask = torch.ones(1, 5, dtype=torch.bool)
    loss, clipfrac, approx_kl, _ = ppo_clip_policy_loss(logprobs, old, advantages, mask, eps)
    # A>0: max(-r, -clip(r)) -> 1.1 inside; 1.5 clipped to 1.2 (unclipped -1.5 is smaller, so
    # the clipped branch -1.2 wins); 0.5 -> -0.5 (unclipped -0.5 > -0.8). A<0: 1.5 -> 1.5 (unclipped);
    # 0.5 -> clip 0.8 wins (0.8 > 0.5).
    torch.testing.assert_close(loss, torch.tensor([[-1.1, -1.2, -0.5, 1.5, 0.8]]))
    torch.testing.assert_close(clipfrac, torch.tensor([[0.0, 1.0, 0.0, 0.0, 1.0]]))
    torch.testing.assert_close(approx_kl, -logprobs)


def _verl_dual_clip(ratio, advantages, eps, clip_ratio_c):
    """verl's compute_policy_loss_vanilla, per token, written from its formula."""
    pg1, pg2 = -advantages * ratio, -advantages * ratio.clamp(1 - eps, 1 + eps)
    clip1 = torch.maximum(pg1, pg2)
    pg3 = -advantages * clip_ratio_c
    lower = (clip1 > pg3) & (advantages < 0)
    return torch.where(advantages < 0, torch.minimum(pg3, clip1), clip1), lower.float()


def test_dual_clip_bounds_a_negative_advantages_loss_as_verl():
    ratios = torch.tensor([[1.1, 5.0, 0.5, 5.0, 2.0, 0.5]])
    advantages = torch.tensor([[-1.0, -1.0, -1.0, 1.0, -2.0, 2.0]])
    mask = torch.tensor([[1, 1, 1, 1, 1, 0]])
    loss, clipfrac, _, lower = ppo_clip_policy_loss(ratios.log(), torch.zeros(1, 6), advantages, mask, 0.2,
                                                     clip_ratio_c=3.0)
    want_loss, want_lower = _verl_dual_clip(ratios, advantages, 0.2, 3.0)
    # By hand: A=-1, r=5: PPO's loss 5 -> at most 3 (the dual clip); A=+1 is never dual-clipped; padding is 0.
    torch.testing.assert_close(loss, want_loss * mask)
    torch.testing.assert_close(loss, torch.tensor([[1.1, 3.0, 0.8, -1.2, 4.0, 0.0]]))
    torch.testing.assert_close(lower, want_lower * mask)
    assert lower.tolist() == [[0.0, 1.0, 0.0, 0.0, 0.0, 0.0]]
    without, _, _, none = ppo_clip_policy_loss(ratios.log(), torch.zeros(1, 6), advantages, mask, 0.2)
    assert without[0, 1].item() == pytest.approx(5.0) and none.sum().item() == 0.0


def test_dual_clip_logs_the_lower_clip_fraction_by_the_loss_mode():
    logprobs = torch.tensor([[1.6, 0.0, 0.0], [0.0, 0.0, 0.0]])  # ratio e^1.6 ~ 4.95 on the first token
    zeros = torch.zeros(2, 3)
    mask = torch.tensor([[1, 1, 1], [1, 0, 0]])
    config = GRPOLossConfig(clip_ratio=0.2, kl_coef=0.0, clip_ratio_c=3.0)
    _, stats = grpo_loss(logprobs=logprobs, old_logprobs=zeros, ref_logprobs=None, advantages=torch.tensor([-1.0, 1.0]),
                         response_mask=mask, entropy=None, config=config)
    assert stats["actor/pg_clipfrac_lower"] == pytest.approx(1 / 4)  # token-mean: 1 of the 4 valid tokens
    assert "actor/pg_clipfrac_lower" not in grpo_loss(
        logprobs=logprobs, old_logprobs=zeros, ref_logprobs=None, advantages=torch.tensor([-1.0, 1.0]),
        response_mask=mask, entropy=None, config=GRPOLossConfig(clip_ratio=0.2, kl_coef=0.0))[1]
    with pytest.raises(ValueError, match="clip_ratio_c must be > 1"):
        GRPOLossConfig(clip_ratio_c=1.0)


def test_ppo_clip_zero_at_padding_and_sequence_advantages():
    logprobs = torch.tensor([[-1.0, -1.0], [-1.0, 50.0]])
    old = torch.tensor([[-1.0, -1.0], [-1.0, -1.0]])
    mask = torch.tensor([[1, 1], [1, 0]])
    loss, clipfrac, approx_kl, _ = ppo_clip_policy_loss(logprobs, old, torch.tensor([2.0, -3.0]), mask, 0.2)
    torch.testing.assert_close(loss, torch.tensor([[-2.0, -2.0], [3.0, 0.0]]))
    assert clipfrac.sum().item() == 0.0
    assert approx_kl[1, 1].item() == 0.0


def test_entropy_from_logits_matches_definition():
    logits = torch.randn(3, 4, 11, generator=torch.Generator().manual_seed(0)) * 5
    expected = -(torch.softmax(logits, -1) * torch.log_softmax(logits, -1)).sum(-1)
    torch.testing.assert_close(entropy_from_logits(logits), expected)
    # stable for huge logits: a one-hot distribution has zero entropy.
    huge = torch.tensor([[1e4, 0.0, 0.0]])
    assert entropy_from_logits(huge).item() == pytest.approx(0.0, abs=1e-6)


def _random_batch(seed: int, batch: int = 6, length: int = 5):
    generator = torch.Generator().manual_seed(seed)
    logprobs = -torch.rand(batch, length, generator=generator) * 3
    old = logprobs + 0.3 * torch.randn(batch, length, generator=generator)
    ref = logprobs + 0.3 * torch.randn(batch, length, generator=generator)
    advantages = torch.randn(batch, generator=generator)
    entropy = torch.rand(batch, length, generator=generator)
    lengths = torch.tensor([5, 3, 1, 4, 2, 5])[:batch]
    mask = torch.arange(length).unsqueeze(0) < lengths.unsqueeze(1)
    return dict(logprobs=logprobs, old_logprobs=old, ref_logprobs=ref, advantages=advantages,
                response_mask=mask, entropy=entropy)


def _slice(batch: dict, rows: slice) -> dict:
    return {key: value[rows] for key, value in batch.items()}


@pytest.mark.parametrize("loss_agg_mode", LOSS_AGG_MODES)
def test_micro_batches_with_shared_denominator_sum_to_full_batch(loss_agg_mode):
    config = GRPOLossConfig(clip_ratio=0.2, kl_penalty="low_var_kl", kl_coef=0.1,
                            entropy_coeff=0.01, loss_agg_mode=loss_agg_mode, norm_length=7)
    batch = _random_batch(seed=1)
    full_loss, full_stats = grpo_loss(**batch, config=config)
    denominator = count_loss_units(batch["response_mask"], loss_agg_mode, 7)
    tokens = float(batch["response_mask"].bool().sum())  # the token-mean stats' (clip fractions, ppo_kl)
    micro = [grpo_loss(**_slice(batch, slice(i, i + 2)), config=config,
                       loss_scale_denominator=denominator, mini_batch_tokens=tokens) for i in range(0, 6, 2)]
    assert sum(loss for loss, _ in micro).item() == pytest.approx(full_loss.item(), abs=1e-6)
    for key, value in full_stats.items():
        assert sum(stats[key] for _, stats in micro) == pytest.approx(value, abs=1e-6)


@pytest.mark.parametrize("loss_agg_mode", LOSS_AGG_MODES)
def test_the_clip_fractions_and_ppo_kl_are_token_means_in_every_mode(loss_agg_mode):
    """verl's masked_mean: under seq-mean-token-sum an aggregation by the loss mode would count clipped tokens per
    sequence (1.25 seen), not a fraction."""
    config = GRPOLossConfig(clip_ratio=0.2, kl_coef=0.0, loss_agg_mode=loss_agg_mode, norm_length=7, clip_ratio_c=1.5)
    batch = _random_batch(seed=3)
    _, stats = grpo_loss(**batch, config=config)
    _, clipfrac, ppo_kl, lower = ppo_clip_policy_loss(batch["logprobs"], batch["old_logprobs"], batch["advantages"],
                                                      batch["response_mask"], 0.2, clip_ratio_c=1.5)
    mask = batch["response_mask"].bool()
    for key, tokens in (("actor/pg_clipfrac", clipfrac), ("actor/ppo_kl", ppo_kl), ("actor/pg_clipfrac_lower", lower)):
        assert stats[key] == pytest.approx(tokens[mask].mean().item(), abs=1e-6), key


def test_token_level_loss_hand_computation():
    config = GRPOLossConfig(clip_ratio=0.2, kl_penalty="kl", kl_coef=0.5,
                            entropy_coeff=0.1, loss_agg_mode="token-mean")
    batch = _random_batch(seed=2)
    loss, stats = grpo_loss(**batch, config=config)
    mask = batch["response_mask"]
    pg_tokens, _, _, _ = ppo_clip_policy_loss(batch["logprobs"], batch["old_logprobs"],
                                           batch["advantages"], mask, 0.2)
    pg = pg_tokens[mask].mean()
    kl = (batch["logprobs"] - batch["ref_logprobs"])[mask].mean()
    entropy = batch["entropy"][mask].mean()
    assert stats["actor/pg_loss"] == pytest.approx(pg.item(), abs=1e-6)
    assert loss.item() == pytest.approx((pg + 0.5 * kl - 0.1 * entropy).item(), abs=1e-6)


def test_sequence_level_loss_hand_computation():
    config = GRPOLossConfig(clip_ratio=0.2, kl_penalty="mse", kl_coef=0.0,
                            entropy_coeff=0.0, loss_agg_mode="seq-mean-token-mean")
    # ratio 1 everywhere: per-token pg loss is -A. Sequence 0 has 3 tokens, sequence 1 one token.
    logprobs = torch.tensor([[-1.0, -2.0, -3.0], [-1.0, 0.0, 0.0]])
    mask = torch.tensor([[1, 1, 1], [1, 0, 0]])
    advantages = torch.tensor([[1.0, 2.0, 3.0], [4.0, 0.0, 0.0]])
    loss, stats = grpo_loss(logprobs=logprobs, old_logprobs=logprobs.clone(), ref_logprobs=None,
                            advantages=advantages, response_mask=mask, entropy=None, config=config)
    # per-sequence means: -2 and -4; mean over sequences: -3 (a token mean would be -2.5).
    assert loss.item() == pytest.approx(-3.0)
    assert stats["actor/kl_loss"] == 0.0
    assert count_loss_units(mask, "seq-mean-token-mean") == 2


@pytest.mark.parametrize("loss_agg_mode, expected", [
    ("token-mean", -10.0 / 4),               # (-1 - 2 - 3 - 4) / 4 tokens
    ("seq-mean-token-mean", (-2.0 - 4.0) / 2),  # sequence means -2 and -4
    ("seq-mean-token-sum", (-6.0 - 4.0) / 2),   # sequence sums -6 and -4
    ("seq-mean-token-sum-norm", (-6.0 - 4.0) / (2 * 5)),  # sums over 2 sequences x the constant length 5
])
def test_each_loss_aggregation_mode_against_hand_computation(loss_agg_mode, expected):
    """verl's core_algos.agg_loss formulas, with the whole mini-batch's denominator (norm_length 5 for -norm)."""
    config = GRPOLossConfig(clip_ratio=0.2, kl_coef=0.0, loss_agg_mode=loss_agg_mode, norm_length=5)
    logprobs = torch.tensor([[-1.0, -2.0, -3.0], [-1.0, 0.0, 0.0]])
    loss, _ = grpo_loss(logprobs=logprobs, old_logprobs=logprobs.clone(), ref_logprobs=None,
                        advantages=torch.tensor([[1.0, 2.0, 3.0], [4.0, 0.0, 0.0]]),
                        response_mask=torch.tensor([[1, 1, 1], [1, 0, 0]]), entropy=None, config=config)
    assert loss.item() == pytest.approx(expected)


def test_clip_higher_clips_the_ratio_asymmetrically():
    """DAPO's clip-higher: ratio clamped to [1 - 0.2, 1 + 0.28]. Positive advantage: the gain stops at 1.28
    (not 1.2); negative advantage: the loss stops at 0.8."""
    old = torch.zeros(1, 4)
    logprobs = torch.log(torch.tensor([[1.25, 1.40, 0.90, 0.70]]))
    advantages = torch.tensor([[1.0, 1.0, -1.0, -1.0]])
    mask = torch.ones(1, 4)
    loss, clipfrac, _, _ = ppo_clip_policy_loss(logprobs, old, advantages, mask, 0.2, 0.28)
    assert loss[0].tolist() == pytest.approx([-1.25, -1.28, 0.90, 0.80])
    assert clipfrac[0].tolist() == [0.0, 1.0, 0.0, 1.0]
    symmetric, _, _, _ = ppo_clip_policy_loss(logprobs, old, advantages, mask, 0.2)
    assert symmetric[0].tolist() == pytest.approx([-1.20, -1.20, 0.90, 0.80])


def test_overlong_penalty_table():
    """DAPO's soft overlong punishment, max length 20, buffer 8, factor 0.5: 0 up to 12 tokens, then linear to
    -0.5 at 20, and -0.5 beyond."""
    from mindspeed_rl.algorithms.dapo import overlong_penalty

    lengths = torch.tensor([0, 12, 13, 16, 20, 25])
    penalty = overlong_penalty(lengths, max_length=20, buffer=8, factor=0.5)
    assert penalty.tolist() == pytest.approx([0.0, 0.0, -0.0625, -0.25, -0.5, -0.5])
    with pytest.raises(ValueError, match="buffer must be in"):
        overlong_penalty(lengths, max_length=20, buffer=0, factor=0.5)


def test_gradient_flows_to_logprobs_only_at_valid_tokens():
    config = GRPOLossConfig(kl_coef=0.1, entropy_coeff=0.0)
    batch = _random_batch(seed=3)
    logprobs = batch.pop("logprobs").requires_grad_(True)
    loss, _ = grpo_loss(logprobs=logprobs, **batch, config=config)
    loss.backward()
    assert torch.isfinite(logprobs.grad).all()
    assert logprobs.grad[batch["response_mask"]].abs().sum() > 0
    assert logprobs.grad[~batch["response_mask"]].abs().sum() == 0


def test_loss_config_and_argument_errors():
    with pytest.raises(ValueError, match="kl_penalty"):
        GRPOLossConfig(kl_penalty="nope")
    with pytest.raises(ValueError, match="clip ratios must be > 0"):
        GRPOLossConfig(clip_ratio=0.0)
    with pytest.raises(ValueError, match="loss_agg_mode"):
        GRPOLossConfig(loss_agg_mode="token-sum")
    with pytest.raises(ValueError, match="norm_length"):
        GRPOLossConfig(loss_agg_mode="seq-mean-token-sum-norm")
    batch = _random_batch(seed=4)
    batch["ref_logprobs"] = None
    with pytest.raises(ValueError, match="ref_logprobs"):
        grpo_loss(**batch, config=GRPOLossConfig(kl_coef=0.1))
    with pytest.raises(ValueError, match="loss_scale_denominator"):
        grpo_loss(**batch, config=GRPOLossConfig(kl_coef=0.0), loss_scale_denominator=0)
