"""LoRA's switch: only the adapters move between ranks (`WeightPush`, colocated or over the bridge).

The first push sends the frozen backbone through the full plan (as a full-parameter switch does) and each inference
rank keeps its weights, so pushed, on the host. Every push then restores them from there and adds, to each adapted
weight, `(alpha/r) B A` of the rank's own rows or columns, from the slices of A and B the adapter plan
(resharding/adapter_plan.py) brings: the bytes between ranks are the adapters' share, not the model's. The result
equals the merged weights pushed whole (`MergedWeights` through the full plan) up to the order of the fp32 sums.

Colocated, the same ranks send and receive; disaggregated (`bridge_adapter_push`), training ranks send over the
bridge and hold no inference weights, inference ranks receive and hold no training shards.
"""
from __future__ import annotations

import time
from typing import Callable, Mapping

import torch

from mindspeed_rl.memory.residency import FIRST_ADAPTER_PUSH_READS
from mindspeed_rl.resharding.adapter_plan import adapted_weight, build_adapter_plan
from mindspeed_rl.resharding.fingerprint import verify_transfer
from mindspeed_rl.resharding.plan import InferLayout, TrainLayout, build_plan
from mindspeed_rl.resharding.transfer import Transfer, itemsize, parameter_name
from mindspeed_rl.resharding.weight_push import PlannedPush, all_stage_dtypes, join_bridge

ReadTensors = Callable[[], dict[str, torch.Tensor]]


class AdapterPush:
    """One rank's end of a LoRA actor's push. `read_backbone` / `read_adapters` give this rank's training shards
    (None: it has none, an inference rank of a disaggregated actor); `inference_model` the engine the weights land
    in (None: a training rank of a disaggregated actor). `lora`: models/lora.LoRASettings (rank, scale, targets)."""

    def __init__(self, *, spec, lora, train: TrainLayout, infer: InferLayout, rank: int, world_size: int,
                 infer_world_size: int | None = None, group=None, dtypes: Mapping[str, torch.dtype],
                 adapter_dtype: torch.dtype, read_backbone: ReadTensors | None, read_adapters: ReadTensors | None,
                 inference_model, bucket_bytes: int, check_weights: bool):
        self.inference_model, self.rank, self.scale, self.group = inference_model, rank, lora.scale, group
        self.read_adapters, self.dtype, self.check_weights = read_adapters, adapter_dtype, check_weights
        self.base_push = PlannedPush(build_plan(spec, train, infer, world_size, infer_world_size=infer_world_size),
                                     rank=rank, bucket_bytes=bucket_bytes, dtypes=dtypes, read_sources=read_backbone,
                                     inference_model=inference_model, check_weights=check_weights, group=group)
        self.plan = build_adapter_plan(spec, train, infer, world_size, rank=lora.rank,
                                       target_modules=lora.target_modules, infer_world_size=infer_world_size)
        self.transfer = Transfer(self.plan, rank=rank, bucket_bytes=bucket_bytes, dtype=adapter_dtype, group=group)
        self.planned_bytes_received = sum(c.numel for c in self.plan.copies_to(rank)
                                          if c.src_rank != rank) * itemsize(adapter_dtype)
        # Every inference rank's slices, by name: a sending rank fingerprints in its receivers' dtype.
        self.slice_dtypes = {parameter_name(key): adapter_dtype for slices in self.plan.infer_tensors.values()
                             for key in slices}
        self.backbone_pushed = False
        self.base_on_host: dict[str, torch.Tensor] = {}

    @torch.no_grad()
    def push(self) -> dict[str, float]:
        metrics = {"resharding/full_push_planned_bytes_received": float(self.base_push.planned_bytes_received)}
        weights = self.inference_model.named_weights() if self.inference_model is not None else {}
        started = time.perf_counter()
        self._backbone_into_place(weights, metrics)
        metrics["timing/resharding_restore_backbone"] = time.perf_counter() - started
        sources = self.read_adapters() if self.read_adapters is not None else {}
        device = next(iter((sources or weights).values())).device
        slices = {key: torch.empty(local.shape, dtype=self.dtype, device=device)
                  for key, local in self.plan.infer_tensors.get(self.rank, {}).items()}
        metrics |= self.transfer.run(sources, slices).as_metrics()
        metrics["resharding/planned_bytes_received"] = float(self.planned_bytes_received)
        if self.check_weights:
            started = time.perf_counter()
            metrics["resharding/ranges_verified"] = float(verify_transfer(
                self.plan, self.rank, sources, slices, group=self.group, dtypes=self.slice_dtypes))
            metrics["timing/resharding_fingerprint"] = time.perf_counter() - started
        if self.inference_model is not None:
            self._add_deltas(weights, slices)
        return metrics

    def _backbone_into_place(self, weights: dict[str, torch.Tensor], metrics: dict[str, float]) -> None:
        """Once, the backbone through the full plan (an inference rank then keeps its `weights` on the host); after,
        an inference rank restores them from there (a training rank has no `weights`)."""
        if not self.backbone_pushed:
            metrics["resharding/backbone_bytes_received"] = self.base_push.push()["resharding/bytes_received"]
            self.backbone_pushed = True
            self.base_on_host = {name: tensor.to("cpu", copy=True) for name, tensor in weights.items()}
        else:
            for name, tensor in weights.items():
                tensor.copy_(self.base_on_host[name])

    def _add_deltas(self, weights: dict[str, torch.Tensor], slices: dict[str, torch.Tensor]) -> None:
        for key, b in slices.items():
            if key.endswith(".lora_B"):
                weight = weights[adapted_weight(key)]
                delta = b.float() @ slices[key.removesuffix("lora_B") + "lora_A"].float()
                weight.add_((self.scale * delta).to(weight.dtype))
        self.inference_model.mark_weights_loaded()

    def states_needed(self) -> frozenset[str]:
        """The first push reads the backbone (then kept on the host as vLLM's layout); later ones the adapters only,
        which the residency table's switch row holds (`adapter_only_switch`)."""
        return FIRST_ADAPTER_PUSH_READS if not self.backbone_pushed else frozenset()

    def host_tensors(self) -> list[torch.Tensor]:
        """The backbone's inference weights as first pushed (empty before the first push and on a training rank)."""
        return list(self.base_on_host.values())

    def close(self) -> None:
        self.base_push.close()


