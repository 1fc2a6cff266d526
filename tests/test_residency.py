"""The residency table (memory/residency.py), the sharding manager that is its only mover
(workers/sharding_manager.py), and ROLL's control surface built on the manager: `offload_states`,
`reload_states`, `state_offload_manager` and `meta_info["is_offload_states"]`.

Runs where: in the pytest process; the states are CPU tensors in the offloader's storage groups.
"""
import itertools

import pytest
import torch

from mindspeed_rl.accelerator import get_accelerator
from mindspeed_rl.memory import MemoryLedger, state_offload_manager
from mindspeed_rl.memory.ledger import PHASES as LEDGER_PHASES
from mindspeed_rl.memory.offload import Offloader
from mindspeed_rl.memory.residency import (ADAPTER_PARAMS, GENERATE, IDLE, INFER_WEIGHTS, KV_CACHE, OLD_LOGPROB, PHASES,
                                           REF_LOGPROB, REF_PARAMS, REWARD, REWARD_PARAMS, STATE_GROUPS, SWITCH,
                                           TRAIN_GRADS, TRAIN_OPTIMIZER, TRAIN_PARAMS, UPDATE, ResidencyPolicy)
from mindspeed_rl.workers.phase_rpc import phase_rpc
from mindspeed_rl.workers.sharding_manager import PhaseStates, ShardingManager, StateSet

FLAG_COMBINATIONS = list(itertools.product([True, False], repeat=3))
NUMEL = {name: 16 * (index + 1) for index, name in enumerate(STATE_GROUPS)}  # distinct sizes: bytes tell states apart


def _policy(flags, **kwargs) -> ResidencyPolicy:
    param, grad, optimizer = flags
    return ResidencyPolicy(offload_train_param=param, offload_train_grad=grad, offload_train_optimizer=optimizer,
                           **kwargs)


# -- the table ----------------------------------------------------------------------------------------
def test_with_every_flag_on_each_phase_holds_only_what_it_needs():
    assert ResidencyPolicy.offloading().table() == {
        "idle": frozenset(),
        "switch": {TRAIN_PARAMS, INFER_WEIGHTS},  # both ends of the push; the KV cache comes after it
        "generate": {INFER_WEIGHTS, KV_CACHE},
        "reward": frozenset(),  # no reward model: the phase is never entered
        "ref_logprob": {REF_PARAMS},
        "old_logprob": {TRAIN_PARAMS},
        "update": {TRAIN_PARAMS, TRAIN_GRADS, TRAIN_OPTIMIZER},
        "teacher_logprob": frozenset(),  # no distillation teacher: never entered
        "critic_values": frozenset(),  # no critic (GRPO): never entered
        "critic_update": frozenset(),
    }


def test_a_critic_has_its_own_two_phases_between_the_actors():
    """PPO: the critic's values after the old log-probs, its update after the actor's; each phase holds one role's
    states, so the critic's and the actor's optimizer states are never on the device together."""
    from mindspeed_rl.memory.residency import CRITIC_GRADS, CRITIC_OPTIMIZER, CRITIC_PARAMS, CRITIC_UPDATE, CRITIC_VALUES

    policy = ResidencyPolicy.offloading(has_critic=True)
    assert policy.phases()[-4:] == (OLD_LOGPROB, CRITIC_VALUES, UPDATE, CRITIC_UPDATE)
    assert policy.resident(CRITIC_VALUES) == {CRITIC_PARAMS}
    assert policy.resident(CRITIC_UPDATE) == {CRITIC_PARAMS, CRITIC_GRADS, CRITIC_OPTIMIZER}
    assert policy.after(OLD_LOGPROB) == frozenset()  # the critic's forward comes between: the actor leaves
    assert policy.after(UPDATE) == frozenset()
    assert all(not (policy.resident(phase) & {CRITIC_PARAMS}) for phase in policy.phases()
               if phase not in (CRITIC_VALUES, CRITIC_UPDATE))
    assert ResidencyPolicy.offloading().phases() == tuple(p for p in policy.phases() if p not in (CRITIC_VALUES, CRITIC_UPDATE))


def test_a_shared_lora_backbone_runs_the_reference_on_the_train_params():
    """LoRA's share_backbone: no reference params anywhere; the reference phase holds the train params (backbone and
    adapters), which then stay for the old log-probs."""
    policy = ResidencyPolicy.offloading(reference_is_backbone=True)
    assert policy.resident(REF_LOGPROB) == {TRAIN_PARAMS}
    assert policy.after(REF_LOGPROB) == {TRAIN_PARAMS}
    assert all(REF_PARAMS not in policy.resident(phase) for phase in PHASES)


