"""Execute a resharding plan with point-to-point collectives, in buckets of bounded size.

Every rank computes the same plan, so no metadata is exchanged: each round, a rank packs what it
sends into one reusable send buffer, receives into one reusable receive buffer, and copies the
received ranges straight into the live inference parameters. Send and receive each stay within
`bucket_bytes` (a copy larger than a bucket is cut along its split dimension; one index along
that dimension is the smallest unit), so the extra memory of a switch is two buckets.

Dtypes. A model holds more than one dtype (Megatron's bf16 model keeps its torch RMSNorm weights
in fp32 on CPU; vLLM holds everything in `generate_config.dtype`), so the rank's first parameter
says nothing about what a peer sends. The wire dtype of a copy is the dtype of its *destination*
parameter: the sender casts while packing, the receiver lands the bytes unchanged. Every rank
runs the same inference model, so every rank knows every destination parameter's dtype by name
(`destination_dtypes`) and sender and receiver agree without exchanging anything. Each round
carries one dtype (one bucket per dtype), so the buffers are plain views of one byte buffer.
"""
from __future__ import annotations

import re
import time
from collections import defaultdict
from dataclasses import dataclass, replace
from typing import Mapping

import torch

from mindspeed_rl.resharding.bridge import p2p_exchange
from mindspeed_rl.models.layouts import tensor_view
from mindspeed_rl.resharding.plan import Copy, Plan

_INDEXED = re.compile(r"\[\d+\]$")


@dataclass
class TransferStats:
    bytes_sent: int = 0
    bytes_received: int = 0
    bytes_local: int = 0
    rounds: int = 0
    peak_extra_bytes: int = 0  # the two staging buffers
    seconds: float = 0.0

    def as_metrics(self, prefix: str = "resharding") -> dict[str, float]:
        return {f"{prefix}/{k}": float(v) for k, v in vars(self).items()}


def destination_dtypes(destinations: Mapping[str, torch.Tensor]) -> dict[str, torch.dtype]:
    """Parameter name -> dtype of the inference parameters; the wire dtypes of a transfer into them."""
    return {name: tensor.dtype for name, tensor in destinations.items()}


def parameter_name(key: str) -> str:
    """A LocalTensor key ("w13_weight[3]") -> the parameter it lives in ("w13_weight")."""
    return _INDEXED.sub("", key)


