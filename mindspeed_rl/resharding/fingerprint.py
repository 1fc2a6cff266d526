"""After a switch: do the live inference weights hold exactly what the training shards hold?

Each copy of the plan is fingerprinted on both ends with an exact integer checksum of the bit
patterns (the sum and a position-weighted sum, in int64 with wrap-around, so the result does not
depend on summation order). The source side sends its fingerprints to the destination, which
compares them with the fingerprints of the ranges as they landed in the inference parameters.

Both ends fingerprint in the destination parameter's dtype (a bf16 vLLM model fed from fp32 norm
weights must hold their bf16 rounding, bit for bit). Every rank runs the same inference model, so
the sender finds that dtype by name in its own inference parameters.
"""
from __future__ import annotations

from collections import defaultdict
from typing import Mapping

import torch

from mindspeed_rl.resharding.bridge import p2p_exchange
from mindspeed_rl.models.layouts import tensor_view
from mindspeed_rl.resharding.plan import Copy, Plan
from mindspeed_rl.resharding.transfer import parameter_name

_BITS_VIEW = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
_ROWS_PER_CHUNK = 4096


class WeightMismatchError(RuntimeError):
    pass


def range_fingerprint(tensor: torch.Tensor, dim: int, start: int, length: int, dtype: torch.dtype) -> torch.Tensor:
    """int64 [2] fingerprint of tensor.narrow(dim, start, length) as seen in `dtype`."""
    piece = tensor.narrow(dim, start, length)
    if piece.dim() == 0 or piece.dim() == 1:
        piece = piece.reshape(1, -1)
    elif dim != 0:
        piece = piece.movedim(dim, 0)  # walk the split dimension; positions follow this order on both ends
    total = torch.zeros(2, dtype=torch.int64)
    row_numel = piece[0].numel()
    for first in range(0, piece.shape[0], _ROWS_PER_CHUNK):
        chunk = piece[first:first + _ROWS_PER_CHUNK].to(dtype).contiguous().view(_BITS_VIEW[torch.empty((), dtype=dtype).element_size()])
        values = chunk.reshape(-1).to(torch.int64)
        positions = torch.arange(first * row_numel, first * row_numel + values.numel(), dtype=torch.int64) % 65521 + 1
        total[0] += values.sum()
        total[1] += (values * positions).sum()
    return total


def verify_transfer(plan: Plan, rank: int, sources: dict[str, torch.Tensor], destinations: dict[str, torch.Tensor],
                    group=None, dtypes: Mapping[str, torch.dtype] | None = None) -> int:
    """Raise WeightMismatchError if any landed range differs from its source; returns ranges checked.
    `dtypes`: the inference parameters' dtypes by name, where this rank holds none (a disaggregated
    training rank); by default those of `destinations`."""
    if dtypes is None:
        dtypes = {name: tensor.dtype for name, tensor in destinations.items()}
    outgoing: dict[int, list[Copy]] = defaultdict(list)
    incoming: dict[int, list[Copy]] = defaultdict(list)
    for copy in plan.copies:
        if copy.src_rank == rank:
            outgoing[copy.dst_rank].append(copy)
        if copy.dst_rank == rank:
            incoming[copy.src_rank].append(copy)

    def source_prints(copies: list[Copy]) -> torch.Tensor:
        return torch.stack([range_fingerprint(tensor_view(sources, c.src_tensor), c.dim, c.src_start, c.length,
                                              dtypes[parameter_name(c.dst_tensor)]) for c in copies])

    sends = [(source_prints(outgoing[peer]), peer) for peer in sorted(outgoing) if peer != rank]
    received = {peer: torch.empty(len(incoming[peer]), 2, dtype=torch.int64) for peer in sorted(incoming) if peer != rank}
    p2p_exchange(sends, [(tensor, peer) for peer, tensor in received.items()], group)
    if rank in incoming:
        received[rank] = source_prints(incoming[rank])
    checked = 0
    for peer, copies in incoming.items():
        for copy, expected in zip(copies, received[peer]):
            target = tensor_view(destinations, copy.dst_tensor)
            got = range_fingerprint(target, copy.dim, copy.dst_start, copy.length, target.dtype)
            if not torch.equal(got, expected):
                raise WeightMismatchError(
                    f"rank {rank}: inference weight {copy.dst_tensor}[{copy.dst_start}:{copy.dst_start + copy.length}] "
                    f"(dim {copy.dim}) differs from training shard {copy.src_tensor} of rank {copy.src_rank}")
            checked += 1
    return checked
