"""verl's current rollout-correction names (its 97eac9048, 2026-01-14): the `rollout_rs` options token_k1/k2/k3,
seq_sum_k1/k2/k3, seq_mean_k1/k2/k3, seq_max_k2/k3 and comma lists against verl's formulas (transcribed below from its
rollout_corr_helper.compute_rollout_rejection_mask), the "lower_upper" threshold strings, its presets as they are now,
`bypass_mode` / `loss_type` refused by name, the older names mapped with one deprecation line each, and `k3_kl`
unclamped as verl computes it.

Runs where: in the pytest process (tensor functions and config loading; no ranks).
"""
import math
from pathlib import Path

import pytest
import torch
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from mindspeed_rl.algorithms.rollout_correction import rollout_correction
from mindspeed_rl.config import load_config
from mindspeed_rl.config.rollout_correction import BYPASS_PRESETS, RS_OPTIONS, RolloutCorrectionConfig, rs_thresholds
from mindspeed_rl.errors import ConfigError

CONFIG_DIR = Path(__file__).resolve().parents[1] / "configs"
MASK = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0], [1.0, 0.0, 0.0]])
OLD = torch.tensor([[-1.0, -2.0, -0.5], [-0.3, -1.2, 0.0], [-4.0, 0.0, 0.0]])
ROLLOUT = torch.tensor([[-1.2, -1.0, -0.5], [-0.3, -2.0, 0.0], [-0.5, 0.0, 0.0]])
LOG_RATIO = (OLD - ROLLOUT) * MASK  # [[0.2, -1, 0], [0, 0.8, -], [-3.5, -, -]]


def _verl_keep(option: str, log_ratio: torch.Tensor, mask: torch.Tensor, lower, upper) -> torch.Tensor:
    """verl's compute_rollout_rejection_mask for one option, written out: the [B, R] keep mask."""
    safe = log_ratio.clamp(-20.0, 20.0)
    token = {"k1": -safe, "k2": 0.5 * safe ** 2, "k3": torch.exp(safe) - 1.0 - safe}[option[-2:]]
    if option.startswith("token"):
        stat = token
    else:
        if option.startswith("seq_sum"):
            seq = (token * mask).sum(-1)
        elif option.startswith("seq_mean"):
            seq = (token * mask).sum(-1) / (mask.sum(-1) + 1e-8)
        else:
            seq = token.masked_fill(~mask.bool(), float("-inf")).max(-1).values
            seq = torch.where(seq == float("-inf"), torch.zeros_like(seq), seq)
        stat = seq.unsqueeze(-1).expand_as(mask)
    if option.endswith("k1"):
        keep = (stat >= math.log(lower)) & (stat <= math.log(upper))
    else:
        keep = stat <= upper
    return keep.to(mask.dtype)


def _kept(rollout_rs, threshold, **keys):
    return rollout_correction(OLD, ROLLOUT, MASK, RolloutCorrectionConfig(
        rollout_rs=rollout_rs, rollout_rs_threshold=threshold, **keys))


THRESHOLDS = {"k1": "0.4_2.5", "k2": "0.3", "k3": "0.4"}


@pytest.mark.parametrize("option", RS_OPTIONS)
def test_each_option_keeps_what_verls_formula_keeps(option):
    threshold = THRESHOLDS[option[-2:]]
    _, kept, metrics = _kept(option, threshold)
    lower, upper = (float(x) for x in threshold.split("_")) if "_" in threshold else (None, float(threshold))
    want = MASK * _verl_keep(option, LOG_RATIO, MASK, lower, upper)
    assert torch.equal(kept, want)
    rejected = ((1 - want) * MASK).sum().item() / MASK.sum().item()
    assert metrics[f"rollout_corr/rollout_rs_{option}_masked_fraction"] == pytest.approx(rejected)
    assert metrics["rollout_corr/rollout_rs_masked_fraction"] == pytest.approx(rejected)
    assert f"rollout_corr/rollout_rs_{option}_mean" in metrics and f"rollout_corr/rollout_rs_{option}_std" in metrics


