"""On-policy distillation's step of an iteration (config/distillation.py): the teacher's log-probs of the student's
sampled tokens (and with a top-k loss mode its top k there), batch columns the update's distillation loss reads
(workers/actor_steps.py; protocol.TEACHER_COLUMN, TEACHER_TOPK_COLUMN)."""
from __future__ import annotations

from mindspeed_rl.protocol import TEACHER_COLUMN, TEACHER_TOPK_COLUMN, RolloutBatch
from mindspeed_rl.trainer.rollout import forward_logprobs
from mindspeed_rl.workers.actor_group import ActorGroup


def teacher_logprobs(config, actor_group: ActorGroup, batch: RolloutBatch) -> dict:
    """The teacher's phase, where the run distills (in the residency table's `teacher_logprob` row)."""
    if not config.distills:
        return {}
    scores, metrics = forward_logprobs(actor_group, "compute_teacher_log_prob", batch)
    if scores.dim() == 3:  # a top-k loss mode: the sampled token's log-prob, the top k's, their ids
        batch.columns[TEACHER_TOPK_COLUMN] = scores
        scores = scores[..., 0]
    batch.columns[TEACHER_COLUMN] = scores
    return metrics
