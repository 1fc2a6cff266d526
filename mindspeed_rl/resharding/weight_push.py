"""The weight push: training weights -> the inference engine's live weights, one protocol for every mode.

Every rank that takes part calls `push()` at the same time (a collective); it sends and receives this
rank's share, checks the landed weights against their sources unless told not to, and returns what it
moved as metrics. Two ways to build one, one implementation (`PlannedPush`, the resharding plan run by
`Transfer`) behind both:

* `colocated_push`: the same ranks hold the training shards and vLLM's parameters; the plan runs over
  their own world, and where the layouts agree nothing crosses the wire.
* `bridge_push`: actor_train and actor_infer on their own ranks (disaggregated); the plan runs between
  the two rank sets over the bridge (resharding/bridge.py), training ranks send, inference ranks receive.

A LoRA actor's push (resharding/adapter_push.py) is the same protocol in both modes, moving only the adapters.

A new transport (CUDA IPC, HCCL, vLLM's weight-transfer API) is another class with `push` and `close`.
"""
from __future__ import annotations

import time
from typing import Callable, Mapping, Protocol

import torch

from mindspeed_rl.resharding.fingerprint import verify_transfer
from mindspeed_rl.models.layouts import tensor_view, uncovered_ranges
from mindspeed_rl.resharding.plan import InferLayout, Plan, TrainLayout, build_plan
from mindspeed_rl.resharding.transfer import Transfer, destination_dtypes, itemsize


class WeightPush(Protocol):
    def push(self) -> dict[str, float]:
        """Collective over every rank of the push: move this rank's share, verify it, return the metrics
        (`resharding/bytes_sent`, `bytes_received`, `bytes_local`, `planned_bytes_received`, ...)."""

    def states_needed(self) -> frozenset[str]:
        """State groups the next push reads beyond the switch row of the residency table (LoRA's first push
        reads the backbone)."""

    def host_tensors(self) -> list[torch.Tensor]:
        """What the push keeps on the host between pushes (registered as the state `inference_weights_host`)."""

    def close(self) -> None:
        """Leave the push's group, if it has one of its own (collective)."""


class PlannedPush:
    """A resharding plan bound to this rank. `read_sources` gives the training shards (None: this rank has
    none, an inference rank of a disaggregated actor); `inference_model` the engine the weights land in
    (None: a training rank of a disaggregated actor)."""

    def __init__(self, plan: Plan, *, rank: int, bucket_bytes: int, dtypes: Mapping[str, torch.dtype],
                 read_sources: Callable[[], dict[str, torch.Tensor]] | None, inference_model, check_weights: bool,
                 group=None):
        self.plan, self.rank, self.group, self.dtypes = plan, rank, group, dict(dtypes)
        self.read_sources = read_sources
        self.inference_model = inference_model
        self.check_weights = check_weights
        self.transfer = Transfer(plan, rank=rank, bucket_bytes=bucket_bytes, dtype=self.dtypes, group=group)
        if inference_model is not None:
            check_and_clear_padding(plan, rank, inference_model.named_weights())
        self.planned_bytes_received = sum(c.numel * itemsize(self.transfer.wire_dtype(c))
                                          for c in plan.copies_to(rank) if c.src_rank != rank)

    @torch.no_grad()
    def push(self) -> dict[str, float]:
        sources = self.read_sources() if self.read_sources is not None else {}
        destinations = self.inference_model.named_weights() if self.inference_model is not None else {}
        metrics = self.transfer.run(sources, destinations).as_metrics()
        metrics["resharding/planned_bytes_received"] = float(self.planned_bytes_received)
        if self.check_weights:
            started = time.perf_counter()
            metrics["resharding/ranges_verified"] = float(verify_transfer(
                self.plan, self.rank, sources, destinations, group=self.group, dtypes=self.dtypes))
            metrics["timing/resharding_fingerprint"] = time.perf_counter() - started
        if self.inference_model is not None:
            self.inference_model.mark_weights_loaded()
        return metrics

    def states_needed(self) -> frozenset[str]:
        return frozenset()  # the switch row: the train params it reads

    def host_tensors(self) -> list[torch.Tensor]:
        return []

    def close(self) -> None:
        if self.group is not None and hasattr(self.group, "barrier"):
            self.group.barrier()  # the bridge's store lives on training rank 0: leave together
        self.group = None


def colocated_push(*, actor, inference_model, train: TrainLayout, infer: InferLayout, rank: int, world_size: int,
                   bucket_bytes: int, check_weights: bool) -> PlannedPush:
    """The push between the engines of the same ranks (collective over the world, at construction too)."""
    plan = build_plan(actor.spec, train, infer, world_size)
    return PlannedPush(plan, rank=rank, bucket_bytes=bucket_bytes,
                       dtypes=all_stage_dtypes(inference_model.named_weights(), infer),
                       read_sources=actor.named_weights, inference_model=inference_model, check_weights=check_weights)


def bridge_push(*, spec, train: TrainLayout, infer: InferLayout, train_world_size: int, infer_world_size: int,
                bridge_rank: int, dtypes: Mapping[str, torch.dtype], read_sources, inference_model, host: str,
                port: int, timeout_seconds: float, backend: str, bucket_bytes: int,
                check_weights: bool) -> PlannedPush:
    """Join the bridge as `bridge_rank` (training ranks first, then inference ranks) and plan between the two
    rank sets: every copy crosses the bridge, and each inference rank receives exactly its shard."""
    bridge = join_bridge(host=host, port=port, bridge_rank=bridge_rank, size=train_world_size + infer_world_size,
                         timeout_seconds=timeout_seconds, backend=backend)
    plan = build_plan(spec, train, infer, train_world_size, infer_world_size=infer_world_size)
    return PlannedPush(plan, rank=bridge_rank, bucket_bytes=bucket_bytes, dtypes=dtypes, read_sources=read_sources,
                       inference_model=inference_model, check_weights=check_weights, group=bridge)


def join_bridge(*, host: str, port: int, bridge_rank: int, size: int, timeout_seconds: float, backend: str):
    """The bridge's group over every training and inference rank (training ranks first)."""
    from mindspeed_rl.resharding.bridge import BridgeGroup

    return BridgeGroup(host=host, port=port, rank=bridge_rank, size=size, timeout_seconds=timeout_seconds,
                       backend=backend)


def all_stage_dtypes(destinations, infer: InferLayout) -> dict:
    """The wire dtype of every inference parameter. With inference PP a rank holds only its stage's
    parameters but sends ranges for every stage's, so the stages' names are gathered once (a
    collective over all ranks, at construction)."""
    dtypes = destination_dtypes(destinations)
    if infer.pp == 1:
        return dtypes
    import torch.distributed as dist

    gathered: list = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, dtypes)
    return {name: dtype for stage in gathered for name, dtype in stage.items()}


def check_and_clear_padding(plan: Plan, rank: int, destinations) -> None:
    """The live vLLM shapes must be the layout's; padding rows never receive data, so zero them once."""
    for key, local in plan.infer_tensors[rank].items():
        try:
            target = tensor_view(destinations, key)
        except (KeyError, IndexError):
            raise ValueError(f"vLLM has no parameter {key} that the resharding layout expects") from None
        if tuple(target.shape) != local.shape:
            raise ValueError(f"vLLM parameter {key}: live shape {tuple(target.shape)}, "
                             f"resharding layout expects {local.shape}")
        for start, length in uncovered_ranges(local):
            target.narrow(local.dim, start, length).zero_()