def itemsize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def split_into_rounds(copies: list[Copy], bucket_numel: int) -> list[list[Copy]]:
    """First-fit packing of remote copies into rounds where every rank sends and receives at most
    `bucket_numel` elements (deterministic: every rank computes the same rounds)."""
    pieces: list[Copy] = []
    for copy in copies:
        units_per_piece = max(1, bucket_numel // copy.unit_numel)
        for start in range(0, copy.length, units_per_piece):
            length = min(units_per_piece, copy.length - start)
            pieces.append(replace(copy, src_start=copy.src_start + start, dst_start=copy.dst_start + start, length=length))
    rounds: list[list[Copy]] = []
    send_load: list[dict[int, int]] = []
    recv_load: list[dict[int, int]] = []
    for piece in pieces:
        for index, members in enumerate(rounds):
            fits_send = send_load[index][piece.src_rank] + piece.numel <= bucket_numel
            fits_recv = recv_load[index][piece.dst_rank] + piece.numel <= bucket_numel
            if fits_send and fits_recv:
                break
        else:
            index = len(rounds)
            rounds.append([])
            send_load.append(defaultdict(int))
            recv_load.append(defaultdict(int))
        rounds[index].append(piece)
        send_load[index][piece.src_rank] += piece.numel
        recv_load[index][piece.dst_rank] += piece.numel
    return rounds


def _view(tensors: Mapping[str, torch.Tensor], name: str, copy: Copy, start: int) -> torch.Tensor:
    return tensor_view(tensors, name).narrow(copy.dim, start, copy.length)


class Transfer:
    """A plan bound to this rank, executable every switch.

    `dtype`: the dtype of the inference parameters, one for all or per parameter name
    (`destination_dtypes(destinations)`); it must be the same on every rank."""

    def __init__(self, plan: Plan, *, rank: int, bucket_bytes: int,
                 dtype: torch.dtype | Mapping[str, torch.dtype], group=None):
        self.plan, self.rank, self.group = plan, rank, group
        self._dtypes = dict(dtype) if isinstance(dtype, Mapping) else None
        self._single_dtype = None if isinstance(dtype, Mapping) else dtype
        remote_by_dtype: dict[torch.dtype, list[Copy]] = defaultdict(list)
        for copy in plan.copies:
            if copy.src_rank != copy.dst_rank:
                remote_by_dtype[self.wire_dtype(copy)].append(copy)
        self.local_copies = [c for c in plan.copies if c.src_rank == c.dst_rank == rank]
        self._landing = {c.dst_tensor: self.wire_dtype(c) for c in plan.copies if c.dst_rank == rank}
        # (dtype, copies) per round; dtypes in a fixed order so every rank walks the same schedule.
        self.rounds: list[tuple[torch.dtype, list[Copy]]] = []
        for wire in sorted(remote_by_dtype, key=str):
            bucket_numel = max(1, bucket_bytes // itemsize(wire))
            for members in split_into_rounds(remote_by_dtype[wire], bucket_numel):
                # A rank takes part only in rounds with its own peers, in the same order as they do.
                if any(rank in (c.src_rank, c.dst_rank) for c in members):
                    self.rounds.append((wire, members))
        self.send_capacity_bytes = max((sum(c.numel for c in r if c.src_rank == rank) * itemsize(d)
                                        for d, r in self.rounds), default=0)
        self.recv_capacity_bytes = max((sum(c.numel for c in r if c.dst_rank == rank) * itemsize(d)
                                        for d, r in self.rounds), default=0)

    def wire_dtype(self, copy: Copy) -> torch.dtype:
        """The dtype a copy travels in: its destination parameter's."""
        if self._dtypes is None:
            return self._single_dtype
        name = parameter_name(copy.dst_tensor)
        if name not in self._dtypes:
            raise KeyError(f"no dtype for inference parameter {name}")
        return self._dtypes[name]

    def _check_destinations(self, destinations: Mapping[str, torch.Tensor]) -> None:
        """Peers packed for the dtypes this transfer was built with; a different live dtype would be
        filled with bytes of another type."""
        for key, planned in self._landing.items():
            got = tensor_view(destinations, key).dtype
            if got != planned:
                raise ValueError(f"inference parameter {key} is {got}, the transfer was planned for {planned}")

    @torch.no_grad()
    def run(self, sources: Mapping[str, torch.Tensor], destinations: Mapping[str, torch.Tensor]) -> TransferStats:
        started = time.perf_counter()
        self._check_destinations(destinations)
        stats = TransferStats(rounds=len(self.rounds))
        for copy in self.local_copies:  # copy_ casts to the destination dtype, as the wire does
            target = _view(destinations, copy.dst_tensor, copy, copy.dst_start)
            target.copy_(_view(sources, copy.src_tensor, copy, copy.src_start))
            stats.bytes_local += copy.numel * target.element_size()
        # A disaggregated inference rank has no sources, a training rank no destinations.
        device = next(iter(sources.values() if sources else destinations.values())).device
        send_bytes = torch.empty(self.send_capacity_bytes, dtype=torch.uint8, device=device)
        recv_bytes = torch.empty(self.recv_capacity_bytes, dtype=torch.uint8, device=device)
        stats.peak_extra_bytes = self.send_capacity_bytes + self.recv_capacity_bytes
        for wire, members in self.rounds:
            self._round(members, wire, sources, destinations, send_bytes, recv_bytes, stats)
        del send_bytes, recv_bytes
        stats.seconds = time.perf_counter() - started
        return stats

    def _round(self, members: list[Copy], wire: torch.dtype, sources, destinations, send_bytes, recv_bytes,
               stats) -> None:
        size = itemsize(wire)
        send_buffer = send_bytes[: send_bytes.numel() // size * size].view(wire)
        recv_buffer = recv_bytes[: recv_bytes.numel() // size * size].view(wire)
        outgoing, incoming = defaultdict(list), defaultdict(list)
        for copy in members:
            if copy.src_rank == self.rank:
                outgoing[copy.dst_rank].append(copy)
            if copy.dst_rank == self.rank:
                incoming[copy.src_rank].append(copy)
        sends, recvs, offset = [], [], 0
        for peer in sorted(outgoing):
            start = offset
            for copy in outgoing[peer]:
                view = _view(sources, copy.src_tensor, copy, copy.src_start)
                send_buffer[offset:offset + copy.numel].view(view.shape).copy_(view)  # casts to the wire dtype
                offset += copy.numel
            # Bytes on the wire: every backend moves uint8, whatever the dtype.
            sends.append((send_bytes[start * size:offset * size], peer))
        stats.bytes_sent += offset * size
        landing, offset = [], 0
        for peer in sorted(incoming):
            start = offset
            for copy in incoming[peer]:
                landing.append((copy, offset))
                offset += copy.numel
            recvs.append((recv_bytes[start * size:offset * size], peer))
        stats.bytes_received += offset * size
        p2p_exchange(sends, recvs, self.group)
        for copy, start in landing:
            target = _view(destinations, copy.dst_tensor, copy, copy.dst_start)
            target.copy_(recv_buffer[start:start + copy.numel].view(target.shape))
