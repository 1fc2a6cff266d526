"""LoRA's switch: only the adapters move between ranks (`WeightPush`, colocated).

The first push sends the frozen backbone through the full plan (as a full-parameter switch does) and keeps each
rank's inference weights on the host. Every push then restores them from there and adds, to each adapted weight,
`(alpha/r) B A` of the rank's own rows or columns, from the slices of A and B the adapter plan
(resharding/adapter_plan.py) brings: the bytes between ranks are the adapters' share, not the model's. The result
equals the merged weights pushed whole (`MergedWeights` through the full plan) up to the order of the fp32 sums.
"""
from __future__ import annotations

import time

import torch

from mindspeed_rl.memory.residency import FIRST_ADAPTER_PUSH_READS
from mindspeed_rl.resharding.adapter_plan import adapted_weight, build_adapter_plan
from mindspeed_rl.resharding.fingerprint import verify_transfer
from mindspeed_rl.resharding.plan import InferLayout, TrainLayout, build_plan
from mindspeed_rl.resharding.transfer import Transfer, itemsize
from mindspeed_rl.resharding.weight_push import PlannedPush, all_stage_dtypes


class AdapterPush:
    """The push of a LoRA actor into the vLLM engine of the same ranks."""

    def __init__(self, *, actor, inference_model, train: TrainLayout, infer: InferLayout, rank: int, world_size: int,
                 bucket_bytes: int, check_weights: bool):
        from mindspeed_rl.models.lora import is_lora_param

        lora = actor.lora
        self.actor, self.inference_model, self.rank, self.scale = actor, inference_model, rank, lora.scale
        self.check_weights = check_weights
        self._adapters = lambda: {n: p.data for n, p in actor.module.named_parameters() if is_lora_param(n)}
        backbone = lambda: {n: p.data for n, p in actor.module.named_parameters() if not is_lora_param(n)}  # noqa: E731
        self.base_push = PlannedPush(build_plan(actor.spec, train, infer, world_size), rank=rank,
                                     bucket_bytes=bucket_bytes,
                                     dtypes=all_stage_dtypes(inference_model.named_weights(), infer),
                                     read_sources=backbone, inference_model=inference_model,
                                     check_weights=check_weights)
        self.plan = build_adapter_plan(actor.spec, train, infer, world_size, rank=lora.rank,
                                       target_modules=lora.target_modules)
        self.dtype = next(iter(self._adapters().values())).dtype
        self.transfer = Transfer(self.plan, rank=rank, bucket_bytes=bucket_bytes, dtype=self.dtype)
        self.planned_bytes_received = sum(c.numel for c in self.plan.copies_to(rank)
                                          if c.src_rank != rank) * itemsize(self.dtype)
        self.base_on_host: dict[str, torch.Tensor] | None = None

    @torch.no_grad()
    def push(self) -> dict[str, float]:
        weights = self.inference_model.named_weights()
        metrics = {"resharding/full_push_planned_bytes_received": float(self.base_push.planned_bytes_received)}
        started = time.perf_counter()
        if self.base_on_host is None:  # once: the backbone, whole, then kept on the host
            metrics["resharding/backbone_bytes_received"] = self.base_push.push()["resharding/bytes_received"]
            self.base_on_host = {name: tensor.to("cpu", copy=True) for name, tensor in weights.items()}
        else:
            for name, tensor in weights.items():
                tensor.copy_(self.base_on_host[name])
        metrics["timing/resharding_restore_backbone"] = time.perf_counter() - started
        sources = self._adapters()
        slices = {key: torch.empty(local.shape, dtype=self.dtype, device=next(iter(weights.values())).device)
                  for key, local in self.plan.infer_tensors[self.rank].items()}
        metrics |= self.transfer.run(sources, slices).as_metrics()
        metrics["resharding/planned_bytes_received"] = float(self.planned_bytes_received)
        if self.check_weights:
            started = time.perf_counter()
            metrics["resharding/ranges_verified"] = float(verify_transfer(
                self.plan, self.rank, sources, slices, dtypes={key: self.dtype for key in slices}))
            metrics["timing/resharding_fingerprint"] = time.perf_counter() - started
        for key, b in slices.items():
            if key.endswith(".lora_B"):
                weight = weights[adapted_weight(key)]
                delta = b.float() @ slices[key.removesuffix("lora_B") + "lora_A"].float()
                weight.add_((self.scale * delta).to(weight.dtype))
        self.inference_model.mark_weights_loaded()
        return metrics

    def states_needed(self) -> frozenset[str]:
        """The first push reads the backbone (then kept on the host as vLLM's layout); later ones the adapters only,
        which the residency table's switch row holds (`adapter_only_switch`)."""
        return FIRST_ADAPTER_PUSH_READS if self.base_on_host is None else frozenset()

    def close(self) -> None:
        self.base_push.close()
