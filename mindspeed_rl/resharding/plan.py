"""The resharding plan: a pure function from (model spec, train layout, infer layout) to the
copies that turn every rank's Megatron shards into its vLLM shards.

A rank receives only the ranges its inference shard needs and does not already hold; where it
holds them (train and infer layouts agree) the copy is local and nothing crosses the wire. Among
several holders of a range (DP replicas, replicated norms) the least-loaded one sends, so the
traffic spreads over ranks.
"""
from __future__ import annotations

import math
from collections import defaultdict
from dataclasses import dataclass, field

from mindspeed_rl.models.pipeline_stages import stage_layer_range
from mindspeed_rl.models.qwen2 import Qwen2Spec
from mindspeed_rl.models.layouts import LocalTensor, hf_shapes, megatron_layout, vllm_layout
from mindspeed_rl.parallel.layout import InferLayout, TrainLayout  # noqa: F401 (the plan's API names them)


@dataclass(frozen=True)
class Copy:
    """dst[dst_tensor].narrow(dim, dst_start, length) <- src[src_tensor].narrow(dim, src_start, length)."""

    src_rank: int
    dst_rank: int
    src_tensor: str
    src_start: int
    dst_tensor: str
    dst_start: int
    length: int
    dim: int
    unit_numel: int  # elements per index along `dim`

    @property
    def numel(self) -> int:
        return self.length * self.unit_numel


@dataclass
class Plan:
    world_size: int  # every rank the plan addresses: train and infer ranks (disaggregated), or the shared ones
    copies: list[Copy]
    train_tensors: dict[int, dict[str, LocalTensor]]
    infer_tensors: dict[int, dict[str, LocalTensor]]
    stats: dict[int, dict[str, int]] = field(default_factory=dict)  # per rank, in elements
    # Disaggregated: infer ranks follow the train ranks (bridge numbering); colocated: the same ranks.
    train_ranks: range = range(0)
    infer_ranks: range = range(0)

    def copies_to(self, rank: int) -> list[Copy]:
        return [c for c in self.copies if c.dst_rank == rank]

    def received_numel(self, rank: int) -> int:
        return sum(c.numel for c in self.copies if c.dst_rank == rank and c.src_rank != rank)


def build_plan(spec: Qwen2Spec, train: TrainLayout, infer: InferLayout, world_size: int, *,
               infer_world_size: int | None = None) -> Plan:
    """`world_size` training ranks; with `infer_world_size` (disaggregated) that many inference ranks
    numbered after them, which hold nothing of the training layout, so every copy crosses the wire and
    each inference rank receives exactly its shard. Without it, the same ranks play both parts."""
    train_ranks, infer_ranks = plan_ranks(world_size, infer_world_size)
    _check_sizes(spec, train, infer, world_size, len(infer_ranks))
    return plan_between(train_layouts(spec, train, world_size), infer_layouts(spec, infer, infer_ranks),
                        hf_shapes(spec), train_ranks=train_ranks, infer_ranks=infer_ranks)


def plan_ranks(world_size: int, infer_world_size: int | None) -> tuple[range, range]:
    """(training ranks, inference ranks) of a plan: the same ranks, or (disaggregated, `infer_world_size`) that many
    inference ranks numbered after the training ranks."""
    train_ranks = range(world_size)
    return train_ranks, (train_ranks if infer_world_size is None
                         else range(world_size, world_size + infer_world_size))


def train_layouts(spec: Qwen2Spec, train: TrainLayout, world_size: int) -> dict[int, list[LocalTensor]]:
    """Each training rank's Megatron tensors."""
    layouts = {}
    for rank in range(world_size):
        tp_rank, pp_rank = train.coordinates(rank, world_size)
        layouts[rank] = megatron_layout(spec, tp=train.tp, tp_rank=tp_rank, pp=train.pp, pp_rank=pp_rank,
                                        ep=train.ep, ep_rank=train.ep_rank(rank))
    return layouts


def infer_layouts(spec: Qwen2Spec, infer: InferLayout, infer_ranks: range) -> dict[int, list[LocalTensor]]:
    """Each inference rank's vLLM tensors (keyed by the plan's rank numbering)."""
    layouts = {}
    for rank in infer_ranks:
        local = rank - infer_ranks.start  # the rank in the inference world
        layouts[rank] = vllm_layout(spec, tp=infer.tp, tp_rank=infer.tp_rank(local), pp=infer.pp,
                                    pp_rank=infer.pp_rank(local), dp=len(infer_ranks) // (infer.tp * infer.pp),
                                    dp_rank=infer.dp_rank(local), expert_parallel=infer.expert_parallel)
    return layouts


