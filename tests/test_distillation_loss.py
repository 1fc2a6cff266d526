"""On-policy distillation losses (mindspeed_rl.algorithms.distillation) against closed forms and
torch.distributions oracles computed in float64, as verl defines them (docs/algo/opd.md)."""

import pytest
import torch
import torch.nn.functional as F
from torch.distributions import Categorical, kl_divergence

from mindspeed_rl.algorithms.distillation import (
    distillation_token_losses,
    pg_opd_token_rewards,
)

SAMPLES, TOKENS, VOCAB = 3, 5, 11


def _logits(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(student, teacher) logits [samples, tokens, vocab], float64."""
    gen = torch.Generator().manual_seed(seed)
    return (
        torch.randn(SAMPLES, TOKENS, VOCAB, generator=gen, dtype=torch.float64),
        2.0 * torch.randn(SAMPLES, TOKENS, VOCAB, generator=gen, dtype=torch.float64),
    )


def _topk_inputs(student_logits: torch.Tensor, teacher_logits: torch.Tensor, k: int):
    """(student log-probs at the teacher's top-k ids, teacher top-k log-probs), via sort, not topk."""
    teacher_lp = teacher_logits.log_softmax(-1)
    ids = teacher_lp.argsort(dim=-1, descending=True)[..., :k]
    return student_logits.log_softmax(-1).gather(-1, ids), teacher_lp.gather(-1, ids)


def _full_forward_kl(student_logits: torch.Tensor, teacher_logits: torch.Tensor) -> torch.Tensor:
    return kl_divergence(Categorical(logits=teacher_logits), Categorical(logits=student_logits))


def _sampled_logprobs(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    student = -torch.rand(SAMPLES, TOKENS, generator=gen, dtype=torch.float64) * 3
    teacher = -torch.rand(SAMPLES, TOKENS, generator=gen, dtype=torch.float64) * 3
    return student, teacher


@pytest.mark.parametrize("loss_mode", ["k1", "kl"])
def test_k1_estimator_is_student_minus_teacher_with_unit_gradient_to_the_student_only(loss_mode):
    student, teacher = _sampled_logprobs(0)
    student.requires_grad_(True)
    teacher.requires_grad_(True)
    losses, diagnostics = distillation_token_losses(
        loss_mode=loss_mode, student_logprobs=student, teacher_logprobs=teacher
    )
    torch.testing.assert_close(losses, (student - teacher).detach())
    assert diagnostics == {}
    losses.sum().backward()
    torch.testing.assert_close(student.grad, torch.ones_like(student))
    assert teacher.grad is None


@pytest.mark.parametrize("loss_mode", ["k3", "low_var_kl"])
def test_k3_estimator_is_schulman_closed_form_with_gradient_to_the_student_only(loss_mode):
    student, teacher = _sampled_logprobs(1)
    student.requires_grad_(True)
    teacher.requires_grad_(True)
    losses, _ = distillation_token_losses(loss_mode=loss_mode, student_logprobs=student, teacher_logprobs=teacher)
    d = (teacher - student).detach()
    torch.testing.assert_close(losses, d.exp() - d - 1)
    losses.sum().backward()
    torch.testing.assert_close(student.grad, 1 - d.exp())  # d/ds of exp(t-s) - (t-s) - 1
    assert teacher.grad is None


def test_pg_opd_k1_reward_is_teacher_minus_student_and_detached():
    student, teacher = _sampled_logprobs(2)
    student.requires_grad_(True)
    rewards = pg_opd_token_rewards(student, teacher, "k1")
    torch.testing.assert_close(rewards, (teacher - student).detach())
    assert not rewards.requires_grad
    with pytest.raises(ValueError):
        pg_opd_token_rewards(student, teacher, "forward_kl_topk")
    clamped = pg_opd_token_rewards(student, teacher, "k1", loss_max_clamp=0.1)  # verl clamps the loss to [-c, c]
    torch.testing.assert_close(clamped, torch.clamp(teacher - student, -0.1, 0.1).detach())


def test_forward_kl_topk_over_the_whole_vocabulary_is_the_full_forward_kl():
    student_logits, teacher_logits = _logits(4)
    student_topk, teacher_topk = _topk_inputs(student_logits, teacher_logits, VOCAB)
    losses, diagnostics = distillation_token_losses(
        loss_mode="forward_kl_topk", student_topk_logprobs=student_topk, teacher_topk_logprobs=teacher_topk
    )
    torch.testing.assert_close(losses, _full_forward_kl(student_logits, teacher_logits))
    torch.testing.assert_close(diagnostics["teacher_mass"], torch.ones(SAMPLES, TOKENS, dtype=torch.float64))
    torch.testing.assert_close(diagnostics["student_mass"], torch.ones(SAMPLES, TOKENS, dtype=torch.float64))


def test_forward_kl_topk_truncated_is_the_clamped_top_k_sum():
    student_logits, teacher_logits = _logits(5)
    student_topk, teacher_topk = _topk_inputs(student_logits, teacher_logits, 3)
    losses, diagnostics = distillation_token_losses(
        loss_mode="forward_kl_topk", student_topk_logprobs=student_topk, teacher_topk_logprobs=teacher_topk
    )
    p, q = teacher_topk.exp(), student_topk.exp()
    torch.testing.assert_close(losses, (p * (p / q).log()).sum(-1).clamp_min(0.0))
    torch.testing.assert_close(diagnostics["student_mass"], q.sum(-1))


def test_forward_kl_topk_clamps_negative_tokens_to_zero():
    """Student's top-k mass above the teacher's on every top-k token: the raw truncated sum is negative."""
    teacher_probs = torch.tensor([[[0.3, 0.3, 0.2, 0.2]]], dtype=torch.float64)
    student_probs = torch.tensor([[[0.45, 0.45, 0.05, 0.05]]], dtype=torch.float64)
    p, q = teacher_probs[..., :2], student_probs[..., :2]
    assert (p * (p / q).log()).sum() < 0
    losses, _ = distillation_token_losses(
        loss_mode="forward_kl_topk", student_topk_logprobs=q.log(), teacher_topk_logprobs=p.log()
    )
    assert losses.item() == 0.0


def test_forward_kl_topk_truncated_is_no_lower_bound_of_the_full_kl():
    """The dropped tokens' terms sum to less than 0 when the student over-weights the teacher's tail, so the
    truncated sum can exceed the full KL (unlike forward_kl_topk_tail): here k=1 gives 0.80 > full 0.51."""
    p = torch.tensor([0.5, 0.5 / 3, 0.5 / 3, 0.5 / 3], dtype=torch.float64)
    q = torch.tensor([0.1, 0.3, 0.3, 0.3], dtype=torch.float64)
    losses, _ = distillation_token_losses(
        loss_mode="forward_kl_topk",
        student_topk_logprobs=q[:1].log().reshape(1, 1, 1),
        teacher_topk_logprobs=p[:1].log().reshape(1, 1, 1),
    )
    full = kl_divergence(Categorical(probs=p), Categorical(probs=q))
    assert losses.item() > full.item()
    torch.testing.assert_close(losses.reshape(()), 0.5 * torch.tensor(5.0, dtype=torch.float64).log())


def test_forward_kl_topk_applies_log_prob_min_clamp_to_both_sides():
    teacher_lp = torch.tensor([[[-0.1, -30.0]]], dtype=torch.float64)
    student_lp = torch.tensor([[[-0.2, -40.0]]], dtype=torch.float64)
    losses, _ = distillation_token_losses(
        loss_mode="forward_kl_topk",
        student_topk_logprobs=student_lp,
        teacher_topk_logprobs=teacher_lp,
        log_prob_min_clamp=-10.0,
    )
    t, s = torch.tensor([-0.1, -10.0], dtype=torch.float64), torch.tensor([-0.2, -10.0], dtype=torch.float64)
    torch.testing.assert_close(losses.reshape(()), (t.exp() * (t - s)).sum())


def test_forward_kl_topk_tail_is_the_coarse_grained_kl_between_zero_and_the_full_kl():
    student_logits, teacher_logits = _logits(6)
    student_topk, teacher_topk = _topk_inputs(student_logits, teacher_logits, 3)
    losses, diagnostics = distillation_token_losses(
        loss_mode="forward_kl_topk_tail", student_topk_logprobs=student_topk, teacher_topk_logprobs=teacher_topk
    )
    p, q = teacher_topk.exp(), student_topk.exp()
    coarse_p = torch.cat([p, 1 - p.sum(-1, keepdim=True)], -1)
    coarse_q = torch.cat([q, 1 - q.sum(-1, keepdim=True)], -1)
    torch.testing.assert_close(losses, (coarse_p * (coarse_p / coarse_q).log()).sum(-1))
    assert (losses >= 0).all()
    assert (losses <= _full_forward_kl(student_logits, teacher_logits) + 1e-12).all()
    torch.testing.assert_close(diagnostics["topk_loss"] + diagnostics["tail_loss"], losses)
    torch.testing.assert_close(diagnostics["teacher_tail_mass"], coarse_p[..., -1])
    torch.testing.assert_close(diagnostics["student_tail_mass"], coarse_q[..., -1])


def test_forward_kl_topk_tail_with_an_empty_teacher_tail_is_the_full_kl_with_finite_gradient():
    student_logits, teacher_logits = _logits(7)
    student_logits.requires_grad_(True)
    student_topk, teacher_topk = _topk_inputs(student_logits, teacher_logits, VOCAB)
    losses, _ = distillation_token_losses(
        loss_mode="forward_kl_topk_tail", student_topk_logprobs=student_topk, teacher_topk_logprobs=teacher_topk
    )
    want = _full_forward_kl(student_logits, teacher_logits)
    torch.testing.assert_close(losses, want, atol=1e-6, rtol=1e-6)  # the student's tail floor is 1e-6
    losses.sum().backward()
    assert torch.isfinite(student_logits.grad).all()


def test_forward_kl_topk_tail_rejects_a_log_prob_min_clamp():
    student_topk, teacher_topk = _topk_inputs(*_logits(8), 3)
    with pytest.raises(ValueError, match="log_prob_min_clamp"):
        distillation_token_losses(
            loss_mode="forward_kl_topk_tail",
            student_topk_logprobs=student_topk,
            teacher_topk_logprobs=teacher_topk,
            log_prob_min_clamp=-10.0,
        )


def test_loss_max_clamp_clamps_both_signs():
    student = torch.tensor([[-0.1, -5.0, -1.0]], dtype=torch.float64)
    teacher = torch.tensor([[-5.0, -0.1, -1.2]], dtype=torch.float64)
    losses, _ = distillation_token_losses(
        loss_mode="k1", student_logprobs=student, teacher_logprobs=teacher, loss_max_clamp=1.0
    )
    torch.testing.assert_close(losses, torch.tensor([[1.0, -1.0, 0.2]], dtype=torch.float64))


def test_unknown_loss_mode_is_rejected():
    student, teacher = _sampled_logprobs(9)
    with pytest.raises(ValueError, match="unknown distillation loss_mode"):
        distillation_token_losses(loss_mode="jsd_topk", student_logprobs=student, teacher_logprobs=teacher)


