"""Token log-probs and entropy from vocabulary-parallel logits, at the cost of the shard.

Each TP rank holds the logits of its slice of the vocabulary. The log-softmax needs the logsumexp over the
whole vocabulary and the entropy needs sum_v p_v z_v; both are sums over the vocabulary, so each rank reduces
its slice and one all-reduce per quantity finishes them: nothing of size V is ever gathered. The work is done
in fp32 over chunks of `chunk_tokens` rows, so the extra memory is about 12 x chunk_tokens x V/t bytes
whatever the sequence length, and autograd keeps only the logits rows themselves (in their own dtype) and
two fp32 numbers per token. The backward recomputes the softmax chunk by chunk and needs no communication:

    z = logits / T,  lse = log sum_v exp z_v,  log p = z - lse,  H = lse - sum_v p_v z_v
    d log p_target / d z_v = 1[v = target] - p_v
    d H / d z_v = -p_v (log p_v + H)

(verl's `vocab_parallel_entropy` and Megatron's `vocab_parallel_cross_entropy` compute the same values.)
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from mindspeed_rl.protocol import MicroBatch

if TYPE_CHECKING:
    from mindspeed_rl.parallel.megatron_state import RankGroups


def response_logprobs_from_logits(logits: torch.Tensor, mb: MicroBatch, temperature: float, with_entropy: bool,
                                  chunk_tokens: int, *, parallel: RankGroups, rows_selected: bool = False,
                                  chunk_bytes: int | None = None,
                                  grad_into_logits: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Log-prob of every response token (and optionally the entropy there), [b, response_width] fp32, 0 where
    `mb.response_mask` is 0.

    logits: [b, s, vocab/tp] (packed: [1, t, vocab/tp]), of which only the rows that score a response token are
    taken (`MicroBatch.scored_rows`, a copy in the logits' dtype); or with `rows_selected` those rows only, in that
    order ([1, n, vocab/tp]: models/scored_head.py). The vocabulary stays sharded over `parallel`'s TP group (this
    rank's place in the training layout, from the caller; under CP its positions are summed over the CP group) and
    the fp32 work is chunked (`vocab_parallel_logprobs`: chunk_tokens, chunk_bytes, grad_into_logits).
    """
    from mindspeed_rl.models.context_parallel import everywhere, scored_rows

    vocab_local = logits.shape[-1]
    # Under CP this rank's positions; every entry then comes from one rank.
    rows, targets, held = scored_rows(mb, parallel=parallel)
    group = parallel.tp_group if parallel.tp > 1 else None
    scored = logits.reshape(-1, vocab_local) if rows_selected else logits.reshape(-1, vocab_local)[rows]
    token_logprobs, token_entropy = vocab_parallel_logprobs(scored, targets, temperature=temperature,
                                                            chunk_tokens=chunk_tokens, group=group,
                                                            with_entropy=with_entropy, chunk_bytes=chunk_bytes,
                                                            grad_into_logits=grad_into_logits)
    token_logprobs, token_entropy = (everywhere(token_logprobs, held, parallel=parallel),
                                     everywhere(token_entropy, held, parallel=parallel))
    selected = mb.response_mask.bool()

    def place(values: torch.Tensor) -> torch.Tensor:
        out = torch.zeros(mb.response_mask.shape, dtype=torch.float32, device=logits.device)
        return out.masked_scatter(selected, values)

    return place(token_logprobs), (place(token_entropy) if with_entropy else None)


