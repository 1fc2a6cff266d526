"""Rollout correction (rl_config.rollout_correction) against verl's formulas, written here from its rollout_corr
helper: truncated importance weights per token and per sequence (and batch-normalised), the older rejection names
(token, sequence, geometric) keeping what they kept, the token veto, the divergence metrics; bad values; the loss it
weighs; the batch step that drops rejected tokens from the loss mask; PPO with rejected tokens as verl's (GAE, the
whitening and the critic's value loss over the corrected mask). verl's current option names: test_rollout_rejection.

Runs where: in the pytest process (tensor functions; no ranks).
"""
import math

import pytest
import torch

from mindspeed_rl.algorithms.grpo import GRPOLossConfig, grpo_loss, ppo_clip_policy_loss
from mindspeed_rl.algorithms.rollout_correction import rollout_correction
from mindspeed_rl.config.rollout_correction import RolloutCorrectionConfig
from mindspeed_rl.errors import ConfigError

MASK = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0], [1.0, 0.0, 0.0]])
OLD = torch.tensor([[-1.0, -2.0, -0.5], [-0.3, -1.2, 0.0], [-4.0, 0.0, 0.0]])
ROLLOUT = torch.tensor([[-1.2, -1.0, -0.5], [-0.3, -2.0, 0.0], [-0.5, 0.0, 0.0]])
LOG_RATIO = (OLD - ROLLOUT) * MASK  # [[0.2, -1, 0], [0, 0.8, -], [-3.5, -, -]]; per sequence -0.8, 0.8, -3.5


def _correct(**keys):
    return rollout_correction(OLD, ROLLOUT, MASK, RolloutCorrectionConfig(**keys))


def test_token_importance_weights_are_the_truncated_ratio():
    weights, kept, metrics = _correct(rollout_is="token", rollout_is_threshold=2.0)
    want = LOG_RATIO.exp().clamp(max=2.0) * MASK
    torch.testing.assert_close(weights, want)
    assert torch.equal(kept, MASK)
    assert metrics["rollout_corr/rollout_is_mean"] == pytest.approx((LOG_RATIO.exp() * MASK).sum().item() / 6)
    assert metrics["rollout_corr/rollout_is_max"] == pytest.approx(math.exp(0.8))  # before truncation
    assert metrics["rollout_corr/rollout_is_min"] == pytest.approx(math.exp(-3.5))
    assert metrics["rollout_corr/rollout_is_ratio_fraction_high"] == pytest.approx(1 / 6)  # e^0.8 > 2
    assert metrics["rollout_corr/rollout_is_ratio_fraction_low"] == pytest.approx(2 / 6)  # e^-1, e^-3.5 < 0.5


def test_sequence_importance_weights_are_the_truncated_product():
    weights, _, metrics = _correct(rollout_is="sequence", rollout_is_threshold=2.0)
    per_sequence = torch.tensor([math.exp(-0.8), min(math.exp(0.8), 2.0), math.exp(-3.5)])
    torch.testing.assert_close(weights, per_sequence[:, None] * MASK)
    assert metrics["rollout_corr/rollout_is_ratio_fraction_high"] == pytest.approx(1 / 3)
    # verl's per-sequence statistics of the weights before truncation
    assert metrics["rollout_corr/rollout_is_seq_max"] == pytest.approx(math.exp(0.8))
    assert metrics["rollout_corr/rollout_is_seq_fraction_high"] == pytest.approx(1 / 3)
    assert metrics["rollout_corr/rollout_is_seq_max_deviation"] == pytest.approx(math.exp(0.8) - 1)


def test_batch_normalised_weights_have_mean_one():
    weights, _, metrics = _correct(rollout_is="token", rollout_is_batch_normalize=True)
    assert (weights * MASK).sum().item() / MASK.sum().item() == pytest.approx(1.0)
    assert metrics["rollout_corr/rollout_is_batch_norm_factor"] > 0


