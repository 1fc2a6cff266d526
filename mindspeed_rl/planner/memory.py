"""Bytes per device, per phase and per state group, before anything is launched.

Each rank's bytes of every state group the ledger counts (`memory/ledger.py` categories) come from the
layouts (`planner/params.py`); the phase table is the sum over what the ONE residency policy
(`memory/residency.py`) keeps on the device in that phase, plus the update's activations. The figures
are per rank; the table shows, like the ledger's metrics, the largest rank of each group, and the
largest rank's total.

The update's activations are `planner/activations.py`'s.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

from mindspeed_rl.engines.vllm_cpu_linears import packs_linears
from mindspeed_rl.memory.ledger import ACTIVATIONS
from mindspeed_rl.memory.residency import (ADAPTER_PARAMS, CRITIC_OPTIMIZER, CRITIC_UPDATE, IDLE, INFER_WEIGHTS, INFER_WEIGHTS_HOST,
                                           KV_CACHE, REF_PARAMS, REWARD_PARAMS, STATE_GROUPS, SWITCH, TEACHER_PARAMS,
                                           TRAIN_GRADS, TRAIN_OPTIMIZER, TRAIN_PARAMS, UPDATE, ResidencyPolicy)
from mindspeed_rl.planner.activations import activation_bytes
from mindspeed_rl.planner.critic import CRITIC_ACTIVATIONS, critic_activations, critic_states
from mindspeed_rl.planner.expert_map import redundant_expert_numel
from mindspeed_rl.planner.inputs import DTYPE_BYTES, PlanInputs
from mindspeed_rl.planner.lora import actor_train_bytes, push_host_copy_bytes
from mindspeed_rl.planner.params import (reward_model_bytes, teacher_bytes, vllm_numel, vllm_packed_linear_numel,
                                         vllm_stage_layers)
from mindspeed_rl.planner.switch import COPIED
from mindspeed_rl.sizes import format_bytes



# -- per rank -------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class RankBytes:
    rank: int
    states: dict[str, int]  # STATE_GROUPS + activations
    switch_staging: int = 0
    # A device with a table of its own (the critic's own devices); None: the plan's.
    policy: ResidencyPolicy | None = None
    # megatron_training.swap_optimizer: the optimizer states the update's step holds at once (one bucket; two on a
    # device, where the next one's copy overlaps the step)
    swap_bucket_bytes: int = 0
    # Of states[INFER_WEIGHTS], the oneDNN-packed copies vLLM on CPU reads (engines/vllm_cpu_linears.py): made from the
    # pushed weights, never pushed or copied themselves.
    inference_packed_bytes: int = 0

    @property
    def pushed_weight_bytes(self) -> int:
        """vLLM's own parameters: what the push writes."""
        return self.states[INFER_WEIGHTS] - self.inference_packed_bytes

    def phase(self, policy: ResidencyPolicy, phase: str) -> dict[str, int]:
        """Bytes per category on this rank in `phase` (0 for what is not resident); the switch (its first push, the
        largest) adds the push's staging buffers; a swapped optimizer's step holds one bucket in the update."""
        resident = policy.first_switch() if phase == SWITCH else policy.resident(phase)
        out = {c: (self.states[c] if c in resident else 0) for c in STATE_GROUPS}
        if policy.swap_optimizer and phase == UPDATE:
            out[TRAIN_OPTIMIZER] = min(self.swap_bucket_bytes, self.states[TRAIN_OPTIMIZER])
        out[ACTIVATIONS] = {UPDATE: self.states[ACTIVATIONS],
                            CRITIC_UPDATE: self.states.get(CRITIC_ACTIVATIONS, 0)}.get(phase, 0)
        if phase == SWITCH:
            out["switch_staging"] = self.switch_staging
        return out


def kv_cache_bytes(inputs: PlanInputs, inference_weight_bytes: int, infer_pp_rank: int = 0) -> int:
    kv = inputs.kv
    if kv.on_cpu:
        return max(kv.cpu_bytes, 1 << 20)  # engines/vllm_engine.py: kv_cache_memory_bytes
    if inputs.device_memory is not None:
        return max(0, int(kv.gpu_memory_utilization * inputs.device_memory) - inference_weight_bytes)
    return kv_needed_bytes(inputs, infer_pp_rank)


def kv_needed_bytes(inputs: PlanInputs, infer_pp_rank: int | None = None) -> int:
    """What max_num_seqs sequences of max_model_len tokens need on one vLLM rank of stage `infer_pp_rank`
    (a stage caches its own layers only); None: the stage with the most layers."""
    stages = range(inputs.infer_pp) if infer_pp_rank is None else (infer_pp_rank,)
    layers = max(len(vllm_stage_layers(inputs.arch, stage, inputs.infer_pp)) for stage in stages)
    per_token = inputs.arch.kv_bytes_per_token(inputs.infer_tp, DTYPE_BYTES[inputs.infer_dtype], layers)
    return inputs.kv.max_num_seqs * inputs.kv.max_model_len * per_token


