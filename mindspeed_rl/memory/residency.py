"""The one residency table: which state groups are on the device in each phase of an iteration.

`ShardingManager.enter(phase)` (workers/sharding_manager.py) is the only code that moves states, and it
moves exactly the difference between what is resident and the phase's row. ROLL's per-call automatic
offload, the memory ledger's phases, the timeline and the planner (`cli/plan.py`) read the same table,
so what the engine does and what the planner predicts cannot drift apart.

A phase's row is what the phase needs, plus the train states that MindSpeed-RL's
`generate_config.offload_train_*` flags keep on the device: a flag set to false pins that state in
every phase (it never moves, so the switch is cheaper and the device fuller), not only in generate.
When a phase's call returns, what the next phase of the iteration needs too stays (`after`): the train
params go from old_logprob straight into update; everything else leaves.
"""
from __future__ import annotations

from dataclasses import dataclass

TRAIN_PARAMS, TRAIN_GRADS, TRAIN_OPTIMIZER = "train_params", "train_grads", "optimizer_states"
# LoRA's adapters (models/lora.py), a group of their own: then train_params is the frozen backbone, and the grads and
# optimizer states are the adapters' alone. A LoRA switch needs only the adapters on the device (AdapterPush).
ADAPTER_PARAMS = "adapter_params"
REF_PARAMS = "reference_params"
REWARD_PARAMS = "reward_params"  # a reward model's params (rewards.<name>.model_path), colocated
TEACHER_PARAMS = "teacher_params"  # on-policy distillation's teacher (distillation.teacher_models), colocated
# PPO's critic (engines/critic.py): its own params, grads and Adam states, moved like the actor's.
CRITIC_PARAMS, CRITIC_GRADS, CRITIC_OPTIMIZER = "critic_params", "critic_grads", "critic_optimizer_states"
INFER_WEIGHTS, KV_CACHE = "inference_weights", "kv_cache"
STATE_GROUPS = (TRAIN_PARAMS, ADAPTER_PARAMS, TRAIN_GRADS, TRAIN_OPTIMIZER, REF_PARAMS, REWARD_PARAMS, TEACHER_PARAMS,
                CRITIC_PARAMS, CRITIC_GRADS, CRITIC_OPTIMIZER, INFER_WEIGHTS, KV_CACHE)
CRITIC_STATES = frozenset({CRITIC_PARAMS, CRITIC_GRADS, CRITIC_OPTIMIZER})
INFERENCE_STATES = frozenset({INFER_WEIGHTS, KV_CACHE})
# Host-only: the push's copy of this rank's inference weights, kept to restore them before each push (LoRA's backbone,
# resharding/adapter_push.py). Never on the device, in no row; the ledger counts it with the host mirrors.
INFER_WEIGHTS_HOST = "inference_weights_host"

IDLE, SWITCH, GENERATE, REWARD = "idle", "switch", "generate", "reward"
REF_LOGPROB, OLD_LOGPROB, UPDATE = "ref_logprob", "old_logprob", "update"
TEACHER_LOGPROB = "teacher_logprob"
CRITIC_VALUES, CRITIC_UPDATE = "critic_values", "critic_update"
# Every phase, in the order an iteration enters them: `idle` is between calls (after initialize, after
# an iteration); `switch` is the weight push, entered on the way into `generate`; `reward` scores the
# responses with the reward model (a run without one never enters it); the critic's phases only with a
# critic (PPO): its values of the rollout before the update, its own update after the actor's; `teacher_logprob` only
# with on-policy distillation's teacher.
PHASES = (IDLE, SWITCH, GENERATE, REWARD, REF_LOGPROB, TEACHER_LOGPROB, OLD_LOGPROB, CRITIC_VALUES, UPDATE,
          CRITIC_UPDATE)
# The phases that run a model; the ledger records each while it runs (`memory/<phase>/...`).
RECORDED_PHASES = tuple(phase for phase in PHASES if phase not in (IDLE, SWITCH))

_NEEDS = {
    IDLE: frozenset(),
    GENERATE: frozenset({INFER_WEIGHTS, KV_CACHE}),
    REWARD: frozenset({REWARD_PARAMS}),
    REF_LOGPROB: frozenset({REF_PARAMS}),
    TEACHER_LOGPROB: frozenset({TEACHER_PARAMS}),
    OLD_LOGPROB: frozenset({TRAIN_PARAMS, ADAPTER_PARAMS}),
    UPDATE: frozenset({TRAIN_PARAMS, ADAPTER_PARAMS, TRAIN_GRADS, TRAIN_OPTIMIZER}),
    CRITIC_VALUES: frozenset({CRITIC_PARAMS}),
    CRITIC_UPDATE: CRITIC_STATES,
}
# The push reads the weights the actor's forward runs on and writes generate's weights; the KV cache
# comes after it, once the train params have left, so the cache and the train params never peak together.
_NEEDS[SWITCH] = _NEEDS[OLD_LOGPROB] | (_NEEDS[GENERATE] - {KV_CACHE})
# LoRA's switch after its first (resharding/adapter_push.py): the backbone's inference weights come from the host,
# only the adapters are read on the device. The first push reads the backbone too (`WeightPush.states_needed`).
_ADAPTER_SWITCH = frozenset({ADAPTER_PARAMS}) | (_NEEDS[GENERATE] - {KV_CACHE})
FIRST_ADAPTER_PUSH_READS = frozenset({TRAIN_PARAMS})