def test_a_critics_own_devices_keep_its_states_in_every_phase():
    from mindspeed_rl.memory.residency import CRITIC_STATES

    policy = ResidencyPolicy.offloading(has_critic=True, offload_critic=False)
    assert all(CRITIC_STATES <= policy.resident(phase) for phase in PHASES)


@pytest.mark.parametrize("flags", FLAG_COMBINATIONS)
def test_a_flag_set_to_false_pins_its_state_in_every_phase(flags):
    policy = _policy(flags)
    pinned = {state for state, offload in zip((TRAIN_PARAMS, TRAIN_GRADS, TRAIN_OPTIMIZER), flags) if not offload}
    assert policy.pinned == pinned
    for phase in PHASES:
        assert pinned <= policy.resident(phase)
        assert policy.resident(phase) == ResidencyPolicy.offloading().resident(phase) | pinned


@pytest.mark.parametrize("flags", FLAG_COMBINATIONS)
def test_the_switch_row_is_the_two_ends_of_the_push(flags):
    policy = _policy(flags)
    assert policy.resident(SWITCH) == (policy.resident(OLD_LOGPROB) | policy.resident(GENERATE)) - {KV_CACHE}


@pytest.mark.parametrize("flags", FLAG_COMBINATIONS)
def test_reward_params_are_resident_only_in_the_reward_phase(flags):
    policy = _policy(flags, has_reward_model=True)
    holding = [phase for phase in PHASES if REWARD_PARAMS in policy.resident(phase)]
    assert holding == ["reward"]
    assert policy.resident("reward") == {REWARD_PARAMS} | policy.pinned


def test_without_a_reward_model_no_phase_holds_reward_params():
    assert not any(REWARD_PARAMS in states for states in ResidencyPolicy.offloading().table().values())


def test_an_unknown_phase_is_an_error():
    with pytest.raises(ValueError, match="unknown phase 'train'"):
        ResidencyPolicy.offloading().resident("train")


@pytest.mark.parametrize("flags", FLAG_COMBINATIONS)
def test_after_a_call_only_what_the_next_phase_needs_too_stays(flags):
    policy = _policy(flags, has_reward_model=True)
    assert policy.after(OLD_LOGPROB) == {TRAIN_PARAMS} | policy.pinned  # the update right after needs them
    for phase in (GENERATE, REWARD, REF_LOGPROB, UPDATE):
        assert policy.after(phase) == policy.pinned, phase


def test_the_iteration_and_the_phase_lists_come_from_the_one_table():
    names = [name for name, _ in ResidencyPolicy.offloading().iteration()]
    assert names == [SWITCH, GENERATE, IDLE, REF_LOGPROB, IDLE, OLD_LOGPROB, UPDATE, IDLE]
    with_reward = ResidencyPolicy.offloading(has_reward_model=True)
    assert [name for name, _ in with_reward.iteration()][:5] == [SWITCH, GENERATE, IDLE, REWARD, IDLE]
    assert ResidencyPolicy.offloading().recorded_phases() == (GENERATE, REF_LOGPROB, OLD_LOGPROB, UPDATE)
    assert with_reward.recorded_phases() == (GENERATE, REWARD, REF_LOGPROB, OLD_LOGPROB, UPDATE)
    every_role = ResidencyPolicy.offloading(has_reward_model=True, has_teacher=True, has_critic=True)
    assert every_role.recorded_phases() == LEDGER_PHASES


def test_the_inference_ranks_of_a_disaggregated_actor_never_move_their_states():
    policy = ResidencyPolicy.offloading(offload_inference=False)
    for phase in PHASES:
        assert {INFER_WEIGHTS, KV_CACHE} <= policy.resident(phase) and {INFER_WEIGHTS, KV_CACHE} <= policy.after(phase)


# -- the manager --------------------------------------------------------------------------------------
def _manager(policy: ResidencyPolicy, weight_push=None) -> tuple[ShardingManager, dict[str, torch.Tensor]]:
    """Every state group over one random CPU tensor, registered as the engines register them (grads and the
    KV cache drop their contents when they leave); all resident, as after building the engines."""
    offloader = Offloader(get_accelerator("cpu"))
    generator = torch.Generator().manual_seed(0)
    tensors = {name: torch.randn(NUMEL[name], generator=generator) for name in STATE_GROUPS}
    for name, tensor in tensors.items():
        offloader.register(name, lambda t=tensor: [t], keep_contents=name not in (TRAIN_GRADS, KV_CACHE))
    return ShardingManager(offloader=offloader, policy=policy, weight_push=weight_push), tensors


