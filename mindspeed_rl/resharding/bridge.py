"""The weight bridge of disaggregated mode: one process group over the training and inference ranks.

Training ranks and inference ranks each have their own torch.distributed world (Megatron builds its
groups over the whole world it finds, and so does vLLM under external_launcher), so neither world
can hold the other side. The bridge is a second, standalone process group over a TCPStore of its
own: bridge ranks 0..T-1 are the training ranks, T..T+I-1 the inference ranks, and the resharding
plan addresses ranks in that numbering. Only point-to-point traffic runs on it.
"""
from __future__ import annotations

import datetime

import torch
import torch.distributed as dist

_STORE_PREFIX = "mindspeed_rl_bridge"


class BridgeGroup:
    """A standalone gloo (CPU) or the accelerator's (NCCL/HCCL) process group; `exchange` posts
    every send and receive of a round at once and waits for all of them."""

    def __init__(self, *, host: str, port: int, rank: int, size: int, timeout_seconds: float, backend: str = "gloo"):
        timeout = datetime.timedelta(seconds=timeout_seconds)
        store = dist.TCPStore(host, port, size, is_master=rank == 0, timeout=timeout)
        prefixed = dist.PrefixStore(_STORE_PREFIX, store)
        self.rank, self.size, self._store = rank, size, store
        if backend == "gloo":
            self.pg = dist.ProcessGroupGloo(prefixed, rank, size, timeout)
        elif backend == "nccl":
            options = dist.ProcessGroupNCCL.Options()
            options._timeout = timeout
            self.pg = dist.ProcessGroupNCCL(prefixed, rank, size, options)
        else:  # hccl and others register their class with torch.distributed under the backend name
            raise NotImplementedError(f"the weight bridge has no {backend} process group yet; gloo and nccl only")

    def exchange(self, sends: list[tuple[torch.Tensor, int]], recvs: list[tuple[torch.Tensor, int]]) -> None:
        """Each (tensor, peer) sent or received; a pair of ranks exchanges at most one tensor each way per call."""
        works = [self.pg.send([tensor], peer, 0) for tensor, peer in sends]
        works += [self.pg.recv([tensor], peer, 0) for tensor, peer in recvs]
        for work in works:
            work.wait()

    def barrier(self) -> None:
        self.pg.barrier().wait()


def p2p_exchange(sends: list[tuple[torch.Tensor, int]], recvs: list[tuple[torch.Tensor, int]], group=None) -> None:
    """Point-to-point on the bridge, or on a torch.distributed group of this rank's world (peers are
    global ranks there, as `dist.P2POp` takes them)."""
    if isinstance(group, BridgeGroup):
        group.exchange(sends, recvs)
        return
    ops = [dist.P2POp(dist.isend, tensor, peer, group=group) for tensor, peer in sends]
    ops += [dist.P2POp(dist.irecv, tensor, peer, group=group) for tensor, peer in recvs]
    if ops:
        for request in dist.batch_isend_irecv(ops):
            request.wait()
