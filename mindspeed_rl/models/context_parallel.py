"""Context parallelism (MindSpeed-RL's `context_parallel_size`, Megatron's CP) for padded and packed micro-batches.

The sequence is cut into 2 x CP chunks and CP rank r holds chunks r and 2 CP - 1 - r (Megatron's load-balanced
split: under the causal mask every rank then has the same attention work; Megatron's RoPE slices its table the same
way, `get_pos_emb_on_this_cp_rank`). Everything outside attention is per token, so each rank runs the layers on its
chunks only; attention needs every earlier key, so each layer all-gathers K and V over the CP group (the
"all-gather KV" form of CP; TransformerEngine's ring exchange is the same computation in pieces) and each local chunk
attends to the keys up to its own end. A rank holds [s / CP] activations and one layer's gathered K/V at a time.

The response log-probs (engines/vocab_parallel.py) are computed by the rank that holds each scored position and
summed over the CP group; every CP rank then holds the same loss. Its backward keeps each rank's own positions (the
all-reduce's gradient is the identity), so a rank's gradients are its tokens' part and the CP group's sum is the
whole: Megatron's schedule multiplies the loss by CP and DDP averages over DP x CP (`dp_cp_group`), which leaves
that sum. `attention_dropout` is refused (the RL recipes run with 0).

The CP size, rank and group come from the caller: the engine's `RankGroups` (`parallel`), and in the attention the
CP group Megatron's attention passes down (`pg_collection.cp`).
"""
from __future__ import annotations

import math
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from megatron.core.transformer.module import MegatronModule

if TYPE_CHECKING:
    from mindspeed_rl.parallel.megatron_state import RankGroups


def local_chunk_indices(cp_rank: int, cp: int) -> tuple[int, int]:
    return cp_rank, 2 * cp - 1 - cp_rank


def split_sequence(tensor: torch.Tensor, *, dim: int, cp_rank: int, cp: int) -> torch.Tensor:
    """This rank's two chunks of `tensor` along `dim` (its length a multiple of 2 CP)."""
    chunks = tensor.chunk(2 * cp, dim=dim)
    return torch.cat([chunks[i] for i in local_chunk_indices(cp_rank, cp)], dim=dim)


def split_packed(tensor: torch.Tensor, cu_seqlens: torch.Tensor, *, cp_rank: int, cp: int) -> torch.Tensor:
    """[1, t] packed -> [1, t / CP]: every sample's (and the padding segment's) two chunks of this rank, sample after
    sample, as Megatron's THD RoPE reads them (each segment's length a multiple of 2 CP)."""
    bounds = cu_seqlens.tolist()
    return torch.cat([split_sequence(tensor[:, start:stop], dim=1, cp_rank=cp_rank, cp=cp)
                      for start, stop in zip(bounds[:-1], bounds[1:]) if stop > start], dim=1)


def model_inputs(mb, ids: torch.Tensor, positions: torch.Tensor, *,
                 parallel: RankGroups) -> tuple[torch.Tensor, torch.Tensor]:
    """What this rank (at `parallel`) feeds the model of micro-batch `mb`: under CP its chunks (`this_ranks_tokens`),
    else all."""
    if parallel.cp == 1:
        return ids, positions
    return this_ranks_tokens(mb, ids, positions, cp_rank=parallel.cp_rank, cp=parallel.cp)


def cut_padding(output: torch.Tensor, mb, width: int) -> torch.Tensor:
    """The last stage's output of padded rows cut back to `width` tokens; packed rows, and under CP this rank's
    chunks, stay as they are."""
    if mb.packed or mb.context_parallel_length or output.shape[1] == width:
        return output
    return output[:, :width]


def scored_rows(mb, *, parallel: RankGroups) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """The rows of this rank's (at `parallel`) flattened logits that score `mb`'s response tokens, their targets,
    and under CP which of them this rank holds (None without CP: every one)."""
    if mb.context_parallel_length:
        return scored_rows_of_this_rank(mb, cp_rank=parallel.cp_rank, cp=parallel.cp)
    rows = mb.scored_rows()
    return rows, mb.input_ids.reshape(-1)[rows + 1], None


def everywhere(values: torch.Tensor | None, held: torch.Tensor | None, *,
               parallel: RankGroups) -> torch.Tensor | None:
    """`from_the_holding_ranks` over `parallel`'s CP group where this rank holds only some (`held`), else the values
    as they are."""
    if values is None or held is None:
        return values
    return from_the_holding_ranks(values, held, group=parallel.cp_group)


def last_token_scores(output: torch.Tensor, mb, index: torch.Tensor, *, parallel: RankGroups) -> torch.Tensor:
    """The [b] outputs of a width-1 head at each sample's position `index` (under CP where it lives: `parallel`)."""
    if mb.context_parallel_length:
        return last_token_outputs(output, mb, index, parallel=parallel)
    return output[torch.arange(output.shape[0], device=output.device), index, 0].float()


def core_attention_class(cp: int, otherwise):
    """ContextParallelAttention under CP (cp > 1), else `otherwise`."""
    return ContextParallelAttention if cp > 1 else otherwise