@pytest.mark.parametrize("option, threshold, rows", [
    ("token_k1", "0.5_2.0", [[1, 0, 1], [1, 0, 0], [0, 0, 0]]),  # r = e^-1, e^0.8, e^-3.5 outside [0.5, 2]
    ("token_k1", "0.3_1.5", [[1, 0, 1], [1, 1, 0], [0, 0, 0]]),  # -log r in [log .3, log 1.5]: r in [1/1.5, 1/.3]
    ("token_k1", 2.0, [[1, 0, 1], [1, 0, 0], [0, 0, 0]]),  # one number: the upper, the lower 1 / upper
    ("token_k2", "0.3", [[1, 0, 1], [1, 0, 0], [0, 0, 0]]),  # 0.5 (log r)^2 = 0.02, 0.5, 0 | 0, 0.32 | 6.1
    ("token_k3", "0.4", [[1, 1, 1], [1, 0, 0], [0, 0, 0]]),  # r - 1 - log r = 0.021, 0.368, 0 | 0, 0.426 | 2.53
    ("seq_sum_k1", "0.4_2.5", [[1, 1, 1], [1, 1, 0], [0, 0, 0]]),  # sums of -log r 0.8, -0.8, 3.5 vs +-0.92
    ("seq_sum_k1", "0.5_2.0", [[0, 0, 0], [0, 0, 0], [0, 0, 0]]),  # ... vs +-0.69
    ("seq_mean_k1", "0.5_2.0", [[1, 1, 1], [1, 1, 0], [0, 0, 0]]),  # means 0.27, -0.4, 3.5
    ("seq_max_k3", "0.4", [[1, 1, 1], [0, 0, 0], [0, 0, 0]]),  # maxima 0.368, 0.426, 2.53
    ("token_k1,seq_max_k3", "0.5_2.0,0.4", [[1, 0, 1], [0, 0, 0], [0, 0, 0]]),  # both must pass
    ("seq_max_k3,seq_max_k3", "0.4", [[1, 1, 1], [0, 0, 0], [0, 0, 0]]),  # duplicates dropped
])
def test_hand_checked_rejections(option, threshold, rows):
    _, kept, _ = _kept(option, threshold)
    assert kept.tolist() == [[float(v) for v in row] for row in rows]


def test_a_comma_list_reports_each_option_and_the_whole():
    _, kept, metrics = _kept("token_k1,seq_max_k3", "0.5_2.0,0.4")
    assert metrics["rollout_corr/rollout_rs_token_k1_masked_fraction"] == pytest.approx(3 / 6)
    assert metrics["rollout_corr/rollout_rs_seq_max_k3_masked_fraction"] == pytest.approx(3 / 6)
    assert metrics["rollout_corr/rollout_rs_masked_fraction"] == pytest.approx(4 / 6)
    assert metrics["rollout_corr/rollout_rs_seq_masked_fraction"] == pytest.approx(1.0)  # rows 1, 2 gone; row 0 a hole
    assert metrics["rollout_corr/rollout_rs_seq_max_k3_seq_max"] == pytest.approx(math.exp(-3.5) + 2.5)
    # k1's statistic is -log r, bounded in log space: its fractions count -log r above log 2 and below log 0.5.
    assert metrics["rollout_corr/rollout_rs_token_k1_fraction_high"] == pytest.approx(2 / 6)  # r = e^-1, e^-3.5
    assert metrics["rollout_corr/rollout_rs_token_k1_fraction_low"] == pytest.approx(1 / 6)  # r = e^0.8


def test_the_threshold_strings_parse_as_verls():
    assert rs_thresholds(["token_k1"], "0.5_2.0") == {"token_k1": (0.5, 2.0)}
    assert rs_thresholds(["seq_sum_k1"], 4.0) == {"seq_sum_k1": (0.25, 4.0)}
    assert rs_thresholds(["seq_mean_k3"], "0.01") == {"seq_mean_k3": (None, 0.01)}
    assert rs_thresholds(["token_k1", "seq_max_k2"], "0.5_2.0, 0.2") == {"token_k1": (0.5, 2.0),
                                                                         "seq_max_k2": (None, 0.2)}
    assert rs_thresholds(["token_k2", "token_k3"], "0.3") == {"token_k2": (None, 0.3), "token_k3": (None, 0.3)}
    for options, spec, why in ((["token_k1"], None, "must be given"), (["token_k2"], "0.1_0.2", "without '_'"),
                               (["token_k1", "token_k2", "token_k3"], "1,2", "one per option"),
                               (["token_k1"], "0_2", "numbers > 0"), (["token_k3"], "-1", "numbers > 0"),
                               (["seq_sum_k1"], "a_b", "numbers > 0")):
        with pytest.raises(ConfigError, match=why):
            rs_thresholds(options, spec)


