"""At TP2 each rank holds half the vocabulary: the log-probs and entropy from the shards (two all-reduces per
chunk, no gather) equal the full-vocabulary log-softmax, and each rank's gradient is its half of the full
gradient, in fp32 and bf16; so do the log-probs of k targets a row (the sampled token and a teacher's top-k, for
on-policy distillation) and their gradient, and the top k of the whole vocabulary from the shards' candidates. Runs in
2 spawned processes (torch.multiprocessing, real gloo group)."""
import os

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from mindspeed_rl.engines.vocab_parallel import vocab_parallel_logprobs, vocab_parallel_topk
from resharding_oracle import free_port
from test_vocab_parallel_logprobs import _case, full_vocabulary
from preloaded import spawn_ranks

TP = 2


def _rank(rank: int, port: int, results) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=TP)
    try:
        out = {}
        for dtype in (torch.float32, torch.bfloat16):
            logits, targets, (w_logprob, w_entropy) = _case(dtype, rows=23, vocab=64, seed=5)
            shard = logits.chunk(TP, dim=1)[rank].clone().requires_grad_(True)
            logprobs, entropy = vocab_parallel_logprobs(shard, targets, temperature=0.8, chunk_tokens=6,
                                                        group=dist.group.WORLD, with_entropy=True)
            (logprobs * w_logprob + entropy * w_entropy).sum().backward()
            out[str(dtype)] = (logprobs.detach(), entropy.detach(), shard.grad.float())
        logits, many, weights = _many_targets()
        shard = logits.chunk(TP, dim=1)[rank].clone().requires_grad_(True)
        logprobs, _ = vocab_parallel_logprobs(shard, many, temperature=0.8, chunk_tokens=6, group=dist.group.WORLD,
                                              with_entropy=False)
        (logprobs * weights).sum().backward()
        top = vocab_parallel_topk(logits.chunk(TP, dim=1)[rank], TOP_K, temperature=0.8, chunk_tokens=6,
                                  group=dist.group.WORLD)
        out["many"], out["top"] = (logprobs.detach(), shard.grad), top
        results[rank] = out
    finally:
        dist.destroy_process_group()


TOP_K = 5


def _many_targets():
    """fp32 logits [23, 64], 1 + TOP_K targets a row spread over both shards, and weights for their gradient."""
    generator = torch.Generator().manual_seed(9)
    logits = torch.randn(23, 64, generator=generator) * 3
    targets = torch.randint(0, 64, (23, 1 + TOP_K), generator=generator)
    return logits, targets, torch.randn(23, 1 + TOP_K, generator=generator)


def test_tp2_shards_give_the_full_vocabulary_values_and_their_half_of_the_gradient():
    results = mp.Manager().dict()
    spawn_ranks(_rank, args=(free_port(), results), nprocs=TP)
    for dtype in (torch.float32, torch.bfloat16):
        logits, targets, (w_logprob, w_entropy) = _case(dtype, rows=23, vocab=64, seed=5)
        full = logits.clone().requires_grad_(True)
        want_logprobs, want_entropy = full_vocabulary(full, targets, 0.8)
        (want_logprobs * w_logprob + want_entropy * w_entropy).sum().backward()
        atol = 2e-6 if dtype == torch.float32 else 1e-2
        for rank in range(TP):
            logprobs, entropy, grad = results[rank][str(dtype)]
            torch.testing.assert_close(logprobs, want_logprobs.detach(), rtol=0, atol=4e-6)
            torch.testing.assert_close(entropy, want_entropy.detach(), rtol=0, atol=4e-6)
            torch.testing.assert_close(grad, full.grad.float().chunk(TP, dim=1)[rank], rtol=0, atol=atol)
    logits, many, weights = _many_targets()
    full = logits.clone().requires_grad_(True)
    want = torch.log_softmax(full / 0.8, dim=-1).gather(1, many)
    (want * weights).sum().backward()
    want_top = torch.topk(torch.log_softmax(logits / 0.8, dim=-1), TOP_K, dim=-1)
    for rank in range(TP):
        logprobs, grad = results[rank]["many"]
        torch.testing.assert_close(logprobs, want.detach(), rtol=0, atol=4e-6)
        torch.testing.assert_close(grad, full.grad.chunk(TP, dim=1)[rank], rtol=0, atol=2e-6)
        top_values, top_ids = results[rank]["top"]
        torch.testing.assert_close(top_values, want_top.values, rtol=0, atol=4e-6)
        assert torch.equal(top_ids, want_top.indices)