def split_lora_params(actor) -> tuple[ReadTensors, ReadTensors]:
    """(backbone, adapters): readers of a LoRA actor's parameters, each by its Megatron name."""
    from mindspeed_rl.models.lora import is_lora_param

    def read(adapters: bool) -> dict[str, torch.Tensor]:
        return {n: p.data for n, p in actor.module.named_parameters() if is_lora_param(n) == adapters}

    return (lambda: read(False)), (lambda: read(True))


def colocated_adapter_push(*, actor, inference_model, train: TrainLayout, infer: InferLayout, rank: int,
                           world_size: int, bucket_bytes: int, check_weights: bool) -> AdapterPush:
    """The push of a LoRA actor into the vLLM engine of the same ranks (collective over the world)."""
    read_backbone, read_adapters = split_lora_params(actor)
    return AdapterPush(spec=actor.spec, lora=actor.lora, train=train, infer=infer, rank=rank, world_size=world_size,
                       dtypes=all_stage_dtypes(inference_model.named_weights(), infer),
                       adapter_dtype=next(iter(read_adapters().values())).dtype, read_backbone=read_backbone,
                       read_adapters=read_adapters, inference_model=inference_model, bucket_bytes=bucket_bytes,
                       check_weights=check_weights)


def bridge_adapter_push(*, spec, lora, train: TrainLayout, infer: InferLayout, train_world_size: int,
                        infer_world_size: int, bridge_rank: int, dtypes: Mapping[str, torch.dtype],
                        adapter_dtype: torch.dtype, actor, inference_model, host: str, port: int,
                        timeout_seconds: float, backend: str, bucket_bytes: int, check_weights: bool) -> AdapterPush:
    """Join the bridge as `bridge_rank` (training ranks first, then inference ranks): a training rank (`actor`)
    sends its backbone once and its adapters every push, an inference rank (`inference_model`) receives them."""
    bridge = join_bridge(host=host, port=port, bridge_rank=bridge_rank, size=train_world_size + infer_world_size,
                         timeout_seconds=timeout_seconds, backend=backend)
    read_backbone, read_adapters = split_lora_params(actor) if actor is not None else (None, None)
    return AdapterPush(spec=spec, lora=lora, train=train, infer=infer, rank=bridge_rank, world_size=train_world_size,
                       infer_world_size=infer_world_size, group=bridge, dtypes=dtypes, adapter_dtype=adapter_dtype,
                       read_backbone=read_backbone, read_adapters=read_adapters, inference_model=inference_model,
                       bucket_bytes=bucket_bytes, check_weights=check_weights)


def colocated_push_of(actor, **plan):
    """The push of `actor` into the vLLM of the same ranks: the adapters only with LoRA, else every weight through
    the plan (resharding/weight_push.py)."""
    from mindspeed_rl.resharding.weight_push import colocated_push

    return (colocated_push if actor.lora is None else colocated_adapter_push)(actor=actor, **plan)


def bridge_push_of(*, lora, actor, adapter_dtype, **bridge):
    """This rank's end of the push over the bridge: LoRA's adapters only (`lora` settings), else every weight; a
    training rank gives its `actor`, an inference rank None."""
    from mindspeed_rl.resharding.weight_push import bridge_push

    if lora is None:
        return bridge_push(read_sources=actor.named_weights if actor is not None else None, **bridge)
    return bridge_adapter_push(lora=lora, adapter_dtype=adapter_dtype, actor=actor, **bridge)

