"""Log-probs and entropy from the vocabulary shard (engines/vocab_parallel.py) equal the full-vocabulary
log-softmax they replace, values and gradients, in fp32 and bf16; the engine's response-row selection equals
the previous gather over every position. Runs in-process (one rank: the whole vocabulary)."""
import pytest
import torch

from mindspeed_rl.engines.vocab_parallel import vocab_parallel_logprobs
from mindspeed_rl.protocol import RolloutBatch


def full_vocabulary(logits: torch.Tensor, targets: torch.Tensor, temperature: float):
    """The oracle: the previous path's formula, the whole vocabulary's fp32 log-softmax."""
    log_p = torch.log_softmax(logits.float() / temperature, dim=-1)
    return log_p.gather(1, targets.unsqueeze(1)).squeeze(1), -(log_p.exp() * log_p).sum(-1)


def _case(dtype, rows=37, vocab=50, seed=0):
    g = torch.Generator().manual_seed(seed)
    logits = (torch.randn(rows, vocab, generator=g) * 3).to(dtype)
    targets = torch.randint(0, vocab, (rows,), generator=g)
    weights = torch.randn(2, rows, generator=g)
    return logits, targets, weights


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_values_and_gradients_equal_the_full_vocabulary_log_softmax(dtype):
    logits, targets, (w_logprob, w_entropy) = _case(dtype)
    ours_in = logits.clone().requires_grad_(True)
    oracle_in = logits.clone().requires_grad_(True)
    logprobs, entropy = vocab_parallel_logprobs(ours_in, targets, temperature=0.7, chunk_tokens=8, with_entropy=True)
    want_logprobs, want_entropy = full_vocabulary(oracle_in, targets, 0.7)
    (logprobs * w_logprob + entropy * w_entropy).sum().backward()
    (want_logprobs * w_logprob + want_entropy * w_entropy).sum().backward()

    torch.testing.assert_close(logprobs, want_logprobs, rtol=0, atol=2e-6)
    torch.testing.assert_close(entropy, want_entropy, rtol=0, atol=2e-6)
    assert ours_in.grad.dtype == dtype
    atol = 2e-6 if dtype == torch.float32 else 1e-2  # the gradient is rounded to bf16 once, as autograd's is
    torch.testing.assert_close(ours_in.grad.float(), oracle_in.grad.float(), rtol=0, atol=atol)


def test_the_chunk_size_changes_nothing():
    logits, targets, _ = _case(torch.float32, rows=29)
    results = [vocab_parallel_logprobs(logits, targets, temperature=1.0, chunk_tokens=chunk, with_entropy=True)
               for chunk in (1, 5, 29, 1000)]
    for logprobs, entropy in results[1:]:
        torch.testing.assert_close(logprobs, results[0][0], rtol=0, atol=1e-6)
        torch.testing.assert_close(entropy, results[0][1], rtol=0, atol=1e-6)


def test_chunk_bytes_caps_the_rows_and_changes_nothing():
    """Accelerator.chunk_bytes_in_cache's cap: 50 columns x 4 bytes x 6 rows = 1200 bytes a chunk, 37 rows in 7 chunks
    (the last partial), the buffers reused across them; values and both gradients as in one chunk."""
    logits, targets, (w_logprob, w_entropy) = _case(torch.float32)
    grads = []
    for chunk_bytes in (None, 6 * 50 * 4 + 3):
        ours_in = logits.clone().requires_grad_(True)
        logprobs, entropy = vocab_parallel_logprobs(ours_in, targets, temperature=0.7, chunk_tokens=1000,
                                                    with_entropy=True, chunk_bytes=chunk_bytes)
        (logprobs * w_logprob + entropy * w_entropy).sum().backward()
        grads.append((logprobs.detach(), entropy.detach(), ours_in.grad))
    for whole, capped in zip(grads[0], grads[1]):
        torch.testing.assert_close(capped, whole, rtol=0, atol=1e-6)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_gradient_written_over_the_logits_is_the_same(dtype):
    """`grad_into_logits`: the backward spends the logits (an intermediate, as the output layer's) on the gradient."""
    logits, targets, (w_logprob, w_entropy) = _case(dtype)
    grads = []
    for grad_into_logits in (False, True):
        leaf = logits.clone().requires_grad_(True)
        head_output = leaf * 1  # the output layer's logits: produced by the graph, read by nothing after the loss
        logprobs, entropy = vocab_parallel_logprobs(head_output, targets, temperature=0.7, chunk_tokens=8,
                                                    with_entropy=True, grad_into_logits=grad_into_logits)
        (logprobs * w_logprob + entropy * w_entropy).sum().backward()
        grads.append(leaf.grad)
    torch.testing.assert_close(grads[1], grads[0], rtol=0, atol=0)