@pytest.mark.parametrize("level, threshold, kept_rows", [
    ("token", 2.0, [[1, 0, 1], [1, 0, 0], [0, 0, 0]]),  # e^-1, e^0.8 and e^-3.5 outside [1/2, 2]
    ("sequence", 2.5, [[1, 1, 1], [1, 1, 0], [0, 0, 0]]),  # e^-0.8, e^0.8 inside [0.4, 2.5]; e^-3.5 outside
    ("geometric", 2.0, [[1, 1, 1], [1, 1, 0], [0, 0, 0]]),  # e^(-0.8/3), e^0.4 inside [1/2, 2]; e^-3.5 outside
])
def test_the_older_rejection_names_drop_what_lies_outside_the_bounds(level, threshold, kept_rows):
    _, kept, metrics = _correct(rollout_rs=level, rollout_rs_threshold=threshold)
    assert kept.tolist() == [[float(v) for v in row] for row in kept_rows]
    rejected_tokens = ((1 - kept) * MASK).sum().item()
    assert metrics["rollout_corr/rollout_rs_masked_fraction"] == pytest.approx(rejected_tokens / 6)


def test_the_veto_drops_a_sequence_with_one_catastrophic_token():
    _, kept, metrics = _correct(rollout_token_veto_threshold=0.05)  # e^-3.5 = 0.03 < 0.05
    assert kept.tolist() == [[1, 1, 1], [1, 1, 0], [0, 0, 0]]
    assert metrics["rollout_corr/rollout_is_veto_fraction"] == pytest.approx(1 / 3)
    assert metrics["rollout_corr/rollout_is_catastrophic_token_fraction"] == pytest.approx(1 / 6)


def test_the_divergence_metrics_by_hand():
    _, _, metrics = _correct(rollout_is="token")
    valid = MASK.bool()
    k1 = (ROLLOUT - OLD)[valid].mean().item()
    r = LOG_RATIO[valid]
    assert metrics["rollout_corr/kl"] == pytest.approx(k1)
    assert metrics["rollout_corr/k3_kl"] == pytest.approx((r.exp() - r - 1).mean().item())
    assert metrics["rollout_corr/chi2_token"] == pytest.approx((r.exp() ** 2).mean().item() - 1)
    sequences = torch.tensor([-0.8, 0.8, -3.5])
    assert metrics["rollout_corr/chi2_seq"] == pytest.approx((2 * sequences).exp().mean().item() - 1)


def test_bad_values_are_config_errors():
    assert not RolloutCorrectionConfig().enabled
    for keys, key in ((dict(preset="nope"), "preset"), (dict(rollout_is="batch"), "rollout_is"),
                      (dict(rollout_rs="token_k1"), "rollout_rs_threshold"),
                      (dict(rollout_rs="token"), "rollout_rs_threshold"),
                      (dict(rollout_is="token", rollout_is_threshold=0.0), "rollout_is_threshold"),
                      (dict(rollout_token_veto_threshold=0.0), "rollout_token_veto_threshold")):
        with pytest.raises(ConfigError, match=f"rl_config.rollout_correction.{key}"):
            RolloutCorrectionConfig(**keys)


def test_the_weights_scale_each_tokens_policy_loss():
    g = torch.Generator().manual_seed(0)
    logprobs, old = -torch.rand(3, 3, generator=g), -torch.rand(3, 3, generator=g)
    advantages, weights = torch.randn(3, generator=g), torch.rand(3, 3, generator=g) * MASK
    config = GRPOLossConfig(kl_coef=0.0)
    _, stats = grpo_loss(logprobs=logprobs, old_logprobs=old, ref_logprobs=None, advantages=advantages,
                         response_mask=MASK, entropy=None, config=config, is_weights=weights)
    tokens, _, _, _ = ppo_clip_policy_loss(logprobs, old, advantages, MASK, 0.2)
    assert stats["actor/pg_loss"] == pytest.approx(((tokens * weights).sum() / MASK.sum()).item(), rel=1e-6)


def test_the_batch_step_takes_rejected_tokens_out_of_the_loss_mask():
    from types import SimpleNamespace

    from mindspeed_rl.protocol import RolloutBatch
    from mindspeed_rl.trainer.rollout_correction_step import correct_rollout

    batch = RolloutBatch.from_token_lists([[1, 2]] * 3, [[3, 4, 5], [3, 4], [3]], pad_id=0, response_width=3)
    batch.columns.update(old_logprobs=OLD, rollout_logprobs=ROLLOUT)
    rl = SimpleNamespace(rollout_correction=RolloutCorrectionConfig(rollout_is="token", rollout_rs="token_k1",
                                                                   rollout_rs_threshold="0.5_2.0"))
    metrics = correct_rollout(batch, rl)
    assert batch.loss_mask().tolist() == [[1, 0, 1], [1, 0, 0], [0, 0, 0]]
    assert "rollout_is_weights" in batch.columns and metrics["rollout_corr/rollout_rs_masked_fraction"] > 0
    assert correct_rollout(batch, SimpleNamespace(rollout_correction=RolloutCorrectionConfig())) == {}


