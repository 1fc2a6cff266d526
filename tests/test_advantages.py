"""The critic-free advantage estimators (rl_config.adv_estimator) against hand computations of their papers'
formulas (verl's core_algos)."""

import math

import pytest
import torch

from mindspeed_rl.algorithms.advantages import compute_advantages, reinforce_plus_plus_advantages, rloo_advantages
from mindspeed_rl.algorithms.grpo import group_normalized_advantages


def test_rloo_baseline_is_the_mean_of_the_other_samples():
    rewards = torch.tensor([1.0, 0.0, 0.0, 1.0, 2.0, 2.0, 2.0, 5.0])
    # prompt 1: 1 - (0+0+1)/3, 0 - (1+0+1)/3, ...; prompt 2: 2 - (2+2+5)/3, ..., 5 - 2
    want = [1 - 1 / 3, -2 / 3, -2 / 3, 1 - 1 / 3, 2 - 3, 2 - 3, 2 - 3, 5 - 2]
    torch.testing.assert_close(rloo_advantages(rewards, 4), torch.tensor(want))


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
    ("reinforce_plus_plus", True, "rpp"),
])
def test_the_config_picks_the_estimator(estimator, normalize, want):
    from types import SimpleNamespace

    rewards, mask = torch.tensor([1.0, 0.0, 3.0, 1.0]), torch.ones(4, 2)
    rl = SimpleNamespace(adv_estimator=estimator, norm_adv_by_std_in_grpo=normalize, n_samples_per_prompt=2, gamma=1.0)
    expected = {"group": group_normalized_advantages(rewards, 2),
                "dr": group_normalized_advantages(rewards, 2, normalize_by_std=False),
                "rloo": rloo_advantages(rewards, 2), "rpp": reinforce_plus_plus_advantages(rewards, mask, 1.0)}[want]
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
