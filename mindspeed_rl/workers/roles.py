"""The roles of a run and the parts each composes (workers/parts/): what the rank groups of workers/start.py run.

- the colocated actor (one group switching between phases): training engine, its reference, reward model, teacher and
  critic where the run has them, and the inference engine;
- a disaggregated actor: `actor_train` (the same without the inference engine) and `actor_infer` (the inference
  engine alone);
- a critic on devices of its own: `critic` (the critic alone);
- a teacher on devices of its own: `teacher` (the teacher alone, in its own layout).
"""
from __future__ import annotations

from mindspeed_rl.config.distillation import TEACHER_ROLE, own_teacher_ranks, teacher_has_own_devices, teacher_layout
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
    and the teacher only where they share the actor's devices."""
    states = run_states(config)
    own = {CriticPart: config.critic_has_own_devices, TeacherPart: teacher_has_own_devices(config)}
    return tuple(part for part in (TrainingPart, ReferencePart, RewardModelPart, TeacherPart, CriticPart)
                 if part.STATES & states and not own.get(part, False))


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


def teacher_worker(config) -> type:
    """A rank of a teacher on devices of its own, in the teacher's layout."""
    return compose(TEACHER_ROLE, (TeacherPart,), layout_of=teacher_layout)


def own_device_workers(config) -> list[tuple[type, int]]:
    """(rank class, world size) of each part on devices of its own, in the order their devices follow the others':
    the critic's, then the teacher's."""
    own = [(critic_worker(config), config.critic_world_size)] if config.critic_has_own_devices else []
    return own + ([(teacher_worker(config), own_teacher_ranks(config))] if teacher_has_own_devices(config) else [])