# --- PPO with rejected tokens, as verl: its trainer overwrites response_mask with the corrected mask before
# compute_advantage and the critic's update, so GAE, the whitening and the value loss see the kept tokens only.

def _verl_gae(rewards, values, mask, gamma, lam):
    """verl's compute_gae_advantage_return and masked_whiten (core_algos.py, torch_functional.py), written out."""
    next_values, last, reversed_advantages = 0.0, 0.0, []
    for t in reversed(range(rewards.shape[-1])):
        delta = rewards[:, t] + gamma * next_values - values[:, t]
        last_ = delta + gamma * lam * last
        next_values = values[:, t] * mask[:, t] + (1 - mask[:, t]) * next_values
        last = last_ * mask[:, t] + (1 - mask[:, t]) * last
        reversed_advantages.append(last)
    advantages = torch.stack(reversed_advantages[::-1], dim=1)
    returns = advantages + values
    mean = (advantages * mask).sum() / (mask.sum() + 1e-8)
    variance = ((advantages - mean) ** 2 * mask).sum() / (mask.sum() + 1e-8) * mask.sum() / (mask.sum() - 1)
    return (advantages - mean) * torch.rsqrt(variance + 1e-8), returns


def _ppo_estimate(monkeypatch, batch, scores, values, *, gamma=1.0, lam=1.0):
    """CriticAdvantageStep.estimate on `batch` with the critic's values given."""
    from types import SimpleNamespace

    from mindspeed_rl.trainer import critic_step

    monkeypatch.setattr(critic_step, "forward_logprobs", lambda group, method, b: (values, {}))
    step = object.__new__(critic_step.CriticAdvantageStep)
    step.rl, step.actor_group = SimpleNamespace(use_kl_in_reward=False, gamma=gamma, lam=lam), None
    step.estimate(batch, SimpleNamespace(total=scores))
    return batch.columns["advantages"], batch.columns["returns"]


def _corrected_batch(responses, old, rollout, **keys):
    from types import SimpleNamespace

    from mindspeed_rl.protocol import RolloutBatch
    from mindspeed_rl.trainer.rollout_correction_step import correct_rollout

    batch = RolloutBatch.from_token_lists([[1, 2]] * len(responses), responses, pad_id=0,
                                          response_width=max(map(len, responses)))
    batch.columns.update(old_logprobs=old, rollout_logprobs=rollout)
    correct_rollout(batch, SimpleNamespace(rollout_correction=RolloutCorrectionConfig(**keys)))
    return batch


def test_ppo_advantages_skip_a_rejected_token_as_verls(monkeypatch):
    """The issue's oracle: two responses of 2 tokens, rewards [1, 0], values 0, gamma = lambda = 1, the last token
    of response 0 rejected (r = e^2 > 2): verl's advantage and return at its first token are 0 (the reward sat on the
    rejected token); with the uncorrected mask they were 0.866 and 1."""
    old, rollout = torch.full((2, 2), -1.0), torch.tensor([[-1.0, -3.0], [-1.0, -1.0]])
    batch = _corrected_batch([[3, 4], [5, 6]], old, rollout, rollout_rs="token_k1", rollout_rs_threshold="0.5_2.0")
    mask = batch.loss_mask()
    assert mask.tolist() == [[1, 0], [1, 1]]
    advantages, returns = _ppo_estimate(monkeypatch, batch, torch.tensor([1.0, 0.0]), torch.zeros(2, 2))
    assert advantages[0, 0].item() == 0.0 and returns[0, 0].item() == 0.0
    want_advantages, want_returns = _verl_gae(torch.tensor([[0.0, 1.0], [0.0, 0.0]]), torch.zeros(2, 2), mask, 1, 1)
    torch.testing.assert_close(advantages * mask, want_advantages * mask)
    torch.testing.assert_close(returns * mask, want_returns * mask)
    uncorrected, _ = _verl_gae(torch.tensor([[0.0, 1.0], [0.0, 0.0]]), torch.zeros(2, 2), batch.response_mask, 1, 1)
    assert uncorrected[0, 0].item() == pytest.approx(0.866, abs=1e-3)  # what the uncorrected mask gave


