"""What the planner reads: the model, the layouts, the batch shape and the residency policy of one run
(`planner/from_config.py` builds it from a config)."""
from __future__ import annotations

from dataclasses import dataclass, field
from mindspeed_rl.memory.residency import ResidencyPolicy
from mindspeed_rl.parallel.layout import InferLayout, ParallelLayout, TrainLayout
from mindspeed_rl.planner.arch import Architecture

ACTIVATION_PROFILES = ("cpu", "accelerator")
# How context parallelism exchanges keys and values (planner/activations.py): this engine gathers them whole
# (models/context_parallel.py); MindSpeed's ring (megatron_cp_algo) and Ulysses (ulysses_cp_algo).
CP_GATHER = "gather"
CP_EXCHANGES = (CP_GATHER, "megatron_cp_algo", "ulysses_cp_algo")
DTYPE_BYTES = {"float32": 4, "fp32": 4, "bfloat16": 2, "bf16": 2, "float16": 2, "fp16": 2}


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
    cp: int = 1  # context parallelism: each sequence over cp ranks (replicas of the weights, like DP)
    cp_exchange: str = CP_GATHER  # CP_EXCHANGES: whose K/V exchange the update's activations count
    infer_tp: int = 1
    infer_pp: int = 1  # vLLM pipeline stages (generate_config.infer_pipeline_parallel_size)
    infer_expert_parallel: bool = False
    # EPLB (generate_config.expert_map_path, planner/expert_map.py): [MoE layer][vLLM EP rank] -> the experts that
    # rank holds; None: num_experts / EP each (vLLM's even placement).
    expert_slots: tuple[tuple[int, ...], ...] | None = None
    # MindSpeed's moe_tp_extend_ep with sequence parallelism: a rank dispatches its own s / TP tokens to the experts
    # (not the TP group's s); False: Megatron's TP-split experts, which see every token of the TP group.
    moe_tokens_split_over_tp: bool = False
    bf16: bool = False
    infer_dtype: str = "float32"
    distributed_optimizer: bool = False
    sequence_parallel: bool = False
    flash_attention: bool = False
    micro_batch_size: int = 1
    mini_batch_samples: int = 1  # samples per optimizer step, over all DP ranks
    seq_length: int = 1  # prompt + response tokens of a micro-batch's rows
    response_length: int | None = None  # response tokens of a row (scored by the loss); None: seq_length
    policy: ResidencyPolicy = field(default_factory=ResidencyPolicy.offloading)
    kv: KVCacheSpec = field(default_factory=lambda: KVCacheSpec(on_cpu=True))
    device_memory: int | None = None
    bucket_bytes: int = 64 << 20  # generate_config.resharding_bucket_mb
    swap_optimizer_times: int = 16  # megatron_training.swap_optimizer_times (policy.swap_optimizer)
    # The reward model's architecture (rewards.<name>.model_path) when policy.has_reward_model; None: the actor's.
    reward_arch: Architecture | None = None
    # On-policy distillation's teacher (distillation.teacher_models) when policy.has_teacher; None: the actor's.
    teacher_arch: Architecture | None = None
    # A teacher on devices of its own (teacher.device_mapping apart from actor_train's): its devices and its own TP x
    # PP there; 0 devices: it shares the training ranks, in the actor's layout.
    teacher_world_size: int = 0
    teacher_tp: int = 1
    teacher_pp: int = 1
    activation_profile: str = "cpu"  # ACTIVATION_PROFILES: which kernels' activations the update keeps
    packed: bool = False  # rl_config.use_remove_padding: per-sample attention, no score matrix kept
    # rl_config.use_dynamic_bsz: an update micro-batch holds at most this many tokens (update_max_packing_token_size)
    packing_token_budget: int | None = None
    # actor_config.recompute_*: Megatron's activation recompute in the update
    recompute_granularity: str | None = None
    recompute_method: str | None = None
    recompute_num_layers: int | None = None
    # PPO's critic (critic_config) when policy.has_critic: its architecture (None: the actor's), and its own
    # micro-batch size and activation recompute in critic_update.
    critic_arch: Architecture | None = None
    critic_micro_batch_size: int = 1
    critic_recompute: tuple[str | None, str | None, int | None] = (None, None, None)
    # The critic's own devices (critic.device_mapping apart from actor_train's); 0: it shares the training ranks.
    critic_world_size: int = 0
    # LoRA (actor_config.lora_*): the adapters' rank and target linears; () trains every weight.
    lora_rank: int = 0
    lora_targets: tuple[str, ...] = ()

    @staticmethod
    def layout_fields(layout: ParallelLayout) -> dict:
        """PlanInputs' sizes of the run's `layout` (GRPOConfig.layout): the planner plans the config's layout."""
        train, infer = layout.train, layout.infer
        return dict(world_size=layout.train_world_size, tp=train.tp, pp=train.pp, ep=train.ep, cp=train.cp,
                    infer_tp=infer.tp, infer_pp=infer.pp, infer_expert_parallel=infer.expert_parallel)

    def for_critic(self) -> "PlanInputs":
        """These inputs as the critic's update sees them: its architecture, micro-batch and recompute (the
        actor's layout and sequence parallel), on its own devices where it has them."""
        from dataclasses import replace

        granularity, method, layers = self.critic_recompute
        inputs = replace(self, arch=self.critic_arch or self.arch, micro_batch_size=self.critic_micro_batch_size,
                         recompute_granularity=granularity, recompute_method=method, recompute_num_layers=layers)
        if not self.critic_world_size:
            return inputs
        # Its own ranks: the actor's TP x PP over them, no vLLM and no experts (a dense critic) there.
        return replace(inputs, world_size=self.critic_world_size, ep=1, infer_tp=1, infer_pp=1,
                       infer_expert_parallel=False, critic_world_size=0)

    def __post_init__(self) -> None:
        if self.cp_exchange not in CP_EXCHANGES:
            raise ValueError(f"cp_exchange must be one of {CP_EXCHANGES}, got {self.cp_exchange!r}")
        if self.activation_profile not in ACTIVATION_PROFILES:
            raise ValueError(f"activation_profile must be one of {ACTIVATION_PROFILES}, got {self.activation_profile!r}")
        if self.world_size % self.train_layout.ranks_per_replica:
            raise ValueError(f"train TP*PP*CP={self.train_layout.ranks_per_replica} must divide the world size "
                             f"{self.world_size}")
        if self.world_size % (self.infer_tp * self.infer_pp):
            raise ValueError(f"infer TP*PP={self.infer_tp}*{self.infer_pp}={self.infer_tp * self.infer_pp} must "
                             f"divide the world size {self.world_size}")
        if self.dp_cp % self.ep:
            raise ValueError(f"EP={self.ep} must divide the data-parallel x context-parallel size {self.dp_cp}")

    @property
    def dp(self) -> int:
        """Megatron's data-parallel size: the ranks that take different samples (CP ranks share theirs)."""
        return self.train_layout.dp(self.world_size)

    @property
    def dp_cp(self) -> int:
        """The ranks that hold the same weights, DP x CP (Megatron's data-parallel group with context parallelism:
        the gradients are reduced and the distributed optimizer shards over them; EP is carved out of them)."""
        return self.dp * self.cp

    @property
    def infer_dp(self) -> int:
        return self.world_size // (self.infer_tp * self.infer_pp)

    @property
    def infer_layout(self) -> InferLayout:
        """The engine's own inference layout (parallel/layout.py): the planner's coordinates follow its rank order."""
        return InferLayout(tp=self.infer_tp, pp=self.infer_pp, expert_parallel=self.infer_expert_parallel)

    @property
    def train_layout(self) -> TrainLayout:
        """The engine's training layout (parallel/layout.py), in Megatron's rank order."""
        return TrainLayout(tp=self.tp, pp=self.pp, ep=self.ep, cp=self.cp)

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
        """The update micro-batch's tokens on one rank at the worst case: micro_batch_size rows of
        padded_seq_length (its 1 / cp under context parallelism), or the token budget of a token-budget micro-batch."""
        if self.packing_token_budget is not None:
            return self.packing_token_budget // self.cp
        return self.micro_batch_size * self.padded_seq_length // self.cp

    @property
    def padded_seq_length(self) -> int:
        return self.train_layout.padded_length(self.seq_length, sequence_parallel=self.sequence_parallel_effective)

    @property
    def eplb_redundant_experts(self) -> int | None:
        """The EPLB map's redundant experts per MoE layer (its first layer's slots beyond the logical experts, as
        vllm-ascend counts them); None without a map."""
        return None if self.expert_slots is None else sum(self.expert_slots[0]) - self.arch.num_experts

    def rank_coordinates(self, rank: int) -> dict[str, int]:
        """Megatron's order tp-cp-ep-dp-pp (the engine's TrainLayout) and vLLM's DP x PP x TP (InferLayout)."""
        c = self.train_layout.of(rank, self.world_size)
        infer = self.infer_layout
        # dp_cp_rank: the index among the ranks that hold the same weights (DP x CP), what the optimizer shards over.
        # infer_ep_rank: vLLM's expert-parallel rank within the stage (DP x TP), the device_id of an EPLB map.
        return dict(tp_rank=c.tp_rank, pp_rank=c.pp_rank, dp_cp_rank=c.cp_rank + self.cp * c.dp_rank,
                    ep_rank=c.ep_rank, expert_dp_rank=c.expert_dp_rank, infer_tp_rank=infer.tp_rank(rank),
                    infer_pp_rank=infer.pp_rank(rank), infer_dp_rank=infer.dp_rank(rank),
                    infer_ep_rank=infer.dp_rank(rank) * self.infer_tp + infer.tp_rank(rank))
