"""Token log-probs and entropy over a vocabulary shard: chunks of `logprob_chunk_tokens` rows vs cache-sized chunks.

    python benchmarks/bench_logprob_chunks.py [--json FILE] [--rows-times-vocab 67108864] [--repeats 3]

engines/vocab_parallel.py runs a few elementwise passes over each chunk of [rows, V/t] fp32 work (max, shift, exp,
sum, and for the entropy a row-wise dot product). They are memory-bound: with chunks of 1024 rows of a 32768
vocabulary (128 MiB) every pass reads DRAM; with chunks that fit a quarter of the last-level cache
(Accelerator.chunk_bytes_in_cache) all passes but the first read the cache. For several vocabulary shard widths,
side by side in one run, the forward and backward nanoseconds per logit and the ratio cache-sized / 1024 rows.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from mindspeed_rl.accelerator import get_accelerator  # noqa: E402
from mindspeed_rl.engines.vocab_parallel import vocab_parallel_logprobs  # noqa: E402

VOCAB_SHARDS = (8192, 32768, 76032, 152064)


def ns_per_logit(logits: torch.Tensor, targets: torch.Tensor, *, with_entropy: bool, chunk_bytes: int | None,
                 repeats: int) -> tuple[float, float]:
    """(forward, backward) best-of-`repeats` nanoseconds per logit, chunks of 1024 rows capped by chunk_bytes."""
    forward, backward = [], []
    for _ in range(repeats + 1):  # the first is a warm-up
        logits.grad = None
        start = time.perf_counter()
        logprobs, entropy = vocab_parallel_logprobs(logits, targets, temperature=1.0, chunk_tokens=1024,
                                                    with_entropy=with_entropy, chunk_bytes=chunk_bytes)
        middle = time.perf_counter()
        (logprobs.sum() + (entropy.sum() if with_entropy else 0)).backward()
        forward.append(middle - start)
        backward.append(time.perf_counter() - middle)
    per = 1e9 / logits.numel()
    return min(forward[1:]) * per, min(backward[1:]) * per


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", type=Path)
    parser.add_argument("--rows-times-vocab", type=int, default=1 << 26, help="logits per case (default 2^26)")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args(argv)
    chunk_bytes = get_accelerator("cpu").chunk_bytes_in_cache
    results = []
    print(f"cache-sized chunks: {chunk_bytes / 2**20:.0f} MiB; threads {torch.get_num_threads()}")
    for vocab in VOCAB_SHARDS:
        rows = args.rows_times_vocab // vocab
        logits = (torch.randn(rows, vocab, generator=torch.Generator().manual_seed(0)) * 3).requires_grad_(True)
        targets = torch.randint(0, vocab, (rows,), generator=torch.Generator().manual_seed(1))
        for with_entropy in (False, True):
            rows_1024 = ns_per_logit(logits, targets, with_entropy=with_entropy, chunk_bytes=None, repeats=args.repeats)
            cached = ns_per_logit(logits, targets, with_entropy=with_entropy, chunk_bytes=chunk_bytes,
                                  repeats=args.repeats)
            row = {"vocab_shard": vocab, "rows": rows, "with_entropy": with_entropy,
                   "cache_chunk_rows": max(1, min(1024, chunk_bytes // (4 * vocab))),
                   "ns_per_logit_1024_rows": {"forward": rows_1024[0], "backward": rows_1024[1]},
                   "ns_per_logit_cache_sized": {"forward": cached[0], "backward": cached[1]},
                   "ratio_forward": cached[0] / rows_1024[0], "ratio_backward": cached[1] / rows_1024[1]}
            results.append(row)
            print(f"V/t={vocab:6d} entropy={with_entropy!s:5}  forward {rows_1024[0]:.2f} -> {cached[0]:.2f} ns/logit "
                  f"({row['ratio_forward']:.2f}x, {row['cache_chunk_rows']} rows)   backward {rows_1024[1]:.2f} -> "
                  f"{cached[1]:.2f} ({row['ratio_backward']:.2f}x)", flush=True)
    if args.json:
        args.json.write_text(json.dumps({"chunk_bytes": chunk_bytes, "threads": torch.get_num_threads(),
                                         "results": results}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