def with_context_parallel(layer_spec, cp: int):
    """The layer spec with ContextParallelAttention as every layer's core attention under CP (cp > 1)."""
    return with_context_parallel_attention(layer_spec) if cp > 1 else layer_spec


def this_ranks_tokens(mb, ids: torch.Tensor, positions: torch.Tensor, *, cp_rank: int,
                      cp: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The token ids and positions of micro-batch `mb` CP rank `cp_rank` of `cp` feeds the model: its two chunks of
    each padded row (a multiple of 2 CP long) or of each sample of a pack. Records the whole length in
    `mb.context_parallel_length`, which tells the log-prob step (engines/vocab_parallel.py) which positions this
    rank's logits hold."""
    mb.context_parallel_length = ids.shape[1]
    if mb.packed:
        return tuple(split_packed(x, mb.cu_seqlens, cp_rank=cp_rank, cp=cp) for x in (ids, positions))
    return tuple(split_sequence(x, dim=1, cp_rank=cp_rank, cp=cp) for x in (ids, positions))


def local_offsets(positions: torch.Tensor, lengths: torch.Tensor, cp_rank: int, cp: int) -> torch.Tensor:
    """Where position p of a segment of length L sits in this rank's part of it (L / CP long), -1 where another
    rank holds it."""
    chunk = lengths // (2 * cp)
    index = positions // chunk
    first, second = local_chunk_indices(cp_rank, cp)
    return torch.where(index == first, positions - first * chunk,
                       torch.where(index == second, chunk + positions - second * chunk, -1))


class _GatherParts(torch.autograd.Function):
    """All-gather of the ranks' parts [n, ...] -> [CP, n, ...] (rank order); the backward sums every rank's gradient
    for this rank's part (other ranks' queries attend to its keys). gloo has no reduce_scatter: the sum, then the
    part."""

    @staticmethod
    def forward(ctx, local: torch.Tensor, group) -> torch.Tensor:
        ctx.group, ctx.cp_rank = group, dist.get_rank(group)
        parts = [torch.empty_like(local) for _ in range(dist.get_world_size(group))]
        dist.all_gather(parts, local.contiguous(), group=group)
        return torch.stack(parts)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        total = grad.contiguous().clone()
        dist.all_reduce(total, group=ctx.group)
        return total[ctx.cp_rank], None


def _in_global_order(parts: torch.Tensor, cp: int) -> torch.Tensor:
    """[CP, L / CP, ...] each rank's two chunks of one segment -> [L, ...] the segment."""
    chunks: list[torch.Tensor | None] = [None] * (2 * cp)
    for rank in range(cp):
        first, second = local_chunk_indices(rank, cp)
        chunks[first], chunks[second] = parts[rank].chunk(2, dim=0)
    return torch.cat(chunks, dim=0)


class _SumOverGroup(torch.autograd.Function):
    """All-reduce sum whose gradient is the identity: each summed entry came from exactly one rank."""

    @staticmethod
    def forward(ctx, tensor: torch.Tensor, group) -> torch.Tensor:
        total = tensor.clone()
        dist.all_reduce(total, group=group)
        return total

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad, None


def sum_over_context_parallel(tensor: torch.Tensor, group) -> torch.Tensor:
    """`tensor` summed over the CP `group` (identity backward)."""
    return _SumOverGroup.apply(tensor, group)


def from_the_holding_ranks(local_values: torch.Tensor, held: torch.Tensor, *, group) -> torch.Tensor:
    """[n] values each computed by the one CP rank holding its position (`held`: those of this rank, in order) ->
    all n on every rank of the CP `group` (the others' entries are 0 here before the sum; identity backward)."""
    zeros = torch.zeros(held.shape, dtype=local_values.dtype, device=local_values.device)
    return sum_over_context_parallel(zeros.masked_scatter(held, local_values), group)


def last_token_outputs(output: torch.Tensor, mb, index: torch.Tensor, *, parallel: RankGroups) -> torch.Tensor:
    """Under CP, the [b] outputs (a head of width 1: [b, s / CP, 1], padded rows) at each sample's position `index`,
    taken where it lives and summed over `parallel`'s CP ranks (the reward model's score at the last token)."""
    offsets = local_offsets(index, torch.full_like(index, mb.context_parallel_length), parallel.cp_rank, parallel.cp)
    held = offsets >= 0
    rows = torch.arange(len(index), device=output.device)[held]
    return from_the_holding_ranks(output[rows, offsets[held], 0].float(), held, group=parallel.cp_group)


class ContextParallelAttention(MegatronModule):
    """The core attention of a layer under CP (Megatron's local DotProductAttention refuses CP > 1): q, k, v
    [s / CP, b, heads, d] of this rank's chunks -> [s / CP, b, heads x d_v], K and V gathered over the CP group of
    the `pg_collection` Megatron's attention builds it with. MLA's keys are wider than its values (nope + rope vs
    v_head_dim; `k_channels`/`v_channels`) and it passes its own softmax scale (YaRN's mscale)."""

    def __init__(self, config, layer_number: int, attn_mask_type, attention_type: str,
                 attention_dropout: float | None = None, softmax_scale: float | None = None, cp_comm_type=None,
                 pg_collection=None, k_channels: int | None = None, v_channels: int | None = None):
        super().__init__(config=config)
        if (attention_dropout if attention_dropout is not None else config.attention_dropout) > 0:
            raise ValueError("context parallelism here runs without attention dropout (attention_dropout: 0)")
        if config.apply_query_key_layer_scaling:
            raise ValueError("context-parallel attention assumes apply_query_key_layer_scaling off")
        if pg_collection is None or getattr(pg_collection, "cp", None) is None:
            raise ValueError("context-parallel attention takes its CP group from the attention's pg_collection")
        self.cp_group = pg_collection.cp
        self.softmax_scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(config.kv_channels)

    def forward(self, query, key, value, attention_mask, attn_mask_type=None, attention_bias=None,
                packed_seq_params=None):
        group = self.cp_group
        cp, cp_rank = dist.get_world_size(group), dist.get_rank(group)
        if packed_seq_params is None:  # [s / CP, b, h, d]: one segment per row
            keys, values = (_in_global_order(_GatherParts.apply(x, group), cp) for x in (key, value))
            out = self._segment(query, keys, values, cp_rank, cp)
            return out.reshape(out.shape[0], out.shape[1], -1)
        # Packed [t / CP, h, d]: gather the packs, then each sample's keys in its own order. Every rank holds
        # L / CP of each sample of global length L, so the gathered packs line up sample by sample.
        if packed_seq_params.qkv_format != "thd":
            raise ValueError(f"packed attention takes the thd format, got {packed_seq_params.qkv_format!r}")
        bounds = packed_seq_params.cu_seqlens_q.tolist()
        keys, values = (_GatherParts.apply(x, group) for x in (key, value))
        outputs = []
        for start, stop in zip(bounds[:-1], bounds[1:]):
            if stop == start:
                continue
            local = slice(start // cp, stop // cp)
            segment_keys, segment_values = (_in_global_order(x[:, local], cp) for x in (keys, values))
            outputs.append(self._segment(query[local].unsqueeze(1), segment_keys.unsqueeze(1),
                                         segment_values.unsqueeze(1), cp_rank, cp).squeeze(1))
        out = torch.cat(outputs)
        return out.reshape(out.shape[0], -1)

    def _segment(self, query, keys, values, cp_rank: int, cp: int) -> torch.Tensor:
        """query [L / CP, b, h, d] this rank's two chunks of a segment, keys/values [L, b, g, d] all of it."""
        chunk = query.shape[0] // 2
        outputs = []
        for half, index in enumerate(local_chunk_indices(cp_rank, cp)):
            end = (index + 1) * chunk  # this chunk's queries see the keys before its end, causally
            # [L, b, h, d] -> [b, h, L, d]
            q = query[half * chunk:(half + 1) * chunk].permute(1, 2, 0, 3)
            k, v = (x[:end].permute(1, 2, 0, 3) for x in (keys, values))
            query_positions = torch.arange(index * chunk, end, device=query.device)
            allowed = query_positions.unsqueeze(1) >= torch.arange(end, device=query.device).unsqueeze(0)
            attended = torch.nn.functional.scaled_dot_product_attention(
                q, k, v, attn_mask=allowed, scale=self.softmax_scale, enable_gqa=k.shape[1] != q.shape[1])
            outputs.append(attended.permute(2, 0, 1, 3))  # [L, b, h, d]
        return torch.cat(outputs, dim=0)


def with_context_parallel_attention(layer_spec):
    """The layer spec with ContextParallelAttention as every layer's core attention."""
    layer_spec.submodules.self_attention.submodules.core_attention = ContextParallelAttention
    return layer_spec


def scored_rows_of_this_rank(mb, *, cp_rank: int, cp: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Under CP, for the response tokens in `response_mask` order: the rows of CP rank `cp_rank`'s flattened
    [b x s / CP, vocab] logits that score those it holds, their target ids, and which ones it holds ([n] bool)."""
    samples, scoring = mb.scored_positions()
    if mb.packed:  # segment j holds cu[j + 1] - cu[j] tokens, of which this rank's part starts at cu[j] / CP
        starts = mb.cu_seqlens.long()[samples]
        offsets = local_offsets(scoring, mb.cu_seqlens.long()[samples + 1] - starts, cp_rank, cp)
        held = offsets >= 0
        rows = starts[held] // cp + offsets[held]
        targets = mb.input_ids[0, starts[held] + scoring[held] + 1]
        return rows, targets, held
    length = mb.context_parallel_length
    offsets = local_offsets(scoring, torch.full_like(scoring, length), cp_rank, cp)
    held = offsets >= 0
    rows = samples[held] * (length // cp) + offsets[held]
    targets = mb.input_ids[samples[held], scoring[held] + 1]
    return rows, targets, held
