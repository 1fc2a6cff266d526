"""Micro-batches by token budget (MindSpeed-RL's `use_dynamic_bsz`): as few micro-batches as the budget allows,
balanced in tokens by the Karmarkar-Karp largest differencing method.

RL responses have a long-tailed length distribution: micro-batches of a fixed sample count are either padded
to their longest sample or, packed, uneven in work. Cutting by tokens and balancing the parts keeps every
micro-batch within `max_tokens` (the activation memory bound) and the parts close to equal (the pipeline
bubbles and the DP stragglers small).
"""
from __future__ import annotations

import heapq
import itertools


def karmarkar_karp(lengths: list[int], parts: int) -> list[list[int]]:
    """Indices of `lengths` in `parts` groups whose sums are close: the largest differencing method (Karmarkar
    and Karp 1982) for k-way partitioning. Each item starts as a k-tuple of subsets (itself and k-1 empty ones);
    the two tuples with the largest spread are merged, the largest subset of one with the smallest of the
    other, until one tuple is left. Deterministic: ties go to the lower index."""
    if parts < 1:
        raise ValueError(f"parts must be >= 1, got {parts}")
    counter = itertools.count()
    heap: list[tuple[int, int, list[tuple[int, list[int]]]]] = []
    for index, length in enumerate(lengths):
        subsets = [(length, [index])] + [(0, []) for _ in range(parts - 1)]
        heapq.heappush(heap, (-length, next(counter), subsets))
    if not heap:
        return [[] for _ in range(parts)]
    while len(heap) > 1:
        _, _, first = heapq.heappop(heap)
        _, _, second = heapq.heappop(heap)
        first = sorted(first, key=lambda s: (-s[0], s[1]))  # largest first
        second = sorted(second, key=lambda s: (s[0], s[1]))  # smallest first
        merged = [(a[0] + b[0], a[1] + b[1]) for a, b in zip(first, second)]
        spread = max(s[0] for s in merged) - min(s[0] for s in merged)
        heapq.heappush(heap, (-spread, next(counter), merged))
    return [sorted(indices) for _, indices in heap[0][2]]


def token_budget_partitions(lengths: list[int], *, max_tokens: int, max_samples: int | None = None) -> list[list[int]]:
    """The fewest balanced groups of sample indices with at most `max_tokens` tokens (and `max_samples` samples)
    each, ordered by their first index. A sample longer than the budget is an error, as in MindSpeed-RL."""
    too_long = [(i, n) for i, n in enumerate(lengths) if n > max_tokens]
    if too_long:
        index, length = too_long[0]
        raise ValueError(f"sample {index} has {length} tokens, more than the packing budget of {max_tokens} "
                         f"(max_packing_token_size must be >= prompt + response length)")
    if not lengths:
        return []
    parts = max(-(-sum(lengths) // max_tokens), -(-len(lengths) // (max_samples or len(lengths))))
    while True:
        groups = [g for g in karmarkar_karp(lengths, parts) if g]
        fits = all(sum(lengths[i] for i in g) <= max_tokens and len(g) <= (max_samples or len(g)) for g in groups)
        if fits:
            return sorted(groups, key=lambda g: g[0])
        parts += 1  # at most len(lengths) groups: one sample each always fits
