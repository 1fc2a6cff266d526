"""The DPO loss (mindspeed_rl/algorithms/dpo.py) against TRL's DPOTrainer formulas, written out here on their own:
sigmoid with label smoothing, hinge, ipo (per-token mean log-probs), kto_pair; the rewards, margin and accuracy."""
import pytest
import torch
import torch.nn.functional as F

from mindspeed_rl.algorithms.dpo import DPOLossConfig, dpo_loss, preference_accuracy


def trl_losses(pc, pr, rc, rr, loss_type: str, beta: float, ls: float = 0.0) -> torch.Tensor:
    """TRL's DPOTrainer.dpo_loss (trl/trainer/dpo_trainer.py), per pair."""
    pi_logratios = pc - pr
    ref_logratios = rc - rr
    logits = pi_logratios - ref_logratios
    if loss_type == "sigmoid":
        return -F.logsigmoid(beta * logits) * (1 - ls) - F.logsigmoid(-beta * logits) * ls
    if loss_type == "hinge":
        return torch.relu(1 - beta * logits)
    if loss_type == "ipo":
        return (logits - 1 / (2 * beta)) ** 2
    if loss_type == "kto_pair":
        chosen_kl = (pc - rc).mean().clamp(min=0)
        rejected_kl = (pr - rr).mean().clamp(min=0)
        both = torch.cat((1 - F.sigmoid(beta * ((pc - rc) - rejected_kl)),
                          1 - F.sigmoid(beta * (chosen_kl - (pr - rr)))), 0)
        return both.view(2, -1).mean(0)  # a pair's share of their 2P-value mean
    raise AssertionError(loss_type)


def random_batch(pairs: int = 5, width: int = 6, seed: int = 0):
    generator = torch.Generator().manual_seed(seed)
    logprobs = -torch.rand(2 * pairs, width, generator=generator, dtype=torch.float64) * 3
    ref = -torch.rand(2 * pairs, width, generator=generator, dtype=torch.float64) * 3
    lengths = torch.randint(1, width + 1, (2 * pairs,), generator=generator)
    mask = (torch.arange(width).unsqueeze(0) < lengths.unsqueeze(1)).double()
    return logprobs, ref, mask


@pytest.mark.parametrize("loss_type,beta,ls", [("sigmoid", 0.1, 0.0), ("sigmoid", 0.5, 0.2), ("hinge", 0.3, 0.0),
                                               ("ipo", 0.1, 0.0), ("kto_pair", 0.2, 0.0)])
def test_the_loss_is_trls_formula_on_summed_or_mean_logprobs(loss_type: str, beta: float, ls: float) -> None:
    logprobs, ref, mask = random_batch()
    sums, ref_sums, lengths = (logprobs * mask).sum(-1), (ref * mask).sum(-1), mask.sum(-1)
    if loss_type == "ipo":  # TRL and MindSpeed-LLM: IPO compares per-token means
        sums, ref_sums = sums / lengths, ref_sums / lengths
    expected = trl_losses(sums[0::2], sums[1::2], ref_sums[0::2], ref_sums[1::2], loss_type, beta, ls).mean()
    config = DPOLossConfig(loss_type=loss_type, beta=beta, label_smoothing=ls)
    loss, stats = dpo_loss(logprobs, ref, mask, config, pairs_in_mini_batch=5)
    torch.testing.assert_close(loss, expected)
    assert stats["dpo/loss"] == pytest.approx(float(expected))


def test_rewards_margin_and_accuracy_are_trls() -> None:
    logprobs, ref, mask = random_batch(pairs=8, seed=3)
    beta = 0.25
    sums, ref_sums = (logprobs * mask).sum(-1), (ref * mask).sum(-1)
    chosen_rewards = beta * (sums[0::2] - ref_sums[0::2])
    rejected_rewards = beta * (sums[1::2] - ref_sums[1::2])
    _, stats = dpo_loss(logprobs, ref, mask, DPOLossConfig(beta=beta), pairs_in_mini_batch=8)
    assert stats["dpo/chosen_reward"] == pytest.approx(float(chosen_rewards.mean()))
    assert stats["dpo/rejected_reward"] == pytest.approx(float(rejected_rewards.mean()))
    assert stats["dpo/reward_margin"] == pytest.approx(float((chosen_rewards - rejected_rewards).mean()))
    assert stats["dpo/accuracy"] == pytest.approx(float((chosen_rewards > rejected_rewards).float().mean()))
    held_out = preference_accuracy(sums, ref_sums, beta=beta)
    assert held_out["accuracy"] == pytest.approx(stats["dpo/accuracy"])
    assert held_out["reward_margin"] == pytest.approx(stats["dpo/reward_margin"])


def test_micro_batch_shares_add_up_to_the_mini_batch_mean() -> None:
    logprobs, ref, mask = random_batch(pairs=6, seed=5)
    config = DPOLossConfig(beta=0.1, pref_ftx=0.5)
    whole, whole_stats = dpo_loss(logprobs, ref, mask, config, pairs_in_mini_batch=6)
    parts = [dpo_loss(logprobs[i:i + 4], ref[i:i + 4], mask[i:i + 4], config, pairs_in_mini_batch=6)
             for i in range(0, 12, 4)]
    torch.testing.assert_close(sum(loss for loss, _ in parts), whole)
    for key, value in whole_stats.items():
        assert sum(stats[key] for _, stats in parts) == pytest.approx(value)


def test_pref_ftx_adds_the_chosen_mean_nll() -> None:
    logprobs, ref, mask = random_batch(pairs=4, seed=7)
    plain, _ = dpo_loss(logprobs, ref, mask, DPOLossConfig(), pairs_in_mini_batch=4)
    with_sft, stats = dpo_loss(logprobs, ref, mask, DPOLossConfig(pref_ftx=0.3), pairs_in_mini_batch=4)
    chosen = logprobs[0::2] * mask[0::2]
    nll = (-chosen.sum(-1) / mask[0::2].sum(-1)).mean()
    torch.testing.assert_close(with_sft, plain + 0.3 * nll)
    assert stats["dpo/sft_loss"] == pytest.approx(float(nll))


def test_the_gradient_raises_chosen_and_lowers_rejected() -> None:
    logprobs, ref, mask = random_batch(pairs=3, seed=9)
    logprobs.requires_grad_(True)
    loss, _ = dpo_loss(logprobs, ref, mask, DPOLossConfig(), pairs_in_mini_batch=3)
    loss.backward()
    assert (logprobs.grad[0::2][mask[0::2] > 0] < 0).all()  # descending raises the chosen log-probs
    assert (logprobs.grad[1::2][mask[1::2] > 0] > 0).all()


@pytest.mark.parametrize("kwargs", [dict(loss_type="orpo"), dict(beta=0.0), dict(label_smoothing=0.6),
                                    dict(pref_ftx=-1.0)])
def test_bad_settings_are_refused(kwargs: dict) -> None:
    with pytest.raises(ValueError):
        DPOLossConfig(**kwargs)


def test_an_odd_batch_is_refused() -> None:
    with pytest.raises(ValueError, match="even number"):
        dpo_loss(torch.zeros(3, 2), torch.zeros(3, 2), torch.ones(3, 2), DPOLossConfig(), pairs_in_mini_batch=1)
