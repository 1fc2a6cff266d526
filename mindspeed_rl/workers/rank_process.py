"""Where a rank runs and what its process leaves behind: the part of the rank worker the driver's supervision and
rendezvous talk to (workers/group.py, workers/supervision.py), whatever the rank computes."""
from __future__ import annotations

import os
from dataclasses import dataclass


@dataclass(frozen=True, kw_only=True)
class RankInfo:
    rank: int
    world_size: int
    master_addr: str
    master_port: int
    # Names this run's heartbeats in Ray's key-value store (workers/supervision.py).
    run_key: str = ""


class RankProcess:
    """Mixed into workers/rank_worker.RankWorker, which gives `rank_info` and `ROLE`."""

    ROLE = ""
    rank_info: RankInfo

    def address(self):
        """Where this rank runs (host, pid): named in every failure message."""
        from mindspeed_rl.workers.supervision import this_worker_address

        return this_worker_address(self.rank_info.rank, role=self.ROLE)

    def set_rendezvous(self, master_addr: str, master_port: int) -> None:
        """Where the ranks meet: rank 0's node (one node: the loopback address) at a port free there."""
        os.environ.update(MASTER_ADDR=master_addr, MASTER_PORT=str(master_port))

    def free_port(self) -> int:
        """A port free on this rank's node, on every interface: rank 0's is the rendezvous port."""
        from mindspeed_rl.workers.processes import free_port

        return free_port("")

    def shm_segments(self) -> list[str]:
        """The /dev/shm segments this process maps (vLLM's broadcast and all-reduce buffers): the
        driver unlinks them once the ranks are gone, since a killed process never does."""
        from mindspeed_rl.workers.processes import mapped_shm_segments

        return sorted(mapped_shm_segments([os.getpid()]))
