"""Where every rank sits in the training and the inference layouts: pure arithmetic over the sizes, the same for the
driver (which splits batches by data-parallel rank), the planner (which sizes each rank), the resharding plan (which
maps training shards to inference shards) and the ranks (Megatron's groups are made from it, and checked against it).

Training ranks follow Megatron's default order tp-cp-ep-dp-pp (TP fastest, PP slowest; expert parallelism is carved
out of CP x DP with the expert TP = TP); inference ranks vLLM's DP x PP x TP (TP fastest).
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class TrainCoordinates:
    tp_rank: int
    cp_rank: int
    dp_rank: int
    pp_rank: int
    ep_rank: int
    expert_dp_rank: int


@dataclass(frozen=True, kw_only=True)
class TrainLayout:
    tp: int = 1
    pp: int = 1
    ep: int = 1  # MoE expert parallelism; expert TP = TP (Megatron's default)
    cp: int = 1

    @property
    def ranks_per_replica(self) -> int:
        """The ranks that together hold one copy of the weights and one sequence (TP x CP x PP)."""
        return self.tp * self.cp * self.pp

    def dp(self, world_size: int) -> int:
        return world_size // self.ranks_per_replica

    @property
    def sequence_chunks(self) -> int:
        """What a sequence's length must be a multiple of to split into 2 chunks per CP rank (1 without CP;
        models/context_parallel.py)."""
        return 2 * self.cp if self.cp > 1 else 1

    def padded_length(self, seq_length: int, *, sequence_parallel: bool) -> int:
        """`seq_length` rounded up to what splits evenly: over the TP ranks under sequence parallelism, and into
        the CP chunks."""
        multiple = (self.tp if sequence_parallel else 1) * self.sequence_chunks
        return -(-seq_length // multiple) * multiple

    def of(self, rank: int, world_size: int) -> TrainCoordinates:
        """`rank`'s coordinates in a world of `world_size` training ranks."""
        dp = self.dp(world_size)
        tp_rank, rest = rank % self.tp, rank // self.tp
        cp_rank, rest = rest % self.cp, rest // self.cp
        dp_rank, pp_rank = rest % dp, rest // dp
        # Expert groups: the same order with CP folded into DP (tp-ep-dp-pp over the stage's tp x cp x dp ranks).
        in_stage = (rank % (self.tp * self.cp * dp)) // self.tp
        return TrainCoordinates(tp_rank=tp_rank, cp_rank=cp_rank, dp_rank=dp_rank, pp_rank=pp_rank,
                                ep_rank=in_stage % self.ep, expert_dp_rank=in_stage // self.ep)

    def coordinates(self, rank: int, world_size: int) -> tuple[int, int]:
        """(tp_rank, pp_rank): what the weight layouts depend on."""
        c = self.of(rank, world_size)
        return c.tp_rank, c.pp_rank

    def ep_rank(self, rank: int) -> int:
        """The rank within its pipeline stage is etp_rank + ETP * (ep_rank + EP * expert_dp_rank)."""
        return (rank // self.tp) % self.ep


@dataclass(frozen=True, kw_only=True)
class InferLayout:
    """vLLM's rank order (parallel_state.initialize_model_parallel): ExternalDP x DP x PP x TP, TP fastest."""

    tp: int = 1
    pp: int = 1  # pipeline stages; vLLM's own layer partition (layouts.vllm_pp_layers)
    expert_parallel: bool = False  # vLLM's enable_expert_parallel: EP = TP x DP (per stage), whole experts per rank

    def tp_rank(self, rank: int) -> int:
        return rank % self.tp  # vLLM's TP groups are blocks of consecutive ranks

    def pp_rank(self, rank: int) -> int:
        return rank // self.tp % self.pp

    def dp_rank(self, rank: int) -> int:
        return rank // (self.tp * self.pp)

    def dp(self, world_size: int) -> int:
        return world_size // (self.tp * self.pp)


@dataclass(frozen=True, kw_only=True)
class ParallelLayout:
    """A run's two layouts and their world sizes (the same ranks when colocated; the inference ranks of a
    disaggregated actor are their own world)."""

    train: TrainLayout
    infer: InferLayout
    train_world_size: int
    infer_world_size: int

    @classmethod
    def from_config(cls, config) -> "ParallelLayout":
        actor, gen = config.actor_config, config.generate_config
        return cls(train=TrainLayout(tp=actor.tensor_model_parallel_size, pp=actor.pipeline_model_parallel_size,
                                     ep=actor.expert_model_parallel_size, cp=actor.context_parallel_size),
                   infer=InferLayout(tp=gen.infer_tensor_parallel_size, pp=gen.infer_pipeline_parallel_size,
                                     expert_parallel=gen.infer_expert_parallel_size > 1),
                   train_world_size=config.world_size, infer_world_size=config.infer_world_size)

    @property
    def train_dp(self) -> int:
        return self.train.dp(self.train_world_size)

    @property
    def infer_dp(self) -> int:
        return self.infer.dp(self.infer_world_size)
