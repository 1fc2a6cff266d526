"""Which tensors make up each offloadable category of a Megatron actor or reference model."""
from __future__ import annotations

from typing import Iterator

import torch

from mindspeed_rl.memory.residency import (ADAPTER_PARAMS, REF_PARAMS, TEACHER_PARAMS, TRAIN_GRADS, TRAIN_OPTIMIZER,
                                           TRAIN_PARAMS)


def param_tensors(module: torch.nn.Module) -> Iterator[torch.Tensor]:
    for param in module.parameters():
        yield param.data


def grad_buffer_tensors(ddp_model) -> Iterator[torch.Tensor]:
    """Megatron DDP keeps every main_grad as a view of a few contiguous grad buffers."""
    for buffer in list(ddp_model.buffers) + list(getattr(ddp_model, "expert_parallel_buffers", [])):
        yield buffer.grad_data


def _leaf_optimizers(optimizer) -> list:
    return list(getattr(optimizer, "chained_optimizers", [optimizer]))


def optimizer_state_tensors(optimizer) -> Iterator[torch.Tensor]:
    """Adam moments (and fp32 master copies for bf16 training); created lazily at the first step."""
    for leaf in _leaf_optimizers(optimizer):
        for state in leaf.optimizer.state.values():
            for key, value in state.items():
                # `step` is a scalar that torch keeps on the host unless the optimizer is capturable.
                if key != "step" and torch.is_tensor(value):
                    yield value
        # fp32 masters of bf16 params: whole tensors (Float16Optimizer), or this DP rank's shards
        # (DistributedOptimizer). Its fp32 "shards" of fp32 params are views of the params themselves.
        for attribute in ("fp32_from_float16_groups", "shard_fp32_from_float16_groups"):
            for group in getattr(leaf, attribute, []):
                for master in group:
                    yield master.data




def register_megatron_states(offloader, actor, reference=None, *, keep_grads: bool = False,
                             swap_optimizer_times: int | None = None) -> None:
    """The actor's params (with LoRA: the backbone's, and the adapters' as a group of their own), grads and
    optimizer states, and the reference model's params. `swap_optimizer_times`: the optimizer states are MindSpeed's
    swapped buckets (memory/swap_optimizer.py), stepped bucket by bucket.

    Grads are dropped by default (MindSpeed-RL does the same): the next step zeroes them before
    its backward, so copying them out would move bytes nobody reads. `keep_grads` copies them.
    """
    if getattr(actor, "lora", None) is None:
        offloader.register(TRAIN_PARAMS, lambda: param_tensors(actor.module))
    else:  # the frozen backbone and the adapters move apart: a LoRA switch needs the adapters only
        from mindspeed_rl.models.lora import is_lora_param

        offloader.register(TRAIN_PARAMS, lambda: (p.data for n, p in actor.module.named_parameters()
                                                  if not is_lora_param(n)))
        offloader.register(ADAPTER_PARAMS, lambda: (p.data for n, p in actor.module.named_parameters()
                                                    if is_lora_param(n)))
    offloader.register(TRAIN_GRADS, lambda: grad_buffer_tensors(actor.model), keep_contents=keep_grads)
    if swap_optimizer_times is None:
        offloader.register(TRAIN_OPTIMIZER, lambda: optimizer_state_tensors(actor.optimizer))
    else:
        from mindspeed_rl.memory.swap_optimizer import SwappedOptimizerStates

        offloader.add(SwappedOptimizerStates(actor.optimizer, offloader.accelerator, times=swap_optimizer_times))
    if reference is not None:
        register_reference_states(offloader, reference)


def register_reference_states(offloader, reference) -> None:
    """The reference model's params: its one state group."""
    offloader.register(REF_PARAMS, lambda: param_tensors(reference.module))


def register_teacher_states(offloader, teacher) -> None:
    """On-policy distillation's teacher params: its one state group."""
    offloader.register(TEACHER_PARAMS, lambda: param_tensors(teacher.module))
