"""The residency table (memory/residency.py) and the ROLL roles derived from it. Pure, in-process."""
import itertools

import pytest
import torch

from mindspeed_rl.accelerator import get_accelerator
from mindspeed_rl.memory.offload import Offloader
from mindspeed_rl.memory.residency import (INFER_WEIGHTS, KV_CACHE, PHASES, REF_PARAMS, REWARD_PARAMS, STATE_GROUPS,
                                           TRAIN_GRADS, TRAIN_OPTIMIZER, TRAIN_PARAMS, ResidencyPolicy)
from mindspeed_rl.memory.roles import ACTOR_FORWARD, ACTOR_INFER, ACTOR_TRAIN, REFERENCE, REWARD_MODEL, build_roles

FLAG_COMBINATIONS = list(itertools.product([True, False], repeat=3))


def _policy(flags) -> ResidencyPolicy:
    param, grad, optimizer = flags
    return ResidencyPolicy(offload_train_param=param, offload_train_grad=grad, offload_train_optimizer=optimizer)


def test_with_every_flag_on_each_phase_holds_only_what_it_needs():
    assert ResidencyPolicy().table() == {
        "idle": frozenset(),
        "generate": {INFER_WEIGHTS, KV_CACHE},
        "reward": frozenset(),  # no reward model: the phase is never entered
        "ref_logprob": {REF_PARAMS},
        "old_logprob": {TRAIN_PARAMS},
        "update": {TRAIN_PARAMS, TRAIN_GRADS, TRAIN_OPTIMIZER},
    }


@pytest.mark.parametrize("flags", FLAG_COMBINATIONS)
def test_a_flag_set_to_false_pins_its_state_in_every_phase(flags):
    policy = _policy(flags)
    pinned = {state for state, offload in zip((TRAIN_PARAMS, TRAIN_GRADS, TRAIN_OPTIMIZER), flags) if not offload}
    assert policy.pinned == pinned
    for phase in PHASES:
        assert pinned <= policy.resident(phase)
        assert policy.resident(phase) == ResidencyPolicy().resident(phase) | pinned


@pytest.mark.parametrize("flags", FLAG_COMBINATIONS)
def test_reward_params_are_resident_only_in_the_reward_phase(flags):
    param, grad, optimizer = flags
    policy = ResidencyPolicy(offload_train_param=param, offload_train_grad=grad, offload_train_optimizer=optimizer,
                             has_reward_model=True)
    holding = [phase for phase in PHASES if REWARD_PARAMS in policy.resident(phase)]
    assert holding == ["reward"]
    assert policy.resident("reward") == {REWARD_PARAMS} | policy.pinned


def test_without_a_reward_model_no_phase_holds_reward_params():
    assert not any(REWARD_PARAMS in states for states in ResidencyPolicy().table().values())


def test_an_unknown_phase_is_an_error():
    with pytest.raises(ValueError, match="unknown phase 'train'"):
        ResidencyPolicy().resident("train")


def _offloader() -> Offloader:
    offloader = Offloader(get_accelerator("cpu"))
    for name in STATE_GROUPS:
        tensor = torch.zeros(4)
        offloader.register(name, lambda t=tensor: [t])
    return offloader


@pytest.mark.parametrize("flags", FLAG_COMBINATIONS)
def test_roles_move_their_phase_row_less_the_pinned_states(flags):
    policy = _policy(flags)
    roles = build_roles(_offloader(), policy)
    phases = {ACTOR_INFER: "generate", ACTOR_FORWARD: "old_logprob", ACTOR_TRAIN: "update", REFERENCE: "ref_logprob",
              REWARD_MODEL: "reward"}
    for role, phase in phases.items():
        assert set(roles[role].names) == policy.resident(phase) - policy.pinned


def test_the_reward_model_role_moves_the_reward_params_alone():
    policy = ResidencyPolicy(has_reward_model=True)
    assert build_roles(_offloader(), policy)[REWARD_MODEL].names == (REWARD_PARAMS,)
