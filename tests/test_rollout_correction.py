"""Rollout correction (rl_config.rollout_correction) against verl's formulas, written here from its rollout_corr
helper: truncated importance weights per token and per sequence (and batch-normalised), rejection per token, per
sequence and by the geometric mean, the token veto, the divergence metrics; the presets; the loss it weighs; the
batch step that drops rejected tokens from the loss mask.

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


def test_batch_normalised_weights_have_mean_one():
    weights, _, metrics = _correct(rollout_is="token", rollout_is_batch_normalize=True)
    assert (weights * MASK).sum().item() / MASK.sum().item() == pytest.approx(1.0)
    assert metrics["rollout_corr/rollout_is_batch_norm_factor"] > 0


@pytest.mark.parametrize("level, threshold, kept_rows", [
    ("token", 2.0, [[1, 0, 1], [1, 0, 0], [0, 0, 0]]),  # e^-1, e^0.8 and e^-3.5 outside [1/2, 2]
    ("sequence", 2.5, [[1, 1, 1], [1, 1, 0], [0, 0, 0]]),  # e^-0.8, e^0.8 inside [0.4, 2.5]; e^-3.5 outside
    ("geometric", 2.0, [[1, 1, 1], [1, 1, 0], [0, 0, 0]]),  # e^(-0.8/3), e^0.4 inside [1/2, 2]; e^-3.5 outside
])
def test_rejection_drops_what_lies_outside_the_bounds(level, threshold, kept_rows):
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


def test_a_preset_fills_verls_keys_and_bad_values_are_config_errors():
    geo = RolloutCorrectionConfig(preset="decoupled_geo_rs")
    assert (geo.rollout_is, geo.rollout_rs, geo.rollout_rs_threshold, geo.rollout_token_veto_threshold) == (
        None, "geometric", 1.001, 1e-4)
    assert RolloutCorrectionConfig(preset="decoupled_token_is").rollout_is == "token"
    assert not RolloutCorrectionConfig().enabled
    for keys, key in ((dict(preset="nope"), "preset"), (dict(rollout_is="batch"), "rollout_is"),
                      (dict(rollout_rs="token"), "rollout_rs_threshold"),
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
    rl = SimpleNamespace(rollout_correction=RolloutCorrectionConfig(rollout_is="token", rollout_rs="token",
                                                                   rollout_rs_threshold=2.0))
    metrics = correct_rollout(batch, rl)
    assert batch.loss_mask().tolist() == [[1, 0, 1], [1, 0, 0], [0, 0, 0]]
    assert "rollout_is_weights" in batch.columns and metrics["rollout_corr/rollout_rs_masked_fraction"] > 0
    assert correct_rollout(batch, SimpleNamespace(rollout_correction=RolloutCorrectionConfig())) == {}