def test_gradient_of_the_log_probs_alone():
    logits, targets, (weights, _) = _case(torch.float32)
    ours_in, oracle_in = logits.clone().requires_grad_(True), logits.clone().requires_grad_(True)
    logprobs, entropy = vocab_parallel_logprobs(ours_in, targets, temperature=1.3, chunk_tokens=4, with_entropy=False)
    assert entropy is None
    (logprobs * weights).sum().backward()
    (full_vocabulary(oracle_in, targets, 1.3)[0] * weights).sum().backward()
    torch.testing.assert_close(ours_in.grad, oracle_in.grad, rtol=0, atol=2e-6)


def test_extreme_logits_stay_finite():
    logits = torch.tensor([[1e4, -1e4, 0.0], [-1e4, -1e4, -1e4]])
    logprobs, entropy = vocab_parallel_logprobs(logits, torch.tensor([0, 2]), temperature=1.0, chunk_tokens=1,
                                                with_entropy=True)
    torch.testing.assert_close(logprobs, torch.tensor([0.0, -torch.log(torch.tensor(3.0)).item()]))
    torch.testing.assert_close(entropy, torch.tensor([0.0, torch.log(torch.tensor(3.0)).item()]))


def test_the_engine_scores_response_rows_as_the_previous_gather_did(world):
    from mindspeed_rl.engines.vocab_parallel import response_logprobs_from_logits
    from mindspeed_rl.parallel import megatron_state

    g = torch.Generator().manual_seed(3)
    prompts = [[5, 6, 7], [8, 9], [1, 2, 3, 4]]
    responses = [[10, 11], [12, 13, 14, 15], [16]]
    mb = RolloutBatch.from_token_lists(prompts, responses, pad_id=0, response_width=4).micro_batches(3, "cpu")[0]
    width, vocab = mb.input_ids.shape[1], 20
    logits = torch.randn(3, width, vocab, generator=g, requires_grad=True)
    logprobs, entropy = response_logprobs_from_logits(logits, mb, 0.9, with_entropy=True, chunk_tokens=2,
                                                      parallel=megatron_state.current())

    # The previous path: every position's log-softmax, then the response positions gathered and masked.
    log_p = torch.log_softmax(logits.detach() / 0.9, dim=-1)
    token_logprobs = log_p.gather(2, torch.roll(mb.input_ids, -1, 1).unsqueeze(2)).squeeze(2)
    index = (mb.prompt_lengths.unsqueeze(1) - 1 + torch.arange(4)).clamp(max=width - 1)
    want = torch.gather(token_logprobs, 1, index) * mb.response_mask
    want_entropy = torch.gather(-(log_p.exp() * log_p).sum(-1), 1, index) * mb.response_mask
    torch.testing.assert_close(logprobs, want, rtol=0, atol=2e-6)
    torch.testing.assert_close(entropy, want_entropy, rtol=0, atol=2e-6)
    logprobs.sum().backward()  # prompt positions and padding get no gradient
    scored = torch.zeros(3, width, dtype=torch.bool)
    for i, p in enumerate(mb.prompt_lengths.tolist()):
        scored[i, p - 1: p - 1 + int(mb.response_mask[i].sum())] = True
    assert bool((logits.grad.abs().sum(-1) > 0).eq(scored).all())


def test_log_prob_chunks_fit_a_quarter_of_the_hosts_cache():
    """Accelerator.chunk_bytes_in_cache: a quarter of the largest cache sysfs names on a host; no cap on a device."""
    from pathlib import Path

    from mindspeed_rl.accelerator import Accelerator
    from mindspeed_rl.accelerator.host_memory import last_level_cache_bytes

    sizes = [entry.read_text().strip() for entry in Path("/sys/devices/system/cpu/cpu0/cache").glob("index*/size")]
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    expected = max((int(s[:-1]) * units[s[-1].upper()] for s in sizes), default=32 << 20)
    assert last_level_cache_bytes() == expected
    assert Accelerator("cpu").chunk_bytes_in_cache == expected // 4
    assert Accelerator("cuda").chunk_bytes_in_cache is None