def _resident(manager: ShardingManager) -> set[str]:
    return {name for name in STATE_GROUPS if manager.offloader.is_resident(name)}


def _copied_bytes(names) -> int:
    """Bytes a move copies: states whose contents are kept."""
    return sum(NUMEL[n] * 4 for n in names if n not in (TRAIN_GRADS, KV_CACHE, INFER_WEIGHTS))


@pytest.mark.parametrize("flags", FLAG_COMBINATIONS, ids=lambda f: "param%d-grad%d-optim%d" % f)
def test_each_call_enters_its_row_and_leaves_what_the_table_keeps(flags):
    policy = _policy(flags, has_reward_model=True)
    manager, _ = _manager(policy)
    manager.enter(IDLE)
    assert _resident(manager) == policy.pinned
    for phase in policy.recorded_phases():  # the iteration's calls, in order
        before = _resident(manager)
        moved = manager.enter(phase)
        assert _resident(manager) == policy.resident(phase), phase
        assert moved.reloaded == _copied_bytes(policy.resident(phase) - before), phase
        manager.leave(phase)
        assert _resident(manager) == policy.after(phase), phase


class _RecordingPush:
    """A weight push that notes which states were resident when it ran."""

    def __init__(self):
        self.saw: list[set[str]] = []
        self.manager = None

    def push(self) -> dict[str, float]:
        self.saw.append(_resident(self.manager))
        return {"resharding/bytes_received": 8.0}

    def states_needed(self) -> frozenset[str]:
        return frozenset()

    def host_tensors(self) -> list:
        return []

    def close(self) -> None:
        pass


class _AdapterLikePush(_RecordingPush):
    """As resharding/adapter_push.AdapterPush: the first push reads the backbone, later ones the adapters only."""

    def states_needed(self) -> frozenset[str]:
        return frozenset({TRAIN_PARAMS}) if not self.saw else frozenset()


def test_entering_generate_pushes_in_the_switch_row_then_builds_the_kv_cache():
    push = _RecordingPush()
    manager, _ = _manager(ResidencyPolicy.offloading(), weight_push=push)
    push.manager = manager
    manager.enter(IDLE)
    order = []
    reload = manager.offloader.reload
    manager.offloader.reload = lambda name: order.append(name) or reload(name)
    manager.enter(GENERATE)
    assert push.saw == [{TRAIN_PARAMS, INFER_WEIGHTS}], "both ends of the push, and no KV cache yet"
    assert _resident(manager) == {INFER_WEIGHTS, KV_CACHE}
    assert order[-1] == KV_CACHE, "the cache comes last, after the train params left"
    metrics = manager.pop_metrics()
    assert metrics["resharding/bytes_received"] == 8.0 and metrics["timing/resharding_enter_infer"] > 0
    assert manager.pop_metrics() == {}


def test_a_phase_change_drops_the_inference_weights_and_a_manual_offload_keeps_them():
    manager, tensors = _manager(ResidencyPolicy.offloading())
    weights = tensors[INFER_WEIGHTS].clone()
    manager.enter(GENERATE)
    assert manager.leave(GENERATE).offloaded == 0, "every push overwrites them: not worth a copy"
    manager.reload_states([INFER_WEIGHTS])
    assert torch.equal(tensors[INFER_WEIGHTS], torch.zeros_like(weights))
    tensors[INFER_WEIGHTS].copy_(weights)
    assert manager.offload_states([INFER_WEIGHTS]) == weights.nbytes
    assert manager.reload_states([INFER_WEIGHTS]) == weights.nbytes
    assert torch.equal(tensors[INFER_WEIGHTS], weights)


# -- ROLL's control surface, each built on the manager -------------------------------------------------
def test_offload_states_and_reload_states_round_trip_every_state_bit_exact():
    manager, tensors = _manager(ResidencyPolicy.offloading())
    kept = {n: t.clone() for n, t in tensors.items() if n not in (TRAIN_GRADS, KV_CACHE)}
    assert manager.offload_states() == _copied_bytes(STATE_GROUPS) + NUMEL[INFER_WEIGHTS] * 4
    assert _resident(manager) == set()
    assert manager.reload_states() == _copied_bytes(STATE_GROUPS) + NUMEL[INFER_WEIGHTS] * 4
    assert _resident(manager) == set(STATE_GROUPS)
    assert all(torch.equal(tensors[n], t) for n, t in kept.items())
    assert torch.equal(tensors[TRAIN_GRADS], torch.zeros(NUMEL[TRAIN_GRADS])), "grads are dropped unless kept"


