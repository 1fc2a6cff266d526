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

import torch
import torch.distributed as dist

from mindspeed_rl.protocol import MicroBatch


def response_logprobs_from_logits(logits: torch.Tensor, mb: MicroBatch, temperature: float, with_entropy: bool,
                                  chunk_tokens: int,
                                  rows_selected: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Log-prob of every response token (and optionally the entropy there), [b, response_width] fp32, 0 where
    `mb.response_mask` is 0.

    logits: [b, s, vocab/tp] (packed: [1, t, vocab/tp]), of which only the rows that score a response token are
    taken (`MicroBatch.scored_rows`, a copy in the logits' dtype); or with `rows_selected` those rows only, in that
    order ([1, n, vocab/tp]: models/scored_head.py). The vocabulary stays sharded and the fp32 work is chunked.
    """
    from mindspeed_rl.parallel import megatron_state

    from mindspeed_rl.models.context_parallel import everywhere, scored_rows

    vocab_local = logits.shape[-1]
    rows, targets, held = scored_rows(mb)  # under CP this rank's positions; every entry then comes from one rank
    parallel = megatron_state.current()
    group = parallel.tp_group if parallel.tp > 1 else None
    token_logprobs, token_entropy = vocab_parallel_logprobs(
        logits.reshape(-1, vocab_local) if rows_selected else logits.reshape(-1, vocab_local)[rows], targets, temperature=temperature, chunk_tokens=chunk_tokens,
        group=group, with_entropy=with_entropy)
    token_logprobs, token_entropy = everywhere(token_logprobs, held), everywhere(token_entropy, held)
    selected = mb.response_mask.bool()

    def place(values: torch.Tensor) -> torch.Tensor:
        out = torch.zeros(mb.response_mask.shape, dtype=torch.float32, device=logits.device)
        return out.masked_scatter(selected, values)

    return place(token_logprobs), (place(token_entropy) if with_entropy else None)


def vocab_parallel_logprobs(logits: torch.Tensor, targets: torch.Tensor, *, temperature: float, chunk_tokens: int,
                            group=None, with_entropy: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
    """log p(target) and (optionally) the entropy of each row of `logits` [N, V/t], both fp32 [N].

    `targets` [N] are global vocabulary ids; rank r of `group` holds columns [r V/t, (r+1) V/t). `group`
    None: the logits hold the whole vocabulary (no communication).
    """
    if chunk_tokens < 1:
        raise ValueError(f"chunk_tokens must be >= 1, got {chunk_tokens}")
    logprobs, entropy = _VocabParallelLogProbs.apply(logits, targets, float(temperature), int(chunk_tokens), group,
                                                     bool(with_entropy))
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
    @staticmethod
    def forward(ctx, logits, targets, temperature, chunk_tokens, group, with_entropy):
        rows, vocab_local = logits.shape
        vocab_start = _vocab_start(logits, group)
        lse = torch.empty(rows, dtype=torch.float32, device=logits.device)
        logprobs = torch.empty_like(lse)
        entropy = torch.zeros_like(lse)
        for begin in range(0, rows, chunk_tokens):
            end = min(begin + chunk_tokens, rows)
            z = logits[begin:end].float() / temperature
            max_z = _all_reduce(z.max(dim=-1).values, group, dist.ReduceOp.MAX)
            z -= max_z.unsqueeze(1)  # shifted in place: exp cannot overflow
            local, held = _local_target(targets[begin:end], vocab_start, vocab_local)
            sums = torch.stack([
                torch.where(held, z.gather(1, local.unsqueeze(1)).squeeze(1), 0.0),
                (exp_z := z.exp()).sum(dim=-1),
                (exp_z * z).sum(dim=-1) if with_entropy else torch.zeros_like(max_z),
            ])
            del exp_z
            target_z, sum_exp, sum_exp_z = _all_reduce(sums, group)
            log_sum_exp = sum_exp.log()
            lse[begin:end] = max_z + log_sum_exp
            logprobs[begin:end] = target_z - log_sum_exp
            if with_entropy:  # H = lse - sum p z, in the shifted z: log sum_exp - sum_exp_z / sum_exp
                entropy[begin:end] = log_sum_exp - sum_exp_z / sum_exp
        ctx.save_for_backward(logits, targets, lse, entropy)
        ctx.settings = (temperature, chunk_tokens, vocab_start, with_entropy)
        return logprobs, entropy

    @staticmethod
    def backward(ctx, grad_logprobs, grad_entropy):
        logits, targets, lse, entropy = ctx.saved_tensors
        temperature, chunk_tokens, vocab_start, with_entropy = ctx.settings
        rows, vocab_local = logits.shape
        grad = torch.empty_like(logits)
        for begin in range(0, rows, chunk_tokens):
            end = min(begin + chunk_tokens, rows)
            log_p = logits[begin:end].float() / temperature - lse[begin:end].unsqueeze(1)
            p = log_p.exp()
            g_logprob = grad_logprobs[begin:end].unsqueeze(1)
            if with_entropy:
                # d/dz of g_lp log p_t + g_H H = g_lp (1[t] - p) - g_H p (log p + H)
                log_p += entropy[begin:end].unsqueeze(1)
                g_z = -p * (g_logprob + grad_entropy[begin:end].unsqueeze(1) * log_p)
            else:
                g_z = -p * g_logprob
            local, held = _local_target(targets[begin:end], vocab_start, vocab_local)
            g_z.scatter_add_(1, local.unsqueeze(1), torch.where(held, grad_logprobs[begin:end], 0.0).unsqueeze(1))
            grad[begin:end] = g_z / temperature
        return grad, None, None, None, None, None