def test_the_config_takes_a_number_or_a_string_from_yaml_and_the_command_line():
    schema = OmegaConf.structured(RolloutCorrectionConfig)
    config = OmegaConf.to_object(OmegaConf.merge(schema, {"rollout_rs": "token_k1", "rollout_rs_threshold": 2.0}))
    assert config.rollout_rs_threshold == "2.0" and config.deprecations == []
    with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base="1.3"):
        loaded = load_config(compose(config_name="grpo_tiny_cpu", overrides=[
            "rl_config.rollout_correction.rollout_rs=token_k1",
            "rl_config.rollout_correction.rollout_rs_threshold=0.5_2.0"]))
    assert loaded.rl_config.rollout_correction.rollout_rs_threshold == "0.5_2.0"
    assert loaded.rl_config.rollout_correction.enabled


# verl's RolloutCorrectionConfig factory methods at 97eac9048 with their defaults (verl/trainer/config/algorithm.py).
VERL_PRESETS = {
    "disabled": (None, 2.0, None, None),
    "decoupled_token_is": ("token", 2.0, None, None),
    "decoupled_seq_is": ("sequence", 2.0, None, None),
    "decoupled_seq_is_rs": ("sequence", 2.0, "seq_sum_k1", "0.5_2.0"),
    "decoupled_geo_rs": (None, 2.0, "seq_mean_k1", "0.999_1.001"),
    "decoupled_geo_rs_seq_tis": ("sequence", 2.0, "seq_mean_k1", "0.999_1.001"),
    "decoupled_geo_rs_token_tis": ("token", 2.0, "seq_mean_k1", "0.999_1.001"),
    "decoupled_k3_rs": (None, 2.0, "seq_mean_k3", "0.01"),
    "decoupled_k3_rs_seq_tis": ("sequence", 2.0, "seq_mean_k3", "0.01"),
    "decoupled_k3_rs_token_tis": ("token", 2.0, "seq_mean_k3", "0.01"),
}


@pytest.mark.parametrize("preset", VERL_PRESETS)
def test_each_preset_is_verls_factory_method(preset):
    config = RolloutCorrectionConfig(preset=preset)
    got = (config.rollout_is, config.rollout_is_threshold, config.rollout_rs, config.rollout_rs_threshold)
    assert got == VERL_PRESETS[preset]
    assert config.rollout_token_veto_threshold is None and not config.bypass_mode and config.deprecations == []
    rollout_correction(OLD, ROLLOUT, MASK, config)  # runs


def test_decoupled_geo_rs_is_verls_new_rule_not_the_old_one():
    _, kept, metrics = rollout_correction(OLD, ROLLOUT, MASK, RolloutCorrectionConfig(preset="decoupled_geo_rs"))
    assert kept.sum() == 0  # no sequence's mean log ratio is within 0.1% of 0
    assert "rollout_corr/rollout_is_veto_fraction" not in metrics  # no veto any more


@pytest.mark.parametrize("keys, key, why", [
    (dict(bypass_mode=True), "bypass_mode", "bypass mode"),
    (dict(loss_type="reinforce"), "loss_type", "bypass-mode loss"),
    (dict(loss_type="pg"), "loss_type", "must be one of ppo_clip, reinforce"),
    (dict(rollout_rs="token_k4", rollout_rs_threshold="1"), "rollout_rs", "comma list of token_k1"),
    (dict(rollout_rs="seq_max_k1", rollout_rs_threshold="1"), "rollout_rs", "comma list"),  # verl has no seq_max_k1
] + [(dict(preset=name), "preset", "bypass-mode presets") for name in BYPASS_PRESETS])
def test_what_is_not_implemented_is_refused_by_name(keys, key, why):
    with pytest.raises(ConfigError, match=f"rl_config.rollout_correction.{key}: .*{why}"):
        RolloutCorrectionConfig(**keys)
    assert RolloutCorrectionConfig(loss_type="ppo_clip", bypass_mode=False).loss_type == "ppo_clip"


