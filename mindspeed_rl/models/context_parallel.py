"""Context parallelism (MindSpeed-RL's `context_parallel_size`, Megatron's CP) for padded micro-batches.

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
"""
from __future__ import annotations

import math

import torch
import torch.distributed as dist
from megatron.core.transformer.module import MegatronModule


def local_chunk_indices(cp_rank: int, cp: int) -> tuple[int, int]:
    return cp_rank, 2 * cp - 1 - cp_rank


def local_positions(seq_length: int, cp_rank: int, cp: int, device=None) -> torch.Tensor:
    """[seq_length / CP] the global positions this CP rank holds, in its order (`seq_length` a multiple of 2 CP)."""
    chunk = seq_length // (2 * cp)
    return torch.cat([torch.arange(i * chunk, (i + 1) * chunk, device=device)
                      for i in local_chunk_indices(cp_rank, cp)])


def split_sequence(tensor: torch.Tensor, *, dim: int, cp_rank: int, cp: int) -> torch.Tensor:
    """This rank's two chunks of `tensor` along `dim` (its length a multiple of 2 CP)."""
    chunks = tensor.chunk(2 * cp, dim=dim)
    return torch.cat([chunks[i] for i in local_chunk_indices(cp_rank, cp)], dim=dim)


class _GatherSequence(torch.autograd.Function):
    """All-gather along dim 0 over the CP group, back in global order; the backward sums every rank's gradient for
    this rank's chunks (other ranks' queries attend to them)."""

    @staticmethod
    def forward(ctx, local: torch.Tensor, group) -> torch.Tensor:
        cp, cp_rank = dist.get_world_size(group), dist.get_rank(group)
        ctx.group, ctx.cp, ctx.cp_rank = group, cp, cp_rank
        parts = [torch.empty_like(local) for _ in range(cp)]
        dist.all_gather(parts, local.contiguous(), group=group)
        chunks: list[torch.Tensor | None] = [None] * (2 * cp)
        for rank, part in enumerate(parts):
            first, second = part.chunk(2, dim=0)
            chunks[rank], chunks[2 * cp - 1 - rank] = first, second
        return torch.cat(chunks, dim=0)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        total = grad.contiguous().clone()
        dist.all_reduce(total, group=ctx.group)  # gloo has no reduce_scatter; the sum, then this rank's slice
        return split_sequence(total, dim=0, cp_rank=ctx.cp_rank, cp=ctx.cp), None


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


def sum_over_context_parallel(tensor: torch.Tensor) -> torch.Tensor:
    from megatron.core import parallel_state as ps

    return _SumOverGroup.apply(tensor, ps.get_context_parallel_group())


class ContextParallelAttention(MegatronModule):
    """The core attention of a layer under CP (Megatron's local DotProductAttention refuses CP > 1): q, k, v
    [s / CP, b, heads, d] of this rank's chunks -> [s / CP, b, heads x d]."""

    def __init__(self, config, layer_number: int, attn_mask_type, attention_type: str,
                 attention_dropout: float | None = None, softmax_scale: float | None = None, cp_comm_type=None,
                 pg_collection=None):
        super().__init__(config=config)
        if (attention_dropout if attention_dropout is not None else config.attention_dropout) > 0:
            raise ValueError("context parallelism here runs without attention dropout (attention_dropout: 0)")
        if config.apply_query_key_layer_scaling:
            raise ValueError("context-parallel attention assumes apply_query_key_layer_scaling off")
        self.softmax_scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(config.kv_channels)

    def forward(self, query, key, value, attention_mask, attn_mask_type=None, attention_bias=None,
                packed_seq_params=None):
        from megatron.core import parallel_state as ps

        if packed_seq_params is not None:
            raise ValueError("context parallelism takes padded micro-batches (not rl_config.use_remove_padding)")
        group = ps.get_context_parallel_group()
        cp, cp_rank = dist.get_world_size(group), dist.get_rank(group)
        keys, values = _GatherSequence.apply(key, group), _GatherSequence.apply(value, group)
        local_len = query.shape[0]
        chunk = local_len // 2
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
        out = torch.cat(outputs, dim=0)
        return out.reshape(out.shape[0], out.shape[1], -1)


def with_context_parallel_attention(layer_spec):
    """The layer spec with ContextParallelAttention as every layer's core attention."""
    layer_spec.submodules.self_attention.submodules.core_attention = ContextParallelAttention
    return layer_spec


def scored_rows_of_this_rank(mb) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Under CP, for the response tokens in `response_mask` order: the rows of this rank's flattened
    [b x s / CP, vocab] logits that score those it holds, their target ids, and which ones it holds ([n] bool)."""
    from megatron.core import parallel_state as ps

    seq_length, device = mb.context_parallel_length, mb.input_ids.device
    cp, cp_rank = ps.get_context_parallel_world_size(), ps.get_context_parallel_rank()
    positions = local_positions(seq_length, cp_rank, cp, device)
    local_index = torch.full((seq_length,), -1, dtype=torch.long, device=device)
    local_index[positions] = torch.arange(len(positions), device=device)
    # Response token j of a sample is scored at position prompt length - 1 + j (position t predicts t + 1).
    scoring = (mb.prompt_lengths.unsqueeze(1) - 1 + torch.arange(mb.response_width, device=device))
    samples = torch.arange(len(mb.prompt_lengths), device=device).unsqueeze(1).expand_as(scoring)
    selected = mb.response_mask.bool()
    scoring, samples = scoring[selected], samples[selected]
    held = local_index[scoring] >= 0
    rows = samples[held] * len(positions) + local_index[scoring[held]]
    targets = mb.input_ids[samples[held], scoring[held] + 1]
    return rows, targets, held
