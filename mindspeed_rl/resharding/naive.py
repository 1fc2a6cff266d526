"""The baseline every peer uses: gather every full tensor on every rank, then cut and load.

Kept for the benchmark (side by side with the planned transfer) and as the test oracle's loader:
`load_full_hf` cuts full HF tensors the way vLLM cuts them, straight from the layout description.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from mindspeed_rl.models.qwen2 import Qwen2Spec
from mindspeed_rl.models.layouts import LocalTensor, hf_from_megatron_shards, tensor_view, vllm_layout

if TYPE_CHECKING:
    from mindspeed_rl.parallel.megatron_state import RankGroups


def materialize(local: LocalTensor, hf: dict[str, torch.Tensor], dtype: torch.dtype) -> torch.Tensor:
    """The local tensor cut from full HF tensors; padding is zero."""
    out = torch.zeros(local.shape, dtype=dtype)
    for seg in local.segments:
        out.narrow(local.dim, seg.local_start, seg.length).copy_(hf[seg.hf_name].narrow(local.dim, seg.hf_start, seg.length))
    return out


@torch.no_grad()
def load_full_hf(destinations: dict[str, torch.Tensor], hf: dict[str, torch.Tensor], spec: Qwen2Spec, *,
                 tp: int, tp_rank: int, **moe) -> None:
    """Write this rank's vLLM shards, cut from full HF tensors, into the live parameters.
    `moe`: vllm_layout's dp / dp_rank / expert_parallel."""
    for local in vllm_layout(spec, tp=tp, tp_rank=tp_rank, **moe):
        target = tensor_view(destinations, local.key)
        if tuple(target.shape) != local.shape:
            raise ValueError(f"vLLM parameter {local.key} has shape {tuple(target.shape)}, layout says {local.shape}")
        target.zero_()
        for seg in local.segments:
            target.narrow(local.dim, seg.local_start, seg.length).copy_(
                hf[seg.hf_name].narrow(local.dim, seg.hf_start, seg.length))


@torch.no_grad()
def gather_full_hf(params: dict[str, torch.Tensor], spec: Qwen2Spec, *,
                   parallel: RankGroups) -> tuple[dict[str, torch.Tensor], int]:
    """Full HF tensors of every layer on every rank: all-gather over `parallel`'s TP group (this rank's place in the
    training layout, the caller's), then broadcast each pipeline stage over PP. Returns the tensors and the bytes
    this rank received."""
    tp, pp = parallel.tp, parallel.pp
    received = 0
    if tp == 1:
        shards = [params]
    else:
        shards = [dict() for _ in range(tp)]
        for name, tensor in params.items():
            gathered = [torch.empty_like(tensor) for _ in range(tp)]
            dist.all_gather(gathered, tensor.contiguous(), group=parallel.tp_group)
            received += (tp - 1) * tensor.numel() * tensor.element_size()
            for rank, piece in enumerate(gathered):
                shards[rank][name] = piece
    pp_rank = parallel.pp_rank
    stage = hf_from_megatron_shards(shards, spec, pp_rank=pp_rank, pp=pp)
    if pp == 1:
        return stage, received
    full: dict[str, torch.Tensor] = {}
    group = parallel.pp_group
    ranks = dist.get_process_group_ranks(group)
    for owner in range(pp):
        names = _stage_hf_names(spec, owner, pp)
        for name in names:
            tensor = stage[name] if owner == pp_rank else torch.empty(_hf_shape(spec, name), dtype=next(iter(params.values())).dtype)
            dist.broadcast(tensor, src=ranks[owner], group=group)
            if owner != pp_rank:
                received += tensor.numel() * tensor.element_size()
            full[name] = tensor
    return full, received


def _stage_hf_names(spec: Qwen2Spec, pp_rank: int, pp: int) -> list[str]:
    # every rank must broadcast the same names in the same order
    from mindspeed_rl.models.layouts import megatron_layout

    return sorted({seg.hf_name for t in megatron_layout(spec, tp=1, tp_rank=0, pp=pp, pp_rank=pp_rank) for seg in t.segments
                   if not (t.name == "output_layer.weight" and spec.tie_word_embeddings)})


def _hf_shape(spec: Qwen2Spec, name: str) -> tuple[int, ...]:
    from mindspeed_rl.models.layouts import hf_shapes

    return hf_shapes(spec)[name]
