"""Bytes per device, per phase and per state group, before anything is launched.

Each rank's bytes of every state group the ledger counts (`memory/ledger.py` categories) come from the
layouts (`planner/params.py`); the phase table is the sum over what the ONE residency policy
(`memory/residency.py`) keeps on the device in that phase, plus the update's activations. The figures
are per rank; the table shows, like the ledger's metrics, the largest rank of each group, and the
largest rank's total.

Activations (the update phase; forward-only phases save nothing for backward), bytes per token of a
micro-batch of `micro_batch_size x seq_length` tokens, `e` the param dtype's bytes, `t` the train TP, two
profiles (`PlanInputs.activation_profile`):

cpu (what this engine's CPU path keeps: Megatron's local spec, torch norms, unfused attention; measured)
    per layer   (16 + 2e) h [/t with sequence parallel] + 4e q/t + 5e f/t + c a/t s
accelerator (the published count, Korthikanti et al. 2022 "Reducing Activation Recomputation in Large
Transformer Models", Table 2: 34 s b h / t with sequence parallel, adjusted for GQA, SwiGLU, RMSNorm and
no dropout, with the fused kernels MindSpeed/TE select: fused RMSNorm and SwiGLU keep their input only,
flash attention its output and a logsumexp)
    per layer   4e h [/t with sequence parallel] + (2e q + 2e kv + 3e f) / t + c a/t s
                (the two norms' inputs 2eh, the QKV and fc1 inputs eh each; Q eq, K and V 2e kv, the
                attention output eq; fc1's gate and up 2ef, fc2's input ef)
both
    first stage + 8 (the token ids the embedding keeps)
    last stage  + (8 + e) h, and per response token + e V/t + 24 (the response rows of the logits, in their own
                dtype and vocabulary-sharded, and four numbers per token: engines/vocab_parallel.py)
with q = heads x head_dim, kv = KV heads x head_dim, f the MLP width (MoE layers: top-k x the expert width +
the shared experts' width, + 8 E for the router's fp32 logits and probabilities + 2e k h for the dispatched
tokens), c = 4 in fp32 and 4 + e otherwise (the attention probabilities in fp32; 0 with flash attention on
an accelerator or with packed sequences, whose per-sample attention keeps none: measured within 4%). A
micro-batch holds micro_batch_size x seq_length tokens, or with use_dynamic_bsz its token budget. A pipeline
stage p of PP holds min(PP - p, micro-batches per step) micro-batches (1F1B).
The cpu coefficients were measured on this engine's path (`with_entropy=True` in the loss) by varying each
of h, f, head_dim, heads, seq, V, TP, PP and dtype on CPU; they reproduce the demos' measured
`memory/update/activations_bytes` within 3%. The accelerator profile is the formula, not a measurement
(no accelerator here); MoE and MLA terms are estimates, not calibrated.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING

from mindspeed_rl.memory.ledger import ACTIVATIONS
from mindspeed_rl.memory.residency import (INFER_WEIGHTS, KV_CACHE, REF_PARAMS, REWARD_PARAMS, STATE_GROUPS, SWITCH,
                                           TRAIN_GRADS, TRAIN_OPTIMIZER, TRAIN_PARAMS, UPDATE, ResidencyPolicy)
from mindspeed_rl.planner.arch import Architecture
from mindspeed_rl.planner.params import (reward_model_bytes, stage_layers, stage_train_bytes, vllm_numel,
                                         vllm_stage_layers)

if TYPE_CHECKING:
    from mindspeed_rl.resharding.plan import InferLayout

ACTIVATION_PROFILES = ("cpu", "accelerator")
DTYPE_BYTES = {"float32": 4, "fp32": 4, "bfloat16": 2, "bf16": 2, "float16": 2, "fp16": 2}
GIB = 1 << 30


@dataclass(frozen=True, kw_only=True)
class KVCacheSpec:
    """How vLLM sizes its KV cache: bytes on CPU (`cpu_kvcache_space_gb`); on an accelerator the
    `gpu_memory_utilization` share of the device minus the weights, or without a device size what
    `max_num_seqs` sequences of `max_model_len` tokens need."""

    on_cpu: bool
    cpu_bytes: int = 0
    gpu_memory_utilization: float = 0.5
    max_num_seqs: int = 1
    max_model_len: int = 1


@dataclass(frozen=True, kw_only=True)
class PlanInputs:
    arch: Architecture
    world_size: int
    tp: int = 1
    pp: int = 1
    ep: int = 1
    infer_tp: int = 1
    infer_pp: int = 1  # vLLM pipeline stages (generate_config.infer_pipeline_parallel_size)
    infer_expert_parallel: bool = False
    bf16: bool = False
    infer_dtype: str = "float32"
    distributed_optimizer: bool = False
    sequence_parallel: bool = False
    flash_attention: bool = False
    micro_batch_size: int = 1
    mini_batch_samples: int = 1  # samples per optimizer step, over all DP ranks
    seq_length: int = 1  # prompt + response tokens of a micro-batch's rows
    response_length: int | None = None  # response tokens of a row (scored by the loss); None: seq_length
    policy: ResidencyPolicy = field(default_factory=ResidencyPolicy)
    kv: KVCacheSpec = field(default_factory=lambda: KVCacheSpec(on_cpu=True))
    device_memory: int | None = None
    bucket_bytes: int = 64 << 20  # generate_config.resharding_bucket_mb
    # The reward model's architecture (rewards.<name>.model_path) when policy.has_reward_model; None: the actor's.
    reward_arch: Architecture | None = None
    activation_profile: str = "cpu"  # ACTIVATION_PROFILES: which kernels' activations the update keeps
    packed: bool = False  # rl_config.use_remove_padding: per-sample attention, no score matrix kept
    # rl_config.use_dynamic_bsz: an update micro-batch holds at most this many tokens (update_max_packing_token_size)
    packing_token_budget: int | None = None
    # actor_config.recompute_*: Megatron's activation recompute in the update
    recompute_granularity: str | None = None
    recompute_method: str | None = None
    recompute_num_layers: int | None = None

    def __post_init__(self) -> None:
        if self.activation_profile not in ACTIVATION_PROFILES:
            raise ValueError(f"activation_profile must be one of {ACTIVATION_PROFILES}, got {self.activation_profile!r}")
        if self.world_size % (self.tp * self.pp):
            raise ValueError(f"train TP*PP={self.tp * self.pp} must divide the world size {self.world_size}")
        if self.world_size % (self.infer_tp * self.infer_pp):
            raise ValueError(f"infer TP*PP={self.infer_tp}*{self.infer_pp}={self.infer_tp * self.infer_pp} must "
                             f"divide the world size {self.world_size}")
        if self.dp % self.ep:
            raise ValueError(f"EP={self.ep} must divide the data-parallel size {self.dp}")

    @property
    def dp(self) -> int:
        return self.world_size // (self.tp * self.pp)

    @property
    def infer_dp(self) -> int:
        return self.world_size // (self.infer_tp * self.infer_pp)

    @property
    def infer_layout(self) -> "InferLayout":
        """The engine's own inference layout: its rank order is the one the planner's coordinates follow."""
        from mindspeed_rl.resharding.plan import InferLayout

        return InferLayout(tp=self.infer_tp, pp=self.infer_pp, expert_parallel=self.infer_expert_parallel)

    @property
    def sequence_parallel_effective(self) -> bool:
        return self.tp > 1 and (self.sequence_parallel or self.arch.is_moe)  # Megatron: MoE + TP needs SP

    @property
    def micro_batches_per_step(self) -> int:
        if self.packing_token_budget is not None:  # at the worst case every sample is seq_length long
            tokens = self.mini_batch_samples // self.dp * self.seq_length
            return max(1, -(-tokens // self.packing_token_budget))
        return max(1, self.mini_batch_samples // (self.dp * self.micro_batch_size))

    @property
    def tokens_per_micro_batch(self) -> int:
        """The update micro-batch's tokens at the worst case: micro_batch_size rows of padded_seq_length, or the
        token budget of a token-budget micro-batch."""
        if self.packing_token_budget is not None:
            return self.packing_token_budget
        return self.micro_batch_size * self.padded_seq_length

    @property
    def padded_seq_length(self) -> int:
        multiple = self.tp if self.sequence_parallel_effective else 1
        return -(-self.seq_length // multiple) * multiple

    def rank_coordinates(self, rank: int) -> dict[str, int]:
        """Megatron's order tp-cp-ep-dp-pp (the engine's TrainLayout) and vLLM's DP x PP x TP (InferLayout)."""
        tp_rank, pp_rank = rank % self.tp, rank // (self.tp * self.dp)
        dp_rank = (rank // self.tp) % self.dp
        ep_rank = dp_rank % self.ep
        infer = self.infer_layout
        return dict(tp_rank=tp_rank, pp_rank=pp_rank, dp_rank=dp_rank, ep_rank=ep_rank,
                    expert_dp_rank=dp_rank // self.ep, infer_tp_rank=infer.tp_rank(rank),
                    infer_pp_rank=infer.pp_rank(rank), infer_dp_rank=infer.dp_rank(rank))


# -- activations ----------------------------------------------------------------------------------------
@dataclass(frozen=True)
class ActivationTerms:
    """Bytes per token (see the module docstring)."""

    dense_layer: float
    moe_layer: float
    first_stage: float
    last_stage: float
    last_stage_per_response_token: float


def activation_terms(inputs: PlanInputs) -> ActivationTerms:
    arch, t = inputs.arch, inputs.tp
    e = 2 if inputs.bf16 else 4
    h, s = arch.hidden_size, inputs.padded_seq_length
    h_split = t if inputs.sequence_parallel_effective else 1
    # Flash attention, the packed path's per-sample attention and selective recompute keep no score matrix.
    no_scores = inputs.flash_attention or inputs.packed or inputs.recompute_granularity == "selective"
    scores = 0.0 if no_scores else (4 if e == 4 else 4 + e) * arch.num_attention_heads / t * s
    if inputs.activation_profile == "cpu":
        attention = (16 + 2 * e) * h / h_split + 4 * e * arch.q_width / t + scores
        mlp_per_width = 5 * e
    else:
        attention = 4 * e * h / h_split + (2 * e * arch.q_width + 2 * e * arch.kv_width) / t + scores
        mlp_per_width = 3 * e
    dense = attention + mlp_per_width * arch.intermediate_size / t
    moe = attention
    if arch.is_moe:
        moe += mlp_per_width * (arch.moe_topk * arch.moe_intermediate_size + arch.shared_expert_size) / t
        moe += 8 * arch.num_experts + 2 * e * arch.moe_topk * h
    return ActivationTerms(dense_layer=dense, moe_layer=moe, first_stage=8.0, last_stage=(8 + e) * h,
                           last_stage_per_response_token=e * arch.vocab_size / t + 24)


def activation_bytes(inputs: PlanInputs, pp_rank: int) -> int:
    """Peak bytes autograd keeps for backward on a rank of pipeline stage `pp_rank` during the update."""
    terms = activation_terms(inputs)
    layers = stage_layers(inputs.arch, pp_rank, inputs.pp)
    per_token, recomputing = _recomputed_layers(
        inputs, [terms.moe_layer if inputs.arch.is_moe_layer(i) else terms.dense_layer for i in layers])
    if pp_rank == 0:
        per_token += terms.first_stage
        recomputing += terms.first_stage if recomputing else 0.0
    if pp_rank == inputs.pp - 1:
        response = min(inputs.seq_length, inputs.response_length or inputs.seq_length)
        per_token += terms.last_stage + terms.last_stage_per_response_token * response / inputs.padded_seq_length
    in_flight = min(inputs.pp - pp_rank, inputs.micro_batches_per_step)
    # One micro-batch at a time runs its backward, and recomputes there: the others keep what forward left.
    return int(((in_flight - 1) * per_token + max(per_token, recomputing)) * inputs.tokens_per_micro_batch)


def _recomputed_layers(inputs: PlanInputs, layer_terms: list[float]) -> tuple[float, float]:
    """Bytes per token a stage's layers keep after a micro-batch's forward, and the peak while its backward
    recomputes (0 without full recompute). Full recompute keeps a recomputed chunk's input only (`uniform`:
    chunks of n layers; `block`: the first n layers one by one) and rebuilds the chunk in backward, when the
    layers after it have been freed and those before it still hold what forward kept (measured on CPU)."""
    if inputs.recompute_granularity != "full":
        return sum(layer_terms), 0.0
    layer_input = (2 if inputs.bf16 else 4) * inputs.arch.hidden_size / (
        inputs.tp if inputs.sequence_parallel_effective else 1)
    n = inputs.recompute_num_layers or 1
    if inputs.recompute_method == "uniform":
        chunks = [sum(layer_terms[i:i + n]) for i in range(0, len(layer_terms), n)]
        return len(chunks) * layer_input, max((j * layer_input + chunk for j, chunk in enumerate(chunks)), default=0.0)
    recomputed = min(n, len(layer_terms))
    kept = recomputed * layer_input + sum(layer_terms[recomputed:])
    return kept, max((j * layer_input + term for j, term in enumerate(layer_terms[:recomputed])), default=0.0)


# -- per rank -------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class RankBytes:
    rank: int
    states: dict[str, int]  # STATE_GROUPS + activations
    switch_staging: int = 0

    def phase(self, policy: ResidencyPolicy, phase: str) -> dict[str, int]:
        """Bytes per category on this rank in `phase` (0 for what is not resident); the switch adds the
        push's staging buffers."""
        resident = policy.resident(phase)
        out = {c: (self.states[c] if c in resident else 0) for c in STATE_GROUPS}
        out[ACTIVATIONS] = self.states[ACTIVATIONS] if phase == UPDATE else 0
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
    train = stage_train_bytes(inputs.arch, tp=inputs.tp, pp=inputs.pp, pp_rank=c["pp_rank"], ep=inputs.ep,
                              dp=inputs.dp, bf16=inputs.bf16, distributed_optimizer=inputs.distributed_optimizer,
                              dp_rank=c["dp_rank"])
    infer = vllm_numel(inputs.arch, tp=inputs.infer_tp, tp_rank=c["infer_tp_rank"], dp=inputs.infer_dp,
                       dp_rank=c["infer_dp_rank"], expert_parallel=inputs.infer_expert_parallel,
                       pp=inputs.infer_pp, pp_rank=c["infer_pp_rank"]) * DTYPE_BYTES[inputs.infer_dtype]
    states = {
        TRAIN_PARAMS: train.params, TRAIN_GRADS: train.grads, TRAIN_OPTIMIZER: train.optimizer,
        REF_PARAMS: train.reference if inputs.policy.has_reference else 0,
        REWARD_PARAMS: reward_model_bytes(inputs.reward_arch or inputs.arch, tp=inputs.tp, pp=inputs.pp,
                                          pp_rank=c["pp_rank"], bf16=inputs.bf16)
        if inputs.policy.has_reward_model else 0,
        INFER_WEIGHTS: infer, KV_CACHE: kv_cache_bytes(inputs, infer, c["infer_pp_rank"]),
        ACTIVATIONS: activation_bytes(inputs, c["pp_rank"]),
    }
    return RankBytes(rank, states, switch_staging)


# -- the plan -------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class MemoryPlan:
    inputs: PlanInputs
    ranks: tuple[RankBytes, ...]

    def rank_phase(self, rank: RankBytes, phase: str) -> dict[str, int]:
        return rank.phase(self.inputs.policy, phase)

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
        """phase -> (rank, bytes) of the rank with the largest total."""
        phases = phases or self.table_phases
        out = {}
        for phase in phases:
            best = max(self.ranks, key=lambda r: (sum(self.rank_phase(r, phase).values()), -r.rank))
            out[phase] = (best.rank, sum(self.rank_phase(best, phase).values()))
        return out

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
        ranks = tuple(RankBytes(r.rank, {**r.states, ACTIVATIONS: activation_bytes(inputs, inputs.rank_coordinates(
            r.rank)["pp_rank"])}, r.switch_staging) for r in self.ranks)
        return MemoryPlan(inputs, ranks)

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
                out[f"{prefix}/{phase}/{category}_predicted_bytes"] = float(value)
            out[f"{prefix}/{phase}/predicted_bytes"] = float(totals[phase][1])
        return out


def plan_memory(inputs: PlanInputs, *, switch_staging: dict[int, int] | None = None) -> MemoryPlan:
    staging = switch_staging or {}
    ranks, by_key = [], {}
    for rank in range(inputs.world_size):
        c = inputs.rank_coordinates(rank)
        # TP and EP ranks of a stage hold equal shapes; only the stage (train and vLLM's) and the optimizer's DP
        # shards differ.
        key = (c["pp_rank"], c["dp_rank"], c["expert_dp_rank"], c["infer_pp_rank"])
        if key not in by_key:
            by_key[key] = rank_bytes(inputs, rank)
        ranks.append(RankBytes(rank, by_key[key].states, staging.get(rank, 0)))
    return MemoryPlan(inputs, tuple(ranks))


def format_bytes(value: float) -> str:
    if value == 0:
        return "-"
    for unit, size in (("GiB", GIB), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if abs(value) >= size:
            return f"{value / size:.2f} {unit}"
    return f"{int(value)} B"


def parse_bytes(text: str) -> int:
    """'64GiB', '80GB', '512MiB', '1.5TiB', '123' (bytes)."""
    units = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
             "KIB": 1 << 10, "MIB": 1 << 20, "GIB": 1 << 30, "TIB": 1 << 40, "K": 1 << 10, "M": 1 << 20,
             "G": 1 << 30, "T": 1 << 40}
    stripped = text.strip().replace(" ", "")
    number = stripped.rstrip("KMGTiBkmgtib")
    unit = stripped[len(number):].upper()
    if unit not in units or not number:
        raise ValueError(f"{text!r} is not a size like 64GiB, 80GB or 1.5TiB")
    try:
        value = float(number)
    except ValueError:
        raise ValueError(f"{text!r} is not a size like 64GiB, 80GB or 1.5TiB") from None
    if value <= 0 or not math.isfinite(value):
        raise ValueError(f"{text!r} must be a positive size")
    return int(value * units[unit])