def plan_between(train: dict[int, list[LocalTensor]], infer: dict[int, list[LocalTensor]],
                 shapes: dict[str, tuple[int, ...]], *, train_ranks: range, infer_ranks: range) -> Plan:
    """The copies that fill every inference rank's tensors from the training ranks' (any two layouts of the same
    HF tensors, named in `shapes`)."""
    train_tensors, holders = {}, defaultdict(list)
    for rank in train_ranks:
        train_tensors[rank] = {t.key: t for t in train[rank]}
        for tensor in train[rank]:
            for seg in tensor.segments:
                holders[seg.hf_name].append((rank, tensor, seg))
    infer_tensors, copies = {}, []
    sent = defaultdict(int)  # load balancing among equivalent holders
    for rank in infer_ranks:
        infer_tensors[rank] = {t.key: t for t in infer[rank]}
        for tensor in infer[rank]:
            for seg in tensor.segments:
                unit = math.prod(shapes[seg.hf_name]) // shapes[seg.hf_name][tensor.dim]
                copies += _cover(rank, tensor, seg, holders[seg.hf_name], unit, sent)
    plan = Plan(world_size=infer_ranks.stop, copies=copies, train_tensors=train_tensors, infer_tensors=infer_tensors,
                train_ranks=train_ranks, infer_ranks=infer_ranks)
    # One pass over the copies (DeepSeek-V3's 671B on 256 ranks has ~0.5M of them; a pass per rank took seconds).
    plan.stats.update({rank: {"received_numel": 0, "sent_numel": 0, "local_numel": 0} for rank in range(plan.world_size)})
    for c in copies:
        if c.src_rank == c.dst_rank:
            plan.stats[c.src_rank]["local_numel"] += c.numel
        else:
            plan.stats[c.dst_rank]["received_numel"] += c.numel
            plan.stats[c.src_rank]["sent_numel"] += c.numel
    return plan


def _cover(rank: int, dst: LocalTensor, seg, holders, unit: int, sent: dict[int, int]) -> list[Copy]:
    """Copies that fill dst's segment `seg`, each elementary range from the best holder."""
    lo, hi = seg.hf_start, seg.hf_start + seg.length
    overlapping = [(r, t, s) for r, t, s in holders if s.hf_start < hi and s.hf_start + s.length > lo]
    cuts = sorted({lo, hi} | {max(lo, min(hi, x)) for _, _, s in overlapping for x in (s.hf_start, s.hf_start + s.length)})
    copies: list[Copy] = []
    for a, b in zip(cuts, cuts[1:]):
        candidates = [(r, t, s) for r, t, s in overlapping if s.hf_start <= a and b <= s.hf_start + s.length]
        assert candidates, f"no training rank holds {seg.hf_name}[{a}:{b}]"
        src_rank, src, src_seg = min(candidates, key=lambda c: (c[0] != rank, sent[c[0]], (c[0] - rank) % (1 << 30)))
        assert src.dim == dst.dim, f"{seg.hf_name}: train and infer split different dims"
        if src_rank != rank:
            sent[src_rank] += (b - a) * unit
        piece = Copy(src_rank, rank, src.key, src_seg.local_start + a - src_seg.hf_start,
                     dst.key, seg.local_start + a - lo, b - a, dst.dim, unit)
        last = copies[-1] if copies else None
        if last and last.src_rank == src_rank and last.src_tensor == src.name \
                and last.src_start + last.length == piece.src_start and last.dst_start + last.length == piece.dst_start:
            copies[-1] = Copy(last.src_rank, rank, last.src_tensor, last.src_start, last.dst_tensor,
                              last.dst_start, last.length + piece.length, last.dim, unit)
        else:
            copies.append(piece)
    return copies


def _check_sizes(spec: Qwen2Spec, train: TrainLayout, infer: InferLayout, world_size: int,
                 infer_world_size: int) -> None:
    if world_size % (train.tp * train.pp):
        raise ValueError(f"train TP*PP={train.tp * train.pp} must divide the world size {world_size}")
    if infer_world_size % infer.tp:
        raise ValueError(f"infer TP={infer.tp} must divide the inference world size {infer_world_size}")
    if infer_world_size % (infer.tp * infer.pp):
        raise ValueError(f"infer TP*PP={infer.tp * infer.pp} must divide the inference world size {infer_world_size}")
    if infer.pp > spec.num_layers:
        raise ValueError(f"infer PP={infer.pp} must not exceed num_layers={spec.num_layers} (vLLM gives every stage a layer)")
    if spec.num_query_groups % train.tp:
        raise ValueError(f"train TP={train.tp} must divide num_key_value_heads={spec.num_query_groups}")
    if spec.vocab_size % train.tp or (not spec.is_moe and spec.ffn_hidden_size % train.tp):
        raise ValueError(f"train TP={train.tp} must divide the vocabulary and intermediate sizes")
    if spec.deepseek is not None:
        from mindspeed_rl.models.deepseek_v3_layouts import check_train_tp

        check_train_tp(spec, train.tp)
    stage_layer_range(spec.num_layers, 0, train.pp, spec.pipeline_stage_layers if train.pp > 1 else None)
    if train.ep > 1 and not spec.is_moe:
        raise ValueError(f"train EP={train.ep} needs a MoE model (num_experts > 0)")
    if infer.expert_parallel and not spec.is_moe:
        raise ValueError("infer expert parallelism needs a MoE model (num_experts > 0)")
    if spec.is_moe:
        dp = world_size // (train.tp * train.pp)
        if dp % train.ep:
            raise ValueError(f"train EP={train.ep} must divide the data-parallel size {dp} (world / (TP*PP))")
        if spec.num_experts % train.ep:
            raise ValueError(f"train EP={train.ep} must divide num_experts={spec.num_experts}")
        if spec.moe_ffn_hidden_size % train.tp:
            raise ValueError(f"train TP={train.tp} (= expert TP) must divide moe_intermediate_size={spec.moe_ffn_hidden_size}")