def rank_bytes(inputs: PlanInputs, rank: int, *, switch_staging: int = 0) -> RankBytes:
    c = inputs.rank_coordinates(rank)
    train = actor_train_bytes(inputs, c)
    infer = infer_weight_bytes(inputs, c)
    packed = packed_linear_bytes(inputs, c)
    states = {
        TRAIN_PARAMS: train.params, ADAPTER_PARAMS: train.adapter_params, TRAIN_GRADS: train.grads,
        TRAIN_OPTIMIZER: train.optimizer,
        REF_PARAMS: train.reference if inputs.policy.has_reference else 0,
        REWARD_PARAMS: reward_model_bytes(inputs.reward_arch or inputs.arch, tp=inputs.tp, pp=inputs.pp,
                                          pp_rank=c["pp_rank"], bf16=inputs.bf16)
        if inputs.policy.has_reward_model else 0,
        TEACHER_PARAMS: teacher_bytes(inputs.teacher_arch or inputs.arch, tp=inputs.tp, pp=inputs.pp,
                                      pp_rank=c["pp_rank"], ep=inputs.ep, bf16=inputs.bf16)
        if inputs.policy.has_teacher and not inputs.teacher_world_size else 0,
        INFER_WEIGHTS: infer + packed, KV_CACHE: kv_cache_bytes(inputs, infer, c["infer_pp_rank"]),
        ACTIVATIONS: activation_bytes(inputs, c["pp_rank"]),
        **critic_states(inputs, c, on_this_rank=not inputs.critic_world_size),
    }
    # memory/swap_optimizer.py: a bucket is the share of swap_optimizer_times plus at most its largest param; on a
    # device the next bucket comes in while one steps
    bucket = (-(-train.optimizer // inputs.swap_optimizer_times) + train.largest_optimizer) * (
        1 if inputs.kv.on_cpu else 2)
    return RankBytes(rank, states, switch_staging, swap_bucket_bytes=bucket if inputs.policy.swap_optimizer else 0,
                     inference_packed_bytes=packed)


def infer_weight_bytes(inputs: PlanInputs, c: dict[str, int]) -> int:
    """The vLLM shard of the rank with coordinates `c`, and with an EPLB map (inputs.expert_slots) the experts the map
    places there beyond the even share (its redundant copies; planner/expert_map.py)."""
    numel = vllm_numel(inputs.arch, tp=inputs.infer_tp, tp_rank=c["infer_tp_rank"], dp=inputs.infer_dp,
                       dp_rank=c["infer_dp_rank"], expert_parallel=inputs.infer_expert_parallel,
                       pp=inputs.infer_pp, pp_rank=c["infer_pp_rank"])
    if inputs.expert_slots is not None:
        numel += redundant_expert_numel(inputs.arch, inputs.expert_slots,
                                        vllm_stage_layers(inputs.arch, c["infer_pp_rank"], inputs.infer_pp),
                                        c["infer_ep_rank"], inputs.infer_tp * inputs.infer_dp)
    return numel * DTYPE_BYTES[inputs.infer_dtype]


def packed_linear_bytes(inputs: PlanInputs, c: dict[str, int]) -> int:
    """The oneDNN-packed copies of the linear weights vLLM on a CPU host GEMMs with (engines/vllm_cpu_linears.py)."""
    if not (inputs.kv.on_cpu and packs_linears()):
        return 0
    numel = vllm_packed_linear_numel(inputs.arch, tp=inputs.infer_tp, dp=inputs.infer_dp,
                                     expert_parallel=inputs.infer_expert_parallel, pp=inputs.infer_pp,
                                     pp_rank=c["infer_pp_rank"])
    return numel * DTYPE_BYTES[inputs.infer_dtype]


def critic_device_bytes(inputs: PlanInputs, index: int) -> RankBytes:
    """Device `index` of the critic's own devices, after the others (numbered on from the training ranks): the
    critic's states in every phase (nothing else is there to take turns with), its update's activations."""
    states = {category: 0 for category in (*STATE_GROUPS, ACTIVATIONS)}
    states |= critic_states(inputs, inputs.for_critic().rank_coordinates(index), on_this_rank=True)
    policy = replace(inputs.policy, offload_critic=False, has_reference=False, has_reward_model=False,
                     has_teacher=False)
    return RankBytes(inputs.world_size + index, states, policy=policy)


def teacher_device_bytes(inputs: PlanInputs, index: int) -> RankBytes:
    """Device `index` of the teacher's own devices, after every other (numbered on from the critic's own): its params
    in its own TP x PP, in every phase (nothing else is there to take turns with)."""
    from mindspeed_rl.parallel.layout import TrainLayout

    pp_rank = TrainLayout(tp=inputs.teacher_tp, pp=inputs.teacher_pp).of(index, inputs.teacher_world_size).pp_rank
    states = {category: 0 for category in (*STATE_GROUPS, ACTIVATIONS)}
    states[TEACHER_PARAMS] = teacher_bytes(inputs.teacher_arch or inputs.arch, tp=inputs.teacher_tp,
                                           pp=inputs.teacher_pp, pp_rank=pp_rank, ep=1, bf16=inputs.bf16)
    policy = replace(inputs.policy, offload_teacher=False, has_reference=False, has_reward_model=False,
                     has_critic=False)
    return RankBytes(inputs.world_size + inputs.critic_world_size + index, states, policy=policy)


# -- the plan -------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class MemoryPlan:
    inputs: PlanInputs
    ranks: tuple[RankBytes, ...]

    def rank_phase(self, rank: RankBytes, phase: str) -> dict[str, int]:
        return rank.phase(rank.policy or self.inputs.policy, phase)

    def host_bytes(self, rank: RankBytes) -> dict[str, int]:
        """Host bytes per state on `rank`, as the offloader holds them (memory/offload.py): the mirror of every state
        that keeps its contents when it leaves the device and is not pinned there (all leave in `idle`), and the
        push's host copy of the inference weights (LoRA's backbone)."""
        pinned = (rank.policy or self.inputs.policy).resident(IDLE)
        out = {state: (rank.states[state] if state not in pinned else 0) for state in COPIED}
        out[INFER_WEIGHTS_HOST] = push_host_copy_bytes(self.inputs, rank.pushed_weight_bytes)
        return out

    def host_table(self) -> dict[str, int]:
        """State -> host bytes of the largest rank (as the ledger's metrics, the maximum over ranks)."""
        rows = [self.host_bytes(r) for r in self.ranks]
        return {state: max(row[state] for row in rows) for state in rows[0]}

    @property
    def ledger_phases(self) -> tuple[str, ...]:
        """The phases the run's ledger records (metrics.jsonl), the residency table's."""
        return self.inputs.policy.recorded_phases()

    @property
    def table_phases(self) -> tuple[str, ...]:
        """Every phase the run enters, idle and the switch included."""
        return self.inputs.policy.phases()

    def table(self, phases: tuple[str, ...] | None = None) -> dict[str, dict[str, int]]:
        """phase -> category -> bytes: the largest rank of each category (as the ledger's metrics)."""
        phases = phases or self.table_phases
        out = {}
        for phase in phases:
            rows = [self.rank_phase(r, phase) for r in self.ranks]
            out[phase] = {c: max(row[c] for row in rows) for c in rows[0]}
        return out

    def totals(self, phases: tuple[str, ...] | None = None) -> dict[str, tuple[int, int]]:
        """phase -> (rank, bytes) of the rank with the largest total (the lowest rank among equals)."""
        return {phase: self._largest_rank(phase, self.rank_phase) for phase in phases or self.table_phases}

    def _largest_rank(self, phase: str, row_of) -> tuple[int, int]:
        """(rank, bytes) of the largest sum of `row_of(rank, phase)` over the ranks, the lowest rank among equals."""
        total, negative_rank = max((sum(row_of(rank, phase).values()), -rank.rank) for rank in self.ranks)
        return -negative_rank, total

    def first_iteration_totals(self) -> dict[str, tuple[int, int]]:
        """`totals()` of the first iteration: Adam's moments are made by an optimizer's first step (torch's lazy
        state), so until the update (the critic's until its own) a bf16 model's optimizer states are its fp32 masters
        only (4 of 12 bytes per param), an fp32 model's none."""
        out, made = {}, set()
        for phase in self.table_phases:
            made |= {UPDATE: {TRAIN_OPTIMIZER}, CRITIC_UPDATE: {CRITIC_OPTIMIZER}}.get(phase, set())
            lazy = {TRAIN_OPTIMIZER, CRITIC_OPTIMIZER} - made

            def before_first_step(rank: RankBytes, phase: str) -> dict[str, int]:
                row = self.rank_phase(rank, phase)
                return row | {c: row.get(c, 0) // 3 if self.inputs.bf16 else 0 for c in lazy}

            out[phase] = self._largest_rank(phase, before_first_step)
        return out

    def first_over(self, capacity_bytes: int) -> tuple[str, int, int] | None:
        """(phase, rank, bytes) of the first phase a run enters - the first iteration's, then every later one's -
        whose largest rank passes `capacity_bytes`: where a run on devices that size runs out (memory/capacity.py);
        None when every phase fits."""
        for totals in (self.first_iteration_totals(), self.totals()):
            for phase, (rank, total) in totals.items():
                if total > capacity_bytes:
                    return phase, rank, total
        return None

    def peak(self) -> tuple[str, int, int]:
        """(phase, rank, bytes) of the largest total."""
        phase, (rank, total) = max(self.totals().items(), key=lambda item: item[1][1])
        return phase, rank, total

    def problems(self) -> list[str]:
        """What cannot work whatever the peak: vLLM's share of the device below its weights (no KV cache)."""
        i = self.inputs
        if i.kv.on_cpu or i.device_memory is None:
            return []
        budget = int(i.kv.gpu_memory_utilization * i.device_memory)
        weights = max(r.states[INFER_WEIGHTS] for r in self.ranks)
        if weights >= budget:
            return [f"vLLM's share gpu_memory_utilization {i.kv.gpu_memory_utilization} x {format_bytes(i.device_memory)}"
                    f" = {format_bytes(budget)} does not hold its weights ({format_bytes(weights)}): no room for a KV "
                    "cache, vLLM cannot start"]
        return []

    def fits(self) -> bool | None:
        memory = self.inputs.device_memory
        return None if memory is None else self.peak()[2] <= memory and not self.problems()

    def with_seq_length(self, seq_length: int) -> "MemoryPlan":
        """The same plan with the update's activations at another sequence length (the trainer passes
        each iteration's batch width)."""
        inputs = replace(self.inputs, seq_length=seq_length)
        return MemoryPlan(inputs, tuple(_with_activations(inputs, r) for r in self.ranks))

    def ledger_metrics(self, prefix: str = "memory") -> dict[str, float]:
        """`memory/<phase>/predicted_bytes` and `memory/<phase>/<category>_predicted_bytes` for the phases the
        ledger records, beside its measured `memory/<phase>/<category>_bytes` in metrics.jsonl."""
        out = {}
        phases = self.ledger_phases
        table, totals = self.table(phases), self.totals(phases)
        for phase in phases:
            for category, value in table[phase].items():
                if category == ACTIVATIONS and phase != UPDATE:
                    continue
                if category == REWARD_PARAMS and not self.inputs.policy.has_reward_model:
                    continue  # the ledger of a run without a reward model has no such category
                if category == TEACHER_PARAMS and not self.inputs.policy.has_teacher:
                    continue
                out[f"{prefix}/{phase}/{category}_predicted_bytes"] = float(value)
            out[f"{prefix}/{phase}/predicted_bytes"] = float(totals[phase][1])
        # Host bytes do not change with the phase once every state has left the device once (at initialize).
        out |= {f"{prefix}/host/{state}_predicted_bytes": float(value) for state, value in self.host_table().items()}
        return out


def _with_activations(inputs: PlanInputs, rank: RankBytes) -> RankBytes:
    """`rank` with the update's and the critic update's activations of `inputs` (its sequence length)."""
    states = dict(rank.states)
    own_devices = rank.policy is not None  # a part alone on devices of its own (no actor there)
    if not own_devices:
        states[ACTIVATIONS] = activation_bytes(inputs, inputs.rank_coordinates(rank.rank)["pp_rank"])
    states |= critic_activations(inputs, rank.rank, states, own_devices=own_devices)
    return replace(rank, states=states)


def plan_memory(inputs: PlanInputs, *, switch_staging: dict[int, int] | None = None) -> MemoryPlan:
    staging = switch_staging or {}
    ranks, by_key = [], {}
    for rank in range(inputs.world_size):
        c = inputs.rank_coordinates(rank)
        # TP and EP ranks of a stage hold equal shapes; only the stage (train and vLLM's) and the optimizer's DP
        # shards differ, and with an EPLB map the experts vLLM's EP rank holds.
        key = (c["pp_rank"], c["dp_cp_rank"], c["expert_dp_rank"], c["infer_pp_rank"],
               c["infer_ep_rank"] if inputs.expert_slots is not None else 0)
        if key not in by_key:
            by_key[key] = rank_bytes(inputs, rank)
        ranks.append(replace(by_key[key], rank=rank, switch_staging=staging.get(rank, 0)))
    ranks += [critic_device_bytes(inputs, index) for index in range(inputs.critic_world_size)]
    ranks += [teacher_device_bytes(inputs, index) for index in range(inputs.teacher_world_size)]
    return MemoryPlan(inputs, tuple(ranks))
