"""What each switch moves, per rank, and how long that takes at stated bandwidths.

The train -> infer push is the resharding plan itself (`resharding/plan.py build_plan`, the function the
engine's ShardingManager executes): each rank's received, sent and locally copied elements, counted at the
inference dtype (every range travels in the dtype of the vLLM parameter it lands in). Its extra memory is
the transfer's two staging buffers, min(received, bucket) + min(sent, bucket), which is what the engine
reports as `resharding/peak_extra_bytes`.

The host <-> device moves of an iteration are the differences between consecutive rows of the residency
table as the engine enters them (`ResidencyPolicy.iteration`: each phase, then what stays when its call
returns; the train params stay from old_logprob into update): states that keep their contents are copied
(train params, optimizer states, reference and reward params), grads are dropped and come back as zeros,
vLLM's weights are dropped after generating and refilled by the push, the KV cache is released and rebuilt
empty.
"""
from __future__ import annotations

from dataclasses import dataclass

from mindspeed_rl.memory.residency import (ADAPTER_PARAMS, CRITIC_OPTIMIZER, CRITIC_PARAMS, REF_PARAMS, REWARD_PARAMS,
                                           TEACHER_PARAMS, TRAIN_OPTIMIZER, TRAIN_PARAMS)
from mindspeed_rl.planner.inputs import DTYPE_BYTES, PlanInputs

# Groups whose contents cross host <-> device (grads, vLLM's weights and the KV cache are dropped).
COPIED = (TRAIN_PARAMS, ADAPTER_PARAMS, TRAIN_OPTIMIZER, REF_PARAMS, REWARD_PARAMS, TEACHER_PARAMS, CRITIC_PARAMS,
          CRITIC_OPTIMIZER)


@dataclass(frozen=True)
class RankSwitch:
    rank: int
    received: int
    sent: int
    local: int
    staging: int


@dataclass(frozen=True)
class SwitchPlan:
    ranks: tuple[RankSwitch, ...]
    link_bytes_per_second: float

    @property
    def max_received(self) -> int:
        return max(r.received for r in self.ranks)

    @property
    def max_sent(self) -> int:
        return max(r.sent for r in self.ranks)

    @property
    def seconds(self) -> float:
        """Point-to-point, both directions at once: the busiest rank's larger direction over the link."""
        return max(max(r.received, r.sent) for r in self.ranks) / self.link_bytes_per_second


def plan_switch(inputs: PlanInputs, *, link_bytes_per_second: float) -> SwitchPlan | None:
    """The push's bytes per rank from the resharding plan; None where the engine has no layout for the model."""
    spec = inputs.arch.to_spec()
    if spec is None:
        return None
    from mindspeed_rl.resharding.plan import build_plan

    # inputs.infer_layout is InferLayout(tp, pp, expert_parallel): each rank receives only its stage's parameters.
    plan = build_plan(spec, inputs.train_layout, inputs.infer_layout, inputs.world_size)
    size = DTYPE_BYTES[inputs.infer_dtype]
    ranks = []
    for rank in range(inputs.world_size):
        stats = plan.stats[rank]
        received, sent = stats["received_numel"] * size, stats["sent_numel"] * size
        staging = min(received, inputs.bucket_bytes) + min(sent, inputs.bucket_bytes)
        ranks.append(RankSwitch(rank, received, sent, stats["local_numel"] * size, staging))
    return SwitchPlan(tuple(ranks), link_bytes_per_second)


@dataclass(frozen=True)
class Move:
    """Host <-> device copies when the residency goes from one row to the next (largest rank)."""

    before: str
    after: str
    onload: int
    offload: int


def iteration_moves(inputs: PlanInputs, states: dict[str, int]) -> list[Move]:
    """`states`: one rank's bytes per state group."""
    rows = inputs.policy.iteration()
    moves = []
    for (before, was), (after, will) in zip(rows, rows[1:] + rows[:1]):
        onload = sum(states[g] for g in COPIED if g in will and g not in was)
        offload = sum(states[g] for g in COPIED if g in was and g not in will)
        moves.append(Move(before, after, onload, offload))
    return moves
