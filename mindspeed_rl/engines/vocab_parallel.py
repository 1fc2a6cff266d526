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
                                  chunk_bytes: int | None = None, grad_into_logits: bool = False,
                                  topk_ids: torch.Tensor | None = None):
    """Log-prob of every response token (and optionally the entropy there), [b, response_width] fp32, 0 where
    `mb.response_mask` is 0.

    logits: [b, s, vocab/tp] (packed: [1, t, vocab/tp]), of which only the rows that score a response token are
    taken (`MicroBatch.scored_rows`, a copy in the logits' dtype); or with `rows_selected` those rows only, in that
    order ([1, n, vocab/tp]: models/scored_head.py). The vocabulary stays sharded over `parallel`'s TP group (this
    rank's place in the training layout, from the caller; under CP its positions are summed over the CP group) and
    the fp32 work is chunked (`vocab_parallel_logprobs`: chunk_tokens, chunk_bytes, grad_into_logits).

    `topk_ids` [b, response_width, k] (a teacher's top-k of each position, on-policy distillation): the log-probs of
    those ids too, from the same logsumexp, as a third value [b, response_width, k] (no CP: refused at start).
    """
    from mindspeed_rl.models.context_parallel import everywhere

    scored, targets, held = _scored(logits, mb, parallel, rows_selected)
    selected = mb.response_mask.bool()
    if topk_ids is not None:
        targets = torch.cat([targets.unsqueeze(1), topk_ids.to(targets.device)[selected]], dim=1)
    token_logprobs, token_entropy = vocab_parallel_logprobs(scored, targets, temperature=temperature,
                                                            chunk_tokens=chunk_tokens, group=_tp_group(parallel),
                                                            with_entropy=with_entropy, chunk_bytes=chunk_bytes,
                                                            grad_into_logits=grad_into_logits)
    token_logprobs, token_entropy = (everywhere(token_logprobs, held, parallel=parallel),
                                     everywhere(token_entropy, held, parallel=parallel))
    place = _placer(mb, logits.device)
    if topk_ids is None:
        return place(token_logprobs), (place(token_entropy) if with_entropy else None)
    return (place(token_logprobs[:, 0]), (place(token_entropy) if with_entropy else None),
            place(token_logprobs[:, 1:]))


def response_topk_from_logits(logits: torch.Tensor, mb: MicroBatch, k: int, temperature: float, chunk_tokens: int,
                              *, parallel: RankGroups, rows_selected: bool = False) -> torch.Tensor:
    """[b, response_width, 1 + 2k] fp32 of a teacher's forward (on-policy distillation): the log-prob of each response
    token, then the k most likely tokens' log-probs, then their ids (exact in fp32 below 2^24), 0 where
    `mb.response_mask` is 0. One tensor, so that it travels as the log-probs do (pipeline stages, the driver)."""
    scored, targets, held = _scored(logits, mb, parallel, rows_selected)
    if held is not None:
        raise ValueError("a teacher's top-k under context parallelism is not supported (refused at start)")
    group = _tp_group(parallel)
    token_logprobs, _ = vocab_parallel_logprobs(scored, targets, temperature=temperature, chunk_tokens=chunk_tokens,
                                                group=group, with_entropy=False)
    top_logprobs, top_ids = vocab_parallel_topk(scored, k, temperature=temperature, chunk_tokens=chunk_tokens,
                                                group=group)
    return _placer(mb, logits.device)(torch.cat([token_logprobs.unsqueeze(1), top_logprobs, top_ids.float()], dim=1))


def _scored(logits: torch.Tensor, mb: MicroBatch, parallel: RankGroups, rows_selected: bool):
    """(the rows of `logits` that score response tokens [n, V/t], their targets [n], which this rank holds under CP)."""
    from mindspeed_rl.models.context_parallel import scored_rows

    vocab_local = logits.shape[-1]
    # Under CP this rank's positions; every entry then comes from one rank.
    rows, targets, held = scored_rows(mb, parallel=parallel)
    scored = logits.reshape(-1, vocab_local) if rows_selected else logits.reshape(-1, vocab_local)[rows]
    return scored, targets, held


def _tp_group(parallel: RankGroups):
    return parallel.tp_group if parallel.tp > 1 else None


def _placer(mb: MicroBatch, device):
    """values [n, ...] in response-token order -> [b, response_width, ...], 0 elsewhere."""
    selected = mb.response_mask.bool()

    def place(values: torch.Tensor) -> torch.Tensor:
        out = torch.zeros((*mb.response_mask.shape, *values.shape[1:]), dtype=torch.float32, device=device)
        out[selected] = values.to(torch.float32)
        return out

    return place