@pytest.mark.parametrize("keys", [dict(rollout_rs="token_k1", rollout_rs_threshold="0.5_2.0"),
                                  dict(rollout_rs="seq_sum_k1", rollout_rs_threshold="0.4_2.5"),
                                  dict(rollout_rs="seq_max_k3", rollout_rs_threshold="0.4", rollout_is="token")])
def test_ppo_advantages_and_returns_are_verls_over_the_corrected_mask(monkeypatch, keys):
    """Token and sequence level: GAE with gamma 0.9, lambda 0.8 and random values over the mask the rejection
    left, whitened over the kept tokens only (their mean 0, their unbiased std 1)."""
    g = torch.Generator().manual_seed(3)
    batch = _corrected_batch([[3, 4, 5], [3, 4], [3]], OLD, ROLLOUT, **keys)
    mask = batch.loss_mask()
    assert 0 < mask.sum() < batch.response_mask.sum()  # something was rejected, something kept
    values, scores = torch.randn(3, 3, generator=g) * batch.response_mask, torch.tensor([1.0, 0.5, -1.0])
    advantages, returns = _ppo_estimate(monkeypatch, batch, scores, values, gamma=0.9, lam=0.8)
    rewards = torch.zeros(3, 3)
    rewards[[0, 1, 2], [2, 1, 0]] = scores  # on each response's last token, rejected or not (verl's scores)
    want_advantages, want_returns = _verl_gae(rewards, values, mask, 0.9, 0.8)
    torch.testing.assert_close(advantages * mask, want_advantages * mask)
    torch.testing.assert_close(returns * mask, want_returns * mask)
    kept = advantages[mask.bool()].double()
    assert kept.mean().item() == pytest.approx(0.0, abs=1e-6)
    if kept.numel() > 1:
        assert kept.std().item() == pytest.approx(1.0, abs=1e-4)


def test_the_critics_value_loss_skips_rejected_tokens(monkeypatch):
    """update_critic's clipped value loss over the kept tokens: token-mean of 0.5 (V - R)^2 where the rejection
    left the mask (verl's critic reads the corrected response_mask)."""
    from types import SimpleNamespace

    from mindspeed_rl.workers.actor_steps import MiniBatchShuffler
    from mindspeed_rl.workers.critic_steps import update_critic

    batch = _corrected_batch([[3, 4, 5], [3, 4], [3]], OLD, ROLLOUT, rollout_rs="token_k1",
                             rollout_rs_threshold="0.5_2.0")
    mask = batch.loss_mask()
    returns = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 0.0], [6.0, 0.0, 0.0]]) * batch.response_mask
    batch.columns.update(values=torch.zeros(3, 3), returns=returns)
    new_values = torch.full((3, 3), 0.5)

    class Critic:
        parallel = SimpleNamespace(dp=1)

        def over_data_parallel(self, value):
            return value

        def train_step(self, mini_batch, *, micro_batch_size, loss_fn, packing):
            stats = {}
            for mb in mini_batch.micro_batches(micro_batch_size, torch.device("cpu")):
                _, mb_stats = loss_fn(new_values[mb.sample_indices], mb)
                stats = {k: stats.get(k, 0.0) + v for k, v in mb_stats.items()}
            return stats | {"critic/lr": 1e-3}

    rl = SimpleNamespace(loss_agg_mode="token-mean", token_level_loss=True, epochs=1, mini_batch_size_in_samples=3,
                         use_remove_padding=False, cliprange_value=100.0)
    config = SimpleNamespace(rl_config=rl, response_length_limit=3, critic_config=SimpleNamespace(micro_batch_size=3))
    metrics = update_critic(Critic(), config, batch, MiniBatchShuffler(seed=0, shuffle=False))
    want = 0.5 * (((new_values - returns) ** 2) * mask).sum() / mask.sum()
    assert metrics["critic/vf_loss"] == pytest.approx(want.item())
    everything = 0.5 * (((new_values - returns) ** 2) * batch.response_mask).sum() / batch.response_mask.sum()
    assert want.item() != pytest.approx(everything.item())
