"""On-policy distillation (OPD) as pure tensor functions, with verl's definitions (docs/algo/opd.md,
verl/trainer/distillation/losses.py). The student is the policy pi, the teacher is nu.

Two families of per-token losses, selected by verl's ``loss_mode`` names:

* single-sample estimators of the reverse KL(pi || nu) on the sampled token (``kl``/``k1``, ``abs``,
  ``mse``/``k2``, ``low_var_kl``/``k3``): verl calls ``kl_penalty(student, teacher)``, and so do we
  (:func:`mindspeed_rl.algorithms.grpo.kl_penalty`, which knows the same names). With verl's
  ``use_policy_gradient: true`` the loss is not backpropagated; its negative, detached, is a per-token
  reward (:func:`pg_opd_token_rewards`; for k1 that is ``log nu - log pi``, the Thinking Machines recipe).
* GKD forward KL(nu || pi) over the teacher's top-k tokens (``forward_kl_topk``, and the tail-aware
  ``forward_kl_topk_tail``, which lumps the mass outside the top-k into one bucket so that the truncated
  sum becomes the exact KL of two coarse-grained distributions: never negative, and by the data-processing
  inequality never above the full-vocabulary forward KL).

Shapes: per-token tensors are ``[samples, response_tokens]``, top-k tensors ``[samples, response_tokens, k]``;
padding is the caller's: losses are computed everywhere and :func:`distillation_update_loss` masks them.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from mindspeed_rl.algorithms.grpo import KL_PENALTY_KINDS, kl_penalty, masked_mean
from mindspeed_rl.config.distillation import ESTIMATOR_LOSS_MODES, LOSS_MODES, TOPK_LOSS_MODES

# grpo.kl_penalty takes all of verl's estimator names itself; fail at import, not mid-training, if that changes.
if not set(ESTIMATOR_LOSS_MODES) <= set(KL_PENALTY_KINDS):
    raise ImportError(f"grpo.kl_penalty no longer accepts all of {ESTIMATOR_LOSS_MODES}")


def pg_opd_token_rewards(student_logprobs: Tensor, teacher_logprobs: Tensor, loss_mode: str = "k1", *,
                         loss_max_clamp: Optional[float] = None) -> Tensor:
    """verl's PG OPD reward per token: ``-estimator(student, teacher)`` (after ``loss_max_clamp``), detached (for k1:
    ``teacher - student``).

    Values at padded positions are meaningless (log-probs of padding); the caller's response mask keeps them out of
    the loss.
    """
    if loss_mode not in ESTIMATOR_LOSS_MODES:
        raise ValueError(f"PG OPD needs a single-sample estimator loss_mode {ESTIMATOR_LOSS_MODES}, got {loss_mode!r}")
    losses, _ = distillation_token_losses(loss_mode=loss_mode, student_logprobs=student_logprobs.detach(),
                                          teacher_logprobs=teacher_logprobs.detach(), loss_max_clamp=loss_max_clamp)
    return -losses


def distillation_token_losses(
    *,
    loss_mode: str,
    student_logprobs: Optional[Tensor] = None,
    teacher_logprobs: Optional[Tensor] = None,
    student_topk_logprobs: Optional[Tensor] = None,
    teacher_topk_logprobs: Optional[Tensor] = None,
    log_prob_min_clamp: Optional[float] = None,
    tail_mass_eps: float = 1e-6,
    loss_max_clamp: Optional[float] = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """Per-token distillation loss ``[samples, tokens]`` (differentiable in the student's inputs) and
    detached per-token diagnostics (top-k modes: ``teacher_mass``, ``student_mass``; the tail mode also
    ``teacher_tail_mass``, ``student_tail_mass``, ``topk_loss``, ``tail_loss``).

    ``student_topk_logprobs`` are the student's full-vocabulary log-probs gathered at the teacher's top-k ids.
    ``log_prob_min_clamp`` (top-k modes only, as in verl) floors both top-k log-probs before the KL;
    ``loss_max_clamp`` clamps the per-token loss to ``[-c, c]``.
    """
    if loss_mode in ESTIMATOR_LOSS_MODES:
        if student_logprobs is None or teacher_logprobs is None:
            raise ValueError(f"loss_mode {loss_mode!r} needs student_logprobs and teacher_logprobs")
        # The teacher is a fixed target: no gradient may reach it even if its log-probs carry a graph.
        losses, diagnostics = kl_penalty(student_logprobs, teacher_logprobs.detach(), loss_mode), {}
    elif loss_mode in TOPK_LOSS_MODES:
        if student_topk_logprobs is None or teacher_topk_logprobs is None:
            raise ValueError(f"loss_mode {loss_mode!r} needs student_topk_logprobs and teacher_topk_logprobs")
        if student_topk_logprobs.shape != teacher_topk_logprobs.shape:
            raise ValueError(
                f"top-k shapes differ: student {tuple(student_topk_logprobs.shape)}, "
                f"teacher {tuple(teacher_topk_logprobs.shape)}"
            )
        teacher_topk_logprobs = teacher_topk_logprobs.detach()
        if loss_mode == "forward_kl_topk":
            losses, diagnostics = _forward_kl_topk(student_topk_logprobs, teacher_topk_logprobs, log_prob_min_clamp)
        else:
            if log_prob_min_clamp is not None:
                # Flooring log-probs adds mass the tail bucket does not account for: the result is no KL.
                raise ValueError("forward_kl_topk_tail requires log_prob_min_clamp=None")
            losses, diagnostics = _forward_kl_topk_tail(student_topk_logprobs, teacher_topk_logprobs, tail_mass_eps)
    else:
        raise ValueError(f"unknown distillation loss_mode {loss_mode!r}; valid modes: {list(LOSS_MODES)}")
    if loss_max_clamp is not None:
        losses = losses.clamp(-loss_max_clamp, loss_max_clamp)
    return losses, diagnostics


def _forward_kl_topk(student: Tensor, teacher: Tensor, log_prob_min_clamp: Optional[float]) -> tuple[Tensor, dict]:
    diagnostics = {"teacher_mass": teacher.detach().exp().sum(-1), "student_mass": student.detach().exp().sum(-1)}
    if log_prob_min_clamp is not None:
        student, teacher = student.clamp_min(log_prob_min_clamp), teacher.clamp_min(log_prob_min_clamp)
    kl = (teacher.exp() * (teacher - student)).sum(-1)
    # Truncated to k tokens the two "distributions" do not sum to 1, so a token whose student top-k mass
    # exceeds the teacher's can score below 0; verl clamps those to 0 (no gradient pushes it further down).
    # Nor is it a lower bound of the full KL: the dropped terms sum below 0 when the student over-weights
    # the teacher's tail. forward_kl_topk_tail fixes both.
    return kl.clamp_min(0.0), diagnostics


def _forward_kl_topk_tail(student: Tensor, teacher: Tensor, tail_mass_eps: float) -> tuple[Tensor, dict]:
    # 1 - sum_k p = -expm1(logsumexp(log p)): exact when the top-k mass is close to 1, unlike 1 - sum(exp).
    teacher_tail = (-torch.expm1(torch.logsumexp(teacher, -1))).clamp_min(0.0)
    student_tail = (-torch.expm1(torch.logsumexp(student, -1))).clamp_min(tail_mass_eps)
    topk_loss = (teacher.exp() * (teacher - student)).sum(-1)
    # xlogy gives 0 * log 0 = 0 for a teacher whose top-k holds all its mass; the student's tail is floored
    # because log(0) there would be an infinite loss and gradient.
    tail_loss = torch.xlogy(teacher_tail, teacher_tail) - teacher_tail * student_tail.log()
    diagnostics = {
        "teacher_mass": teacher.detach().exp().sum(-1),
        "student_mass": student.detach().exp().sum(-1),
        "teacher_tail_mass": teacher_tail.detach(),
        "student_tail_mass": student_tail.detach(),
        "topk_loss": topk_loss.detach(),
        "tail_loss": tail_loss.detach(),
    }
    return topk_loss + tail_loss, diagnostics


def distillation_update_loss(*, logprobs: Tensor, old_logprobs: Tensor, teacher_logprobs: Tensor,
                             response_mask: Tensor, settings, aggregate, mini_batch_tokens: float,
                             student_topk_logprobs: Optional[Tensor] = None,
                             teacher_topk_logprobs: Optional[Tensor] = None) -> tuple[Tensor, dict[str, float]]:
    """The update's distillation term of one micro-batch (`settings`: config/distillation.DistillationLossConfig),
    aggregated like the task loss (`aggregate`: the mini-batch's denominator), and its stats as the micro-batch's
    shares of mini-batch token means (they sum over micro-batches and DP ranks, as the task loss's stats do).

    GKD-style (use_policy_gradient false): the estimator, backpropagated through the student's log-probs. PG OPD
    (verl's use_policy_gradient): the negative estimator, detached, is each token's advantage in a vanilla PPO-clip
    loss with distillation_loss's own clip ratios."""
    if settings.use_policy_gradient:
        from mindspeed_rl.algorithms.grpo import ppo_clip_policy_loss

        rewards = pg_opd_token_rewards(logprobs, teacher_logprobs, settings.loss_mode,
                                       loss_max_clamp=settings.loss_max_clamp)
        token_losses = -rewards
        pg_tokens = ppo_clip_policy_loss(logprobs, old_logprobs, rewards, response_mask,
                                         settings.clip_ratio_low, settings.clip_ratio_high)[0]
        loss, diagnostics = aggregate(pg_tokens), {}  # the sampled token's reward only: no top-k masses
    else:  # the estimator, or the forward KL over the teacher's top k (the student's log-probs at those ids)
        token_losses, diagnostics = distillation_token_losses(
            loss_mode=settings.loss_mode, student_logprobs=logprobs, teacher_logprobs=teacher_logprobs,
            student_topk_logprobs=student_topk_logprobs, teacher_topk_logprobs=teacher_topk_logprobs,
            log_prob_min_clamp=settings.log_prob_min_clamp, tail_mass_eps=settings.tail_mass_eps,
            loss_max_clamp=settings.loss_max_clamp)
        loss = aggregate(token_losses)
    valid = response_mask.bool()
    # k1 on the sampled tokens: the unbiased per-token estimate of KL(student || teacher) at the student's states.
    gap = torch.where(valid, logprobs.detach() - teacher_logprobs, torch.zeros_like(logprobs))
    stats = {"distill/loss": loss.item(),
             "distill/kl_mean": (gap.sum() / mini_batch_tokens).item(),
             "distill/logprob_gap_abs_mean": (gap.abs().sum() / mini_batch_tokens).item(),
             "distill/token_loss_mean": (torch.where(valid, token_losses.detach(), torch.zeros_like(logprobs)).sum()
                                         / mini_batch_tokens).item()}
    # the top-k modes' teacher and student masses on the teacher's top k (verl's distillation/*_mass)
    stats |= {f"distill/{name}": (torch.where(valid, values, torch.zeros_like(values)).sum() / mini_batch_tokens).item()
              for name, values in diagnostics.items() if name.endswith("mass")}
    return loss, stats