def vocab_parallel_logprobs(logits: torch.Tensor, targets: torch.Tensor, *, temperature: float, chunk_tokens: int,
                            group=None, with_entropy: bool, chunk_bytes: int | None = None,
                            grad_into_logits: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
    """log p(target) and (optionally) the entropy of each row of `logits` [N, V/t], both fp32 [N].

    `targets` [N] are global vocabulary ids; rank r of `group` holds columns [r V/t, (r+1) V/t). `group`
    None: the logits hold the whole vocabulary (no communication). A chunk has at most `chunk_tokens` rows and,
    with `chunk_bytes` (Accelerator.chunk_bytes_in_cache), no more rows than fit that many bytes in fp32, so
    that the passes over a chunk read it from cache. `grad_into_logits`: the backward writes the gradient over the
    logits (the caller reads them no more), instead of into a new tensor.
    """
    if chunk_tokens < 1:
        raise ValueError(f"chunk_tokens must be >= 1, got {chunk_tokens}")
    if chunk_bytes is not None:
        chunk_tokens = max(1, min(chunk_tokens, chunk_bytes // (4 * logits.shape[-1])))
    logprobs, entropy = _VocabParallelLogProbs.apply(logits, targets, float(temperature), int(chunk_tokens), group,
                                                     bool(with_entropy), bool(grad_into_logits))
    return logprobs, (entropy if with_entropy else None)


def _vocab_start(logits: torch.Tensor, group) -> int:
    rank = dist.get_rank(group) if group is not None else 0
    return rank * logits.shape[-1]


def _all_reduce(tensor: torch.Tensor, group, op=dist.ReduceOp.SUM) -> torch.Tensor:
    if group is not None and dist.get_world_size(group) > 1:
        dist.all_reduce(tensor, op=op, group=group)
    return tensor


def _local_target(targets: torch.Tensor, vocab_start: int, vocab_local: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The targets' column in this shard (clamped) and whether the shard holds them."""
    local = targets - vocab_start
    held = (local >= 0) & (local < vocab_local)
    return local.clamp(0, vocab_local - 1), held


class _VocabParallelLogProbs(torch.autograd.Function):
    """Each chunk takes as few passes over its [rows, V/t] as the formulas allow (the work is memory-bound: the
    matmuls around it are small): forward, the shifted logits (scaled only when T != 1), their exp, and for the
    entropy a row-wise dot product (`vecdot`: no [rows, V/t] product, and unlike a batched matmul it keeps every
    thread busy at a few rows); backward, written straight into the gradient's rows: log p, its exp, the scale, and
    the entropy's terms only where its gradient is not zero (an entropy logged but not in the loss, or weighted 0).
    With `grad_into_logits` the gradient takes the logits' own storage (Megatron's cross entropy does the same with
    its softmax): the caller's logits are then spent, and a fresh [rows, V/t] of pages to fault in at every
    micro-batch is not allocated."""

    @staticmethod
    def forward(ctx, logits, targets, temperature, chunk_tokens, group, with_entropy, grad_into_logits):
        rows, vocab_local = logits.shape
        vocab_start = _vocab_start(logits, group)
        lse = torch.empty(rows, dtype=torch.float32, device=logits.device)
        logprobs = torch.empty_like(lse)
        entropy = torch.zeros_like(lse)
        # The chunks' fp32 work goes to buffers made once: a fresh [rows, V/t] per chunk is, on a host, fresh pages
        # faulted in on every chunk, and the passes over it leave the cache (benchmarks/bench_logprob_chunks.py).
        z_buffer = torch.empty(min(chunk_tokens, rows), vocab_local, dtype=torch.float32, device=logits.device)
        exp_buffer = torch.empty_like(z_buffer) if with_entropy else z_buffer
        for begin in range(0, rows, chunk_tokens):
            end = min(begin + chunk_tokens, rows)
            chunk, z, exp_z = logits[begin:end], z_buffer[:end - begin], exp_buffer[:end - begin]
            # max z = max(logits) / T for T > 0: the shift is taken on the raw logits and z scaled after it.
            max_logit = _all_reduce(chunk.max(dim=-1).values.float(), group, dist.ReduceOp.MAX)
            torch.sub(chunk, max_logit.unsqueeze(1), out=z)  # shifted: exp cannot overflow
            if temperature != 1.0:
                z.div_(temperature)
            local, held = _local_target(targets[begin:end], vocab_start, vocab_local)
            target_z = torch.where(held, z.gather(1, local.unsqueeze(1)).squeeze(1), 0.0)
            torch.exp(z, out=exp_z)  # in place when the entropy does not need z again
            sums = torch.stack([target_z, exp_z.sum(dim=-1),
                                torch.linalg.vecdot(exp_z, z) if with_entropy else torch.zeros_like(target_z)])
            target_z, sum_exp, sum_exp_z = _all_reduce(sums, group)
            log_sum_exp = sum_exp.log()
            lse[begin:end] = max_logit / temperature + log_sum_exp
            logprobs[begin:end] = target_z - log_sum_exp
            if with_entropy:  # H = lse - sum p z, in the shifted z: log sum_exp - sum_exp_z / sum_exp
                entropy[begin:end] = log_sum_exp - sum_exp_z / sum_exp
        ctx.save_for_backward(logits, targets, lse, entropy)
        ctx.settings = (temperature, chunk_tokens, vocab_start, with_entropy, grad_into_logits)
        return logprobs, entropy

    @staticmethod
    def backward(ctx, grad_logprobs, grad_entropy):
        logits, targets, lse, entropy = ctx.saved_tensors
        temperature, chunk_tokens, vocab_start, with_entropy, grad_into_logits = ctx.settings
        rows, vocab_local = logits.shape
        entropy_grad = with_entropy and bool(grad_entropy.any())
        grad = logits if grad_into_logits else torch.empty_like(logits)  # each chunk is read before it is written
        in_place = logits.dtype == torch.float32  # else the fp32 work is copied into the gradient's dtype
        chunk_shape = (min(chunk_tokens, rows), vocab_local)
        work = None if in_place else torch.empty(chunk_shape, dtype=torch.float32, device=logits.device)
        log_p_buffer = torch.empty(chunk_shape, dtype=torch.float32, device=logits.device) if entropy_grad else None
        for begin in range(0, rows, chunk_tokens):
            end = min(begin + chunk_tokens, rows)
            g_z = grad[begin:end] if in_place else work[:end - begin]
            _log_p_into(g_z, logits[begin:end], lse[begin:end], temperature)
            g_logprob = grad_logprobs[begin:end].unsqueeze(1)
            if entropy_grad:
                # d/dz of g_lp log p_t + g_H H = g_lp (1[t] - p) - g_H p (log p + H)
                log_p = log_p_buffer[:end - begin]
                log_p.copy_(g_z)
                g_z.exp_()
                log_p.add_(entropy[begin:end].unsqueeze(1)).mul_(grad_entropy[begin:end].unsqueeze(1)).add_(g_logprob)
                g_z.mul_(log_p).neg_()
            else:
                g_z.exp_().mul_(-g_logprob)
            local, held = _local_target(targets[begin:end], vocab_start, vocab_local)
            g_z.scatter_add_(1, local.unsqueeze(1), torch.where(held, grad_logprobs[begin:end], 0.0).unsqueeze(1))
            if temperature != 1.0:
                g_z.div_(temperature)
            if not in_place:
                grad[begin:end] = g_z
        return grad, None, None, None, None, None, None


def _log_p_into(out: torch.Tensor, logits: torch.Tensor, lse: torch.Tensor, temperature: float) -> None:
    """out = logits / T - lse in fp32, in as few passes as the dtypes allow (one when fp32 at T = 1)."""
    source = logits
    if logits.dtype != out.dtype:
        out.copy_(logits)
        source = out
    if temperature != 1.0:
        torch.div(source, temperature, out=out)
        source = out
    torch.sub(source, lse.unsqueeze(1), out=out)