@pytest.mark.parametrize("level, option, upper, lower, string", [
    ("token", "token_k1", "2.0", None, "0.5_2.0"),
    ("sequence", "seq_sum_k1", "2.5", None, "0.4_2.5"),
    ("geometric", "seq_mean_k1", "1.001", None, f"{1 / 1.001!r}_1.001"),
    ("token", "token_k1", "2.5", 0.1, "0.4_10.0"),  # ratio within [0.1, 2.5]: -log r within [log 0.4, log 10]
])
def test_the_older_level_names_map_to_the_option_that_keeps_the_same_tokens(level, option, upper, lower, string):
    old_style = RolloutCorrectionConfig(rollout_rs=level, rollout_rs_threshold=upper,
                                        rollout_rs_threshold_lower=lower)
    assert (old_style.rollout_rs, old_style.rollout_rs_threshold, old_style.rollout_rs_threshold_lower) == (
        option, string, None)
    assert len(old_style.deprecations) == 1
    assert f"'{level}' is verl's name before 97eac9048" in old_style.deprecations[0]
    # What the old rule kept: the ratio (per token, its product, its geometric mean) within [lower, upper].
    upper_value, lower_value = float(upper), lower or 1 / float(upper)
    unit = {"token": LOG_RATIO, "sequence": LOG_RATIO.sum(-1, keepdim=True),
            "geometric": LOG_RATIO.sum(-1, keepdim=True) / MASK.sum(-1, keepdim=True)}[level].expand_as(MASK)
    want = MASK * ((unit >= math.log(lower_value)) & (unit <= math.log(upper_value))).float()
    assert torch.equal(rollout_correction(OLD, ROLLOUT, MASK, old_style)[1], want)


def test_the_older_lower_bound_and_the_veto_each_say_one_line():
    lower_only = RolloutCorrectionConfig(rollout_rs="seq_sum_k1", rollout_rs_threshold="2.5",
                                         rollout_rs_threshold_lower=0.5)
    assert lower_only.rollout_rs_threshold == "0.4_2.0" and len(lower_only.deprecations) == 1
    assert lower_only.deprecations[0].startswith("rl_config.rollout_correction.rollout_rs_threshold_lower: verl's key")
    with pytest.raises(ConfigError, match="rollout_rs_threshold_lower: .*one k1 option"):
        RolloutCorrectionConfig(rollout_rs="seq_mean_k3", rollout_rs_threshold="0.1", rollout_rs_threshold_lower=0.5)
    veto = RolloutCorrectionConfig(preset="decoupled_token_is", rollout_token_veto_threshold=0.05)
    assert len(veto.deprecations) == 1 and "seq_max_k2" in veto.deprecations[0]
    _, kept, metrics = rollout_correction(OLD, ROLLOUT, MASK, veto)  # e^-3.5 = 0.03 < 0.05: row 2 vetoed
    assert kept.tolist() == [[1, 1, 1], [1, 1, 0], [0, 0, 0]]
    assert metrics["rollout_corr/rollout_is_veto_fraction"] == pytest.approx(1 / 3)


def test_the_deprecation_lines_are_printed_at_start_once_each():
    from mindspeed_rl.config.tolerated import warning_lines

    with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base="1.3"):
        config = load_config(compose(config_name="grpo_tiny_cpu", overrides=[
            "rl_config.rollout_correction.rollout_rs=geometric",
            "rl_config.rollout_correction.rollout_rs_threshold=1.001",
            "rl_config.rollout_correction.rollout_token_veto_threshold=1e-4"]))
    deprecated = [line for line in warning_lines(config) if line.startswith("[config] deprecated: ")]
    assert len(deprecated) == 2
    assert "rollout_rs: 'geometric'" in deprecated[0] and "rollout_token_veto_threshold" in deprecated[1]


def test_k3_kl_is_not_clamped():
    old, rollout, mask = torch.tensor([[-0.5, -1.0]]), torch.tensor([[-25.0, -1.0]]), torch.ones(1, 2)
    _, _, metrics = rollout_correction(old, rollout, mask, RolloutCorrectionConfig(rollout_is="token"))
    assert metrics["rollout_corr/k3_kl"] == pytest.approx((math.exp(24.5) - 24.5 - 1) / 2, rel=1e-5)
