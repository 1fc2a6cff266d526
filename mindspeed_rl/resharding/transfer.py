"""Execute a resharding plan with point-to-point collectives, in buckets of bounded size.

Every rank computes the same plan, so no metadata is exchanged: each round, a rank packs what it
sends into one reusable send buffer, receives into one reusable receive buffer, and copies the
received ranges straight into the live inference parameters. Send and receive each stay within
`bucket_bytes` (a copy larger than a bucket is cut along its split dimension; one index along
that dimension is the smallest unit), so the extra memory of a switch is two buckets.
"""
from __future__ import annotations

import time
from collections import defaultdict
from dataclasses import dataclass, replace

import torch
import torch.distributed as dist

from mindspeed_rl.resharding.layouts import tensor_view
from mindspeed_rl.resharding.plan import Copy, Plan


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


def _view(tensors: dict[str, torch.Tensor], name: str, copy: Copy, start: int) -> torch.Tensor:
    return tensor_view(tensors, name).narrow(copy.dim, start, copy.length)


class Transfer:
    """A plan bound to this rank, executable every switch."""

    def __init__(self, plan: Plan, *, rank: int, bucket_bytes: int, dtype: torch.dtype, group=None):
        self.plan, self.rank, self.group, self.dtype = plan, rank, group, dtype
        itemsize = torch.empty((), dtype=dtype).element_size()
        self.bucket_numel = max(1, bucket_bytes // itemsize)
        remote = [c for c in plan.copies if c.src_rank != c.dst_rank]
        self.local_copies = [c for c in plan.copies if c.src_rank == c.dst_rank == rank]
        self.rounds = [r for r in split_into_rounds(remote, self.bucket_numel)
                       if any(rank in (c.src_rank, c.dst_rank) for c in r)]
        # Every rank must take part in the same rounds in the same order only with its own peers,
        # so rounds without this rank are dropped from its schedule.
        self.send_capacity = max((sum(c.numel for c in r if c.src_rank == rank) for r in self.rounds), default=0)
        self.recv_capacity = max((sum(c.numel for c in r if c.dst_rank == rank) for r in self.rounds), default=0)
        self.itemsize = itemsize

    @torch.no_grad()
    def run(self, sources: dict[str, torch.Tensor], destinations: dict[str, torch.Tensor]) -> TransferStats:
        started = time.perf_counter()
        stats = TransferStats(rounds=len(self.rounds))
        for copy in self.local_copies:
            _view(destinations, copy.dst_tensor, copy, copy.dst_start).copy_(_view(sources, copy.src_tensor, copy, copy.src_start))
            stats.bytes_local += copy.numel * self.itemsize
        device = next(iter(sources.values())).device
        send_buffer = torch.empty(self.send_capacity, dtype=self.dtype, device=device)
        recv_buffer = torch.empty(self.recv_capacity, dtype=self.dtype, device=device)
        stats.peak_extra_bytes = (self.send_capacity + self.recv_capacity) * self.itemsize
        for members in self.rounds:
            self._round(members, sources, destinations, send_buffer, recv_buffer, stats)
        del send_buffer, recv_buffer
        stats.seconds = time.perf_counter() - started
        return stats

    def _round(self, members: list[Copy], sources, destinations, send_buffer, recv_buffer, stats) -> None:
        outgoing, incoming = defaultdict(list), defaultdict(list)
        for copy in members:
            if copy.src_rank == self.rank:
                outgoing[copy.dst_rank].append(copy)
            if copy.dst_rank == self.rank:
                incoming[copy.src_rank].append(copy)
        ops, offset = [], 0
        for peer in sorted(outgoing):
            start = offset
            for copy in outgoing[peer]:
                view = _view(sources, copy.src_tensor, copy, copy.src_start)
                send_buffer[offset:offset + copy.numel].view(view.shape).copy_(view)
                offset += copy.numel
            ops.append(dist.P2POp(dist.isend, send_buffer[start:offset], peer, group=self.group))
        stats.bytes_sent += offset * self.itemsize
        landing, offset = [], 0
        for peer in sorted(incoming):
            start = offset
            for copy in incoming[peer]:
                landing.append((copy, offset))
                offset += copy.numel
            ops.append(dist.P2POp(dist.irecv, recv_buffer[start:offset], peer, group=self.group))
        stats.bytes_received += offset * self.itemsize
        if ops:
            for request in dist.batch_isend_irecv(ops):
                request.wait()
        for copy, start in landing:
            target = _view(destinations, copy.dst_tensor, copy, copy.dst_start)
            target.copy_(recv_buffer[start:start + copy.numel].view(target.shape))