def vocab_parallel_logprobs(logits: torch.Tensor, targets: torch.Tensor, *, temperature: float, chunk_tokens: int,
                            group=None, with_entropy: bool, chunk_bytes: int | None = None,
                            grad_into_logits: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
    """log p(target) and (optionally) the entropy of each row of `logits` [N, V/t], both fp32 [N]; with `targets`
    [N, k], k targets a row, log p [N, k] (one logsumexp a row serves them all).

    `targets` are global vocabulary ids; rank r of `group` holds columns [r V/t, (r+1) V/t). `group`
    None: the logits hold the whole vocabulary (no communication). A chunk has at most `chunk_tokens` rows and,
    with `chunk_bytes` (Accelerator.chunk_bytes_in_cache), no more rows than fit that many bytes in fp32, so
    that the passes over a chunk read it from cache. `grad_into_logits`: the backward writes the gradient over the
    logits (the caller reads them no more), instead of into a new tensor.
    """
    if chunk_tokens < 1:
        raise ValueError(f"chunk_tokens must be >= 1, got {chunk_tokens}")
    if chunk_bytes is not None:
        chunk_tokens = max(1, min(chunk_tokens, chunk_bytes // (4 * logits.shape[-1])))
    per_row = targets.dim() == 2  # [N, k]: k targets per row (the sampled token and a teacher's top-k)
    logprobs, entropy = _VocabParallelLogProbs.apply(logits, targets if per_row else targets.unsqueeze(1),
                                                     float(temperature), int(chunk_tokens), group, bool(with_entropy),
                                                     bool(grad_into_logits))
    return (logprobs if per_row else logprobs.squeeze(1)), (entropy if with_entropy else None)


@torch.no_grad()
def vocab_parallel_topk(logits: torch.Tensor, k: int, *, temperature: float, chunk_tokens: int,
                        group=None) -> tuple[torch.Tensor, torch.Tensor]:
    """The k most likely tokens of each row of `logits` [N, V/t] over the whole vocabulary: (log p [N, k] fp32, global
    ids [N, k]), most likely first. Each rank takes the top k of its shard; the ranks' k candidates (k x t a row, not
    V) are gathered and the top k of those kept, beside the row's logsumexp (one all-reduce). Chunked like
    `vocab_parallel_logprobs`: about 8 x chunk_tokens x V/t bytes at a time."""
    rows, vocab_local = logits.shape
    world = dist.get_world_size(group) if group is not None else 1
    vocab_start = _vocab_start(logits, group)
    values = torch.empty(rows, k, dtype=torch.float32, device=logits.device)
    ids = torch.empty(rows, k, dtype=torch.long, device=logits.device)
    for begin in range(0, rows, chunk_tokens):
        end = min(begin + chunk_tokens, rows)
        z = logits[begin:end].float() / temperature
        max_z = _all_reduce(z.max(dim=-1).values, group, dist.ReduceOp.MAX)
        lse = _all_reduce((z - max_z.unsqueeze(1)).exp().sum(dim=-1), group).log() + max_z
        local_values, local_ids = torch.topk(z, min(k, vocab_local), dim=-1)
        candidates = torch.cat([local_values, (local_ids + vocab_start).float()], dim=1)  # ids < 2^24: exact in fp32
        if world > 1:
            gathered = [torch.empty_like(candidates) for _ in range(world)]
            dist.all_gather(gathered, candidates, group=group)
            candidates = torch.cat([g.view(end - begin, 2, -1) for g in gathered], dim=2).view(end - begin, -1)
        width = candidates.shape[1] // 2
        top_values, top_at = torch.topk(candidates[:, :width], k, dim=-1)
        values[begin:end] = top_values - lse.unsqueeze(1)
        ids[begin:end] = candidates[:, width:].gather(1, top_at).long()
    return values, ids


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
        logprobs = torch.empty(targets.shape, dtype=torch.float32, device=logits.device)  # [rows, targets per row]
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
            target_z = torch.where(held, z.gather(1, local), 0.0)  # [rows, targets per row]
            torch.exp(z, out=exp_z)  # in place when the entropy does not need z again
            sums = torch.cat([target_z, exp_z.sum(dim=-1, keepdim=True),
                              torch.linalg.vecdot(exp_z, z).unsqueeze(1) if with_entropy
                              else torch.zeros_like(target_z[:, :1])], dim=1)
            sums = _all_reduce(sums, group)
            target_z, sum_exp, sum_exp_z = sums[:, :-2], sums[:, -2], sums[:, -1]
            log_sum_exp = sum_exp.log()
            lse[begin:end] = max_logit / temperature + log_sum_exp
            logprobs[begin:end] = target_z - log_sum_exp.unsqueeze(1)
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
            # Each target's log p has the same softmax term: -p_v times the sum of the row's target gradients.
            g_logprob = grad_logprobs[begin:end].sum(dim=1, keepdim=True)
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
            g_z.scatter_add_(1, local, torch.where(held, grad_logprobs[begin:end], 0.0))
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

