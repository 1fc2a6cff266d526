"""The one residency policy: which state groups are on the device in each phase of an iteration.

The switch (`ShardingManager.enter`) moves exactly the difference between what is resident and what
the next phase's row says; ROLL's per-RPC reload/offload and the planner (`cli/plan.py`) read the
same table, so what the engine does and what the planner predicts cannot drift apart.

A phase's row is what the phase needs, plus the train states that MindSpeed-RL's
`generate_config.offload_train_*` flags keep on the device: a flag set to false pins that state in
every phase (it never moves, so the switch is cheaper and the device fuller), not only in generate.
"""
from __future__ import annotations

from dataclasses import dataclass

TRAIN_PARAMS, TRAIN_GRADS, TRAIN_OPTIMIZER = "train_params", "train_grads", "optimizer_states"
REF_PARAMS = "reference_params"
REWARD_PARAMS = "reward_params"  # a reward model's params (rewards.<name>.model_path), colocated
INFER_WEIGHTS, KV_CACHE = "inference_weights", "kv_cache"
STATE_GROUPS = (TRAIN_PARAMS, TRAIN_GRADS, TRAIN_OPTIMIZER, REF_PARAMS, REWARD_PARAMS, INFER_WEIGHTS, KV_CACHE)

# In the order an iteration runs them; `idle` is between RPCs (after initialize, after an iteration).
# `reward` scores the responses with the reward model; a run without one never enters it.
PHASES = ("idle", "generate", "reward", "ref_logprob", "old_logprob", "update")

_NEEDS = {
    "idle": frozenset(),
    "generate": frozenset({INFER_WEIGHTS, KV_CACHE}),
    "reward": frozenset({REWARD_PARAMS}),
    "ref_logprob": frozenset({REF_PARAMS}),
    "old_logprob": frozenset({TRAIN_PARAMS}),
    "update": frozenset({TRAIN_PARAMS, TRAIN_GRADS, TRAIN_OPTIMIZER}),
}


@dataclass(frozen=True, kw_only=True)
class ResidencyPolicy:
    offload_train_param: bool = True
    offload_train_grad: bool = True
    offload_train_optimizer: bool = True
    has_reference: bool = True
    has_reward_model: bool = False

    @property
    def pinned(self) -> frozenset[str]:
        """Train states the flags keep on the device in every phase."""
        flags = ((TRAIN_PARAMS, self.offload_train_param), (TRAIN_GRADS, self.offload_train_grad),
                 (TRAIN_OPTIMIZER, self.offload_train_optimizer))
        return frozenset(state for state, offload in flags if not offload)

    def resident(self, phase: str) -> frozenset[str]:
        if phase not in _NEEDS:
            raise ValueError(f"unknown phase {phase!r}; phases are {PHASES}")
        states = _NEEDS[phase] | self.pinned
        absent = ({REF_PARAMS} if not self.has_reference else set()) | ({REWARD_PARAMS} if not self.has_reward_model
                                                                        else set())
        return states - absent

    def table(self) -> dict[str, frozenset[str]]:
        return {phase: self.resident(phase) for phase in PHASES}
