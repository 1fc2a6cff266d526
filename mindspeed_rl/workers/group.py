"""Ray placement of the hybrid actor's ranks, and SPMD calls across them."""
from __future__ import annotations

import os
import socket
from typing import Any

import ray
from ray.util.placement_group import placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from mindspeed_rl.workers.actor_hybrid_worker import ActorHybridWorker, RankInfo, Shard


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _bundle(device: str, cpus_per_rank: float) -> dict[str, float]:
    if device == "cuda":
        return {"GPU": 1, "CPU": cpus_per_rank}
    if device == "npu":
        return {"NPU": 1, "CPU": cpus_per_rank}
    return {"CPU": cpus_per_rank}


class RayActorGroup:
    """`world_size` ActorHybridWorker ranks packed on one set of devices (colocated roles)."""

    def __init__(self, *, config, device: str, env_vars: dict[str, str], model_dir: str, ref_model_dir: str):
        world_size = config.world_size
        cpus_per_rank = 1.0
        self.placement_group = placement_group([_bundle(device, cpus_per_rank)] * world_size, strategy="PACK")
        ray.get(self.placement_group.ready())
        master_port = _free_port()
        self.workers = [
            ActorHybridWorker.options(
                num_cpus=cpus_per_rank,
                num_gpus=1 if device == "cuda" else 0,
                resources={"NPU": 1} if device == "npu" else None,
                scheduling_strategy=PlacementGroupSchedulingStrategy(self.placement_group, placement_group_bundle_index=rank),
                runtime_env={"env_vars": env_vars},
            ).remote(config, RankInfo(rank=rank, world_size=world_size, master_addr="127.0.0.1", master_port=master_port),
                     model_dir=model_dir, ref_model_dir=ref_model_dir)
            for rank in range(world_size)
        ]

    def call(self, method: str, *args: Any, blocking: bool = True, **kwargs: Any) -> list[Any]:
        """Run `method` on every rank (SPMD): each rank's result, or with blocking=False their Ray refs."""
        refs = [getattr(worker, method).remote(*args, **kwargs) for worker in self.workers]
        return ray.get(refs) if blocking else refs

    # ROLL's cluster-level state control: `actor.offload_states(blocking=True)`.
    def offload_states(self, include: list[str] | None = None, *, keep_contents: bool | None = None,
                       blocking: bool = True) -> list[Any]:
        return self.call("offload_states", include, keep_contents, blocking=blocking)

    def reload_states(self, include: list[str] | None = None, *, blocking: bool = True) -> list[Any]:
        return self.call("reload_states", include, blocking=blocking)

    def shutdown(self) -> None:
        try:
            self.call("shutdown")
        finally:
            for worker in self.workers:
                ray.kill(worker)


def merge_shards(shards: list[Shard]) -> list[Shard]:
    """The reporting rank's shard for each sample range, in sample order."""
    reported = {(s.start, s.stop): s for s in shards if s.value is not None}
    return [reported[key] for key in sorted(reported)]


def merge_metrics(per_rank: list[dict[str, float]]) -> dict[str, float]:
    """Rank 0's timings; memory figures as the maximum over ranks (the device that runs out first)."""
    merged = dict(per_rank[0])
    for metrics in per_rank[1:]:
        for key, value in metrics.items():
            if key.startswith("memory/"):
                merged[key] = max(merged.get(key, 0.0), value)
    return merged


def default_env_vars(threads_per_rank: int) -> dict[str, str]:
    env = {
        # vLLM must run in-process so the trainer reaches its model, weights and KV cache.
        "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
        # vLLM otherwise shrinks torch to 1 thread "for serving"; it also freezes the count later.
        "OMP_NUM_THREADS": str(threads_per_rank),
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "TOKENIZERS_PARALLELISM": "false",
        "VLLM_LOGGING_LEVEL": os.environ.get("VLLM_LOGGING_LEVEL", "ERROR"),
        "PYTHONWARNINGS": "ignore",
        # Where the device is host memory, a storage that comes back after an offload is fresh
        # memory: with 2 MiB pages torch's allocator takes 512x fewer page faults to map it
        # (measured in benchmarks/bench_offload.py). It only changes host allocations >= 2 MiB.
        "THP_MEM_ALLOC_ENABLE": "1",
    }
    return env