def test_state_offload_manager_runs_a_call_inside_its_phase_row():
    manager, _ = _manager(ResidencyPolicy.offloading())
    manager.enter(IDLE)
    metrics: dict[str, float] = {}
    with state_offload_manager(PhaseStates(manager, REF_LOGPROB), metrics, "ref"):
        assert _resident(manager) == {REF_PARAMS}
    assert _resident(manager) == set()
    assert metrics["offload/ref/reload_bytes"] == metrics["offload/ref/offload_bytes"] == NUMEL[REF_PARAMS] * 4
    with state_offload_manager(StateSet(manager, [TRAIN_PARAMS, TRAIN_OPTIMIZER]), metrics, "named"):
        assert _resident(manager) == {TRAIN_PARAMS, TRAIN_OPTIMIZER}
    assert _resident(manager) == set()


class _Batch:
    def __init__(self, meta_info: dict):
        self.meta_info = meta_info


class _Worker:
    """The two members a phase RPC uses: the sharding manager and the ledger."""

    def __init__(self, manager: ShardingManager):
        self.sharding_manager = manager
        self.ledger = MemoryLedger(manager.offloader.resident_bytes, manager.offloader.accelerator)

    @phase_rpc(REF_LOGPROB)
    def forward(self, batch) -> dict[str, float]:
        return {"resident": float(len(_resident(self.sharding_manager)))}


def test_is_offload_states_false_keeps_the_phase_states_after_the_call():
    manager, _ = _manager(ResidencyPolicy.offloading())
    manager.enter(IDLE)
    worker = _Worker(manager)
    metrics = worker.forward(_Batch({}))
    assert metrics["resident"] == 1 and _resident(manager) == set(), "automatic: the phase's states leave after"
    metrics = worker.forward(_Batch({"is_offload_states": False}))
    assert _resident(manager) == {REF_PARAMS} and metrics["offload/ref_logprob/offload_bytes"] == 0
    manager.enter(IDLE)
    worker.forward(_Batch({}), meta_info={"is_offload_states": False})  # calls without a batch say it this way
    assert _resident(manager) == {REF_PARAMS}


LORA = ResidencyPolicy.offloading(has_adapters=True, adapter_only_switch=True, reference_is_backbone=True)


def test_with_lora_the_adapters_are_a_group_of_their_own_and_the_switch_row_holds_only_them():
    assert LORA.resident(SWITCH) == {ADAPTER_PARAMS, INFER_WEIGHTS}
    assert LORA.resident(OLD_LOGPROB) == LORA.resident(REF_LOGPROB) == {TRAIN_PARAMS, ADAPTER_PARAMS}
    assert LORA.resident(UPDATE) == {TRAIN_PARAMS, ADAPTER_PARAMS, TRAIN_GRADS, TRAIN_OPTIMIZER}
    assert ADAPTER_PARAMS not in ResidencyPolicy.offloading().resident(UPDATE), "no adapters, no group"
    pinned = ResidencyPolicy(offload_train_param=False, offload_train_grad=True, offload_train_optimizer=True,
                             has_adapters=True).pinned
    assert pinned == {TRAIN_PARAMS, ADAPTER_PARAMS}, "offload_train_param: false pins both halves of the actor"


def test_a_lora_switch_brings_the_backbone_to_its_first_push_only():
    push = _AdapterLikePush()
    manager, _ = _manager(LORA, weight_push=push)
    push.manager = manager
    manager.enter(IDLE)
    manager.enter(GENERATE)
    manager.leave(GENERATE)
    for phase in (REF_LOGPROB, OLD_LOGPROB, UPDATE):
        manager.enter(phase)
        manager.leave(phase)
    moved = manager.enter(GENERATE)
    assert push.saw == [{TRAIN_PARAMS, ADAPTER_PARAMS, INFER_WEIGHTS}, {ADAPTER_PARAMS, INFER_WEIGHTS}]
    assert moved.reloaded == NUMEL[ADAPTER_PARAMS] * 4, "the second switch copies the adapters in, not the backbone"
