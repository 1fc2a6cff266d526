"""On-policy distillation's step of an iteration (config/distillation.py): the teacher's log-probs of the student's
sampled tokens, a batch column (`teacher_logprobs`) the update's distillation loss reads (workers/actor_steps.py)."""
from __future__ import annotations

from mindspeed_rl.protocol import RolloutBatch
from mindspeed_rl.trainer.rollout import forward_logprobs
from mindspeed_rl.workers.actor_group import ActorGroup

TEACHER_COLUMN = "teacher_logprobs"


def teacher_logprobs(config, actor_group: ActorGroup, batch: RolloutBatch) -> dict:
    """The teacher's phase, where the run distills (in the residency table's `teacher_logprob` row)."""
    if not config.distills:
        return {}
    batch.columns[TEACHER_COLUMN], metrics = forward_logprobs(actor_group, "compute_teacher_log_prob", batch)
    return metrics