# A phase change does not copy these out: every push overwrites the inference weights. (Grads and the KV
# cache are dropped whenever they leave, by their registration.) ROLL's manual offload_states keeps them.
DROPPED_ON_PHASE_CHANGE = frozenset({INFER_WEIGHTS})
# Reloaded after every other move of a row, so it takes the memory the leaving states gave back.
RELOADED_LAST = KV_CACHE


def run_states(config) -> frozenset[str]:
    """The state groups a run holds, on whichever devices: the training engine's and the inference engine's always,
    the reference's with a KL term, the reward model's and the critic's where the run has them. The roles compose the
    parts declaring these (workers/roles.py) and the planner plans this table (`ResidencyPolicy.for_states`)."""
    states = {TRAIN_PARAMS, ADAPTER_PARAMS, TRAIN_GRADS, TRAIN_OPTIMIZER}
    if config.generates:  # DPO trains on given pairs: no inference engine
        states |= INFERENCE_STATES
    if config.uses_reference:
        states.add(REF_PARAMS)
    if config.reward_model is not None:
        states.add(REWARD_PARAMS)
    if config.distills:
        states.add(TEACHER_PARAMS)
    if config.critic_config is not None:
        states |= CRITIC_STATES
    return frozenset(states)


@dataclass(frozen=True, kw_only=True)
class ResidencyPolicy:
    # MindSpeed-RL's generate_config flags, given by every caller (their one default is GenerateConfig's).
    offload_train_param: bool
    offload_train_grad: bool
    offload_train_optimizer: bool
    has_reference: bool = True
    has_reward_model: bool = False
    has_teacher: bool = False  # on-policy distillation's teacher (workers/parts/teacher.py)
    has_critic: bool = False
    # False on the inference ranks of a disaggregated actor: their devices hold nothing else.
    offload_inference: bool = True
    # False on a critic's own ranks (critic.device_mapping apart from actor_train's): nothing else is there.
    offload_critic: bool = True
    # False on a teacher's own ranks (teacher.device_mapping apart from actor_train's): nothing else is there.
    offload_teacher: bool = True
    # False where the run generates nothing (DPO): no inference states, no switch, no generate phase.
    has_inference: bool = True
    # LoRA's shared backbone (rl_config.share_backbone): the reference log-probs run on the train params with the
    # adapters off; there are no reference params.
    reference_is_backbone: bool = False
    # LoRA: the adapters are a state group of their own (ADAPTER_PARAMS); its colocated switch moves the adapters
    # only (AdapterPush), so that row leaves the backbone on the host.
    has_adapters: bool = False
    adapter_only_switch: bool = False
    # False where the update gives its own old log-probs (GRPOConfig.old_logprobs_from_update): no old_logprob phase.
    has_old_logprob_pass: bool = True
    # megatron_training.swap_optimizer: the optimizer states are in no row; the update's step brings them in bucket by
    # bucket itself (memory/swap_optimizer.py).
    swap_optimizer: bool = False

    @classmethod
    def offloading(cls, **fields) -> "ResidencyPolicy":
        """Every train state off the device between its phases, as MindSpeed-RL's recipes set the three flags (the
        planner's and the tests' table when no config gives one)."""
        return cls(offload_train_param=True, offload_train_grad=True, offload_train_optimizer=True, **fields)

    @classmethod
    def for_states(cls, config, states: frozenset[str]) -> "ResidencyPolicy":
        """The table of a rank whose parts declare `states` (workers/parts/: the union of their STATES), from the
        run's GRPOConfig; the planner asks it with the states of every part of the run. The inference states stay
        where nothing else shares their devices (a disaggregated inference rank), the critic's and the teacher's where
        they are alone (on devices of their own)."""
        gen = config.generate_config
        critic_only = bool(states) and states <= CRITIC_STATES
        teacher_only = states == {TEACHER_PARAMS}
        return cls(offload_train_param=gen.offload_train_param, offload_train_grad=gen.offload_train_grad,
                   offload_train_optimizer=gen.offload_train_optimizer, has_reward_model=REWARD_PARAMS in states,
                   has_teacher=TEACHER_PARAMS in states,
                   has_reference=config.uses_reference and not (critic_only or teacher_only),
                   offload_inference=not states <= INFERENCE_STATES, has_critic=bool(states & CRITIC_STATES),
                   offload_critic=not critic_only, offload_teacher=not teacher_only,
                   reference_is_backbone=config.reference_is_backbone,
                   has_inference=config.generates,
                   has_adapters=config.actor_config.uses_lora, adapter_only_switch=config.adapter_only_switch,
                   has_old_logprob_pass=not config.old_logprobs_from_update,
                   swap_optimizer=config.megatron_training.swap_optimizer)

    @property
    def pinned(self) -> frozenset[str]:
        """States kept on the device in every phase: train states by the flags, inference states by
        `offload_inference`."""
        flags = ((TRAIN_PARAMS, self.offload_train_param),
                 (ADAPTER_PARAMS, self.offload_train_param or not self.has_adapters),
                 (TRAIN_GRADS, self.offload_train_grad),
                 (TRAIN_OPTIMIZER, self.offload_train_optimizer), (INFER_WEIGHTS, self.offload_inference),
                 (KV_CACHE, self.offload_inference))
        return frozenset(state for state, offload in flags if not offload) | (
            frozenset() if self.offload_critic else CRITIC_STATES) | (
            frozenset() if self.offload_teacher else frozenset({TEACHER_PARAMS}))

    def phases(self) -> tuple[str, ...]:
        """The phases this run enters, in order (`reward` only with a reward model, `ref_logprob` only with a
        reference, `old_logprob` only with its own pass, the critic's only with a critic, the switch and generate only
        where the run generates)."""
        return tuple(p for p in PHASES if (p != REWARD or self.has_reward_model)
                     and (p not in (SWITCH, GENERATE) or self.has_inference)
                     and (p != REF_LOGPROB or self.has_reference)
                     and (p != TEACHER_LOGPROB or self.has_teacher)
                     and (p != OLD_LOGPROB or self.has_old_logprob_pass)
                     and (p not in (CRITIC_VALUES, CRITIC_UPDATE) or self.has_critic))

    def recorded_phases(self) -> tuple[str, ...]:
        """The phases the ledger records in this run, in order."""
        return tuple(p for p in self.phases() if p in RECORDED_PHASES)

    def resident(self, phase: str) -> frozenset[str]:
        if phase not in _NEEDS:
            raise ValueError(f"unknown phase {phase!r}; phases are {PHASES}")
        needs = _ADAPTER_SWITCH if phase == SWITCH and self.adapter_only_switch else _NEEDS[phase]
        if phase == REF_LOGPROB and self.reference_is_backbone:
            needs = _NEEDS[OLD_LOGPROB]
        absent = ({REF_PARAMS} if not self.has_reference or self.reference_is_backbone else set()) | (
            {TRAIN_OPTIMIZER} if self.swap_optimizer else set()) | (
            {ADAPTER_PARAMS} if not self.has_adapters else set()) | (
            {REWARD_PARAMS} if not self.has_reward_model else set()) | (
            {TEACHER_PARAMS} if not self.has_teacher else set()) | (
            CRITIC_STATES if not self.has_critic else set()) | (
            INFERENCE_STATES if not self.has_inference else set())
        return (needs | self.pinned) - absent

    def first_switch(self) -> frozenset[str]:
        """The switch row at a run's first push: with the adapter-only switch the backbone is read then too (the
        planner charges this row: it is the switch's peak)."""
        return self.resident(SWITCH) | (FIRST_ADAPTER_PUSH_READS if self.adapter_only_switch else frozenset())

    def after(self, phase: str) -> frozenset[str]:
        """What stays on the device when `phase`'s call returns (ROLL's automatic offload): the pinned
        states and those the iteration's next phase needs too."""
        order = self.phases()
        following = order[(order.index(phase) + 1) % len(order)] if phase in order else IDLE
        return self.resident(IDLE) | (self.resident(phase) & self.resident(following))

    def table(self) -> dict[str, frozenset[str]]:
        return {phase: self.resident(phase) for phase in PHASES}

    def iteration(self) -> list[tuple[str, frozenset[str]]]:
        """The rows one colocated iteration passes through, in order and cyclic (the last leads into the
        first of the next iteration): each phase, then what stays when its call returns (named `idle` where
        that is the idle row). The switch and generate are one call, so nothing is left between them."""
        rows = []
        for phase in self.phases():
            if phase == IDLE:
                continue
            rows.append((phase, self.resident(phase)))
            rest = self.after(phase)
            if phase != SWITCH and rest != self.resident(phase):
                rows.append((IDLE if rest == self.resident(IDLE) else f"after_{phase}", rest))
        return rows
