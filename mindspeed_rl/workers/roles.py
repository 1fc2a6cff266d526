"""The roles of a run and the parts each composes (workers/parts/): what the rank groups of workers/start.py run.

- the colocated actor (one group switching between phases): training engine, its reference, reward model, teacher and
  critic where the run has them, and the inference engine;
- a disaggregated actor: `actor_train` (the same without the inference engine) and `actor_infer` (the inference
  engine alone);
- a critic on devices of its own: `critic` (the critic alone).
"""
from __future__ import annotations

from mindspeed_rl.memory.residency import run_states
from mindspeed_rl.workers.parts.critic import CriticPart
from mindspeed_rl.workers.parts.inference import InferencePart
from mindspeed_rl.workers.parts.reference import ReferencePart
from mindspeed_rl.workers.parts.reward_model import RewardModelPart
from mindspeed_rl.workers.parts.teacher import TeacherPart
from mindspeed_rl.workers.parts.training import TrainingPart
from mindspeed_rl.workers.rank_worker import compose

TRAIN_ROLE, INFER_ROLE, CRITIC_ROLE = "actor_train", "actor_infer", "critic"
ALL_PARTS = (TrainingPart, ReferencePart, RewardModelPart, TeacherPart, CriticPart, InferencePart)


def training_parts(config) -> tuple[type, ...]:
    """The actor's training side: the parts (inference aside) whose states the run holds (`run_states`), the critic
    only where it shares the actor's devices."""
    states = run_states(config)
    return tuple(part for part in (TrainingPart, ReferencePart, RewardModelPart, TeacherPart, CriticPart)
                 if part.STATES & states and not (part is CriticPart and config.critic_has_own_devices))


def actor_worker(config) -> type:
    """The colocated actor's rank (every part on the same devices, taking turns); without the inference engine where
    the run generates nothing (DPO: the training engine and its reference)."""
    return compose("", (*training_parts(config), *((InferencePart,) if config.generates else ())))


def disaggregated_workers(config) -> tuple[type, type]:
    """(actor_train's rank, actor_infer's rank) of a disaggregated actor."""
    return compose(TRAIN_ROLE, training_parts(config)), compose(INFER_ROLE, (InferencePart,))


def critic_worker(config) -> type:
    """A rank of a critic on devices of its own."""
    return compose(CRITIC_ROLE, (CriticPart,))
