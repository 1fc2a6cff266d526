"""Megatron-core on CPU: the patches megatron-core 0.16 needs there, each found by running it on CPU.

Megatron-core 0.16 assumes CUDA in its RNG tracker, its device lookups and a few factory calls.
Each patch below carries the reason it exists. The RNG tracker is Megatron-internal state and is
installed once; the `torch.cuda` rebinding and the CUDA->CPU factories are scoped to
`megatron_on_cpu()` so that vLLM, living in the same process, never sees a fake `torch.cuda`.
"""
from __future__ import annotations

import contextlib
from typing import Iterator

import torch

from megatron.core import parallel_state
from megatron.core.tensor_parallel import random as mrandom


class CPURNGStatesTracker(mrandom.CudaRNGStatesTracker):
    """P1: megatron seeds and forks `torch.cuda` generators; here the CPU generator plays that role."""

    def add(self, name: str, seed: int) -> None:
        self._is_initialized = True
        if seed in self.seeds_:
            raise Exception(f"seed {seed} already exists")
        if name in self.states_:
            raise Exception(f"rng state {name} already exists")
        self.seeds_.add(seed)
        outer_state = torch.get_rng_state()
        torch.manual_seed(seed)
        self.states_[name] = torch.get_rng_state()
        torch.set_rng_state(outer_state)

    @contextlib.contextmanager
    def fork(self, name: str = mrandom._MODEL_PARALLEL_RNG_TRACKER_NAME) -> Iterator[None]:
        # Same contract as megatron's fork minus its "CPU RNG state changed" warning, which on CPU
        # fires on every dropout because the forked generator *is* the CPU generator.
        if name not in self.states_:
            raise Exception(f"rng state {name} is not added")
        outer_state = torch.get_rng_state()
        torch.set_rng_state(self.states_[name])
        try:
            yield
        finally:
            self.states_[name] = torch.get_rng_state()
            torch.set_rng_state(outer_state)


def model_parallel_cpu_manual_seed(seed: int) -> None:
    """P1: megatron's `model_parallel_cuda_manual_seed` with the same per-rank seed offsets."""
    tracker = CPURNGStatesTracker()
    mrandom._CUDA_RNG_STATE_TRACKER = tracker
    mrandom._CUDA_RNG_STATE_TRACKER_INITIALIZED = True
    tp_rank = parallel_state.get_tensor_model_parallel_rank()
    ep_rank = parallel_state.get_expert_model_parallel_rank()
    etp_rank = parallel_state.get_expert_tensor_parallel_rank()
    torch.manual_seed(seed)
    tracker.add(mrandom._DATA_PARALLEL_RNG_TRACKER_NAME, seed)
    tracker.add(mrandom._MODEL_PARALLEL_RNG_TRACKER_NAME, seed + 2718 + tp_rank)
    tracker.add(mrandom._EXPERT_PARALLEL_RNG_TRACKER_NAME, seed + 1024 + 100 * ep_rank + etp_rank)
    # P1 (recompute): activation checkpointing saves and restores the "cuda" RNG state.
    mrandom._get_cuda_rng_state = lambda *args, **kwargs: torch.get_rng_state()
    mrandom._set_cuda_rng_state = lambda state, *args, **kwargs: torch.set_rng_state(state)


def _is_cuda_device(device: object) -> bool:
    if isinstance(device, torch.device):
        return device.type == "cuda"
    if isinstance(device, str):
        return device.startswith("cuda")
    return False


# P3/P4: the torch factories megatron calls with device="cuda" (causal mask, loss scale, found-inf flags,
# PP schedule token counts, clip_grads, dist-checkpointing exchanges). Only these are wrapped: a
# TorchFunctionMode would put every torch call of the forward, backward and optimizer through Python
# (measured at 2-10 us per call, 5-20% of a micro-batch at the demo's size; docs/overhead.md item 4).
_FACTORIES = ("tensor", "zeros", "ones", "empty", "full", "arange", "rand", "randn", "randint", "empty_like",
              "zeros_like", "ones_like", "full_like")


def _on_cpu(factory):
    def factory_on_cpu(*args, **kwargs):
        if _is_cuda_device(kwargs.get("device")):
            kwargs["device"] = "cpu"
        # P7: RoPE under context parallelism builds its chunk indices in pinned memory for a non-blocking copy to
        # the GPU; a CPU-only torch has no pinned allocator, and the tensor stays where it is anyway.
        if kwargs.get("pin_memory"):
            kwargs["pin_memory"] = False
        return factory(*args, **kwargs)

    factory_on_cpu.__wrapped__ = factory
    return factory_on_cpu


def _tensor_cuda(self, *args, **kwargs):
    """P4: `Tensor.cuda()` (tied-embedding sync with PP, optimizer state loads) keeps the tensor on cpu."""
    return self


def _tensor_to(self, *args, **kwargs):
    if args and _is_cuda_device(args[0]):
        args = ("cpu", *args[1:])
    if _is_cuda_device(kwargs.get("device")):
        kwargs["device"] = "cpu"
    return _ORIGINAL_TO(self, *args, **kwargs)


def _tensor_type(self, *args, **kwargs):
    """P4: clip_grads asserts `grad.type() == 'torch.cuda.FloatTensor'`; asked without arguments, a cpu tensor
    names its cuda type. With arguments (a cast) it is torch's own `type`."""
    name = _ORIGINAL_TYPE(self, *args, **kwargs)
    if args or kwargs or ".cuda." in name:
        return name
    return name.replace("torch.", "torch.cuda.", 1)


_ORIGINAL_TO = torch.Tensor.to
_ORIGINAL_TYPE = torch.Tensor.type


@contextlib.contextmanager
def cuda_factories_on_cpu() -> Iterator[None]:
    """P3/P4 inside the scope: the factories above, `Tensor.cuda`, `Tensor.to("cuda")` and `Tensor.type()`
    mean cpu. The functions are module attributes, rebound for the scope and restored after it."""
    saved_factories = {name: getattr(torch, name) for name in _FACTORIES}
    for name, factory in saved_factories.items():
        setattr(torch, name, _on_cpu(factory))
    torch.Tensor.cuda, torch.Tensor.to, torch.Tensor.type = _tensor_cuda, _tensor_to, _tensor_type
    try:
        yield
    finally:
        for name, factory in saved_factories.items():
            setattr(torch, name, factory)
        # The class attributes were inherited from torch._C.TensorBase: deleting them restores torch's own.
        del torch.Tensor.cuda, torch.Tensor.to, torch.Tensor.type


_scope_depth = 0


@contextlib.contextmanager
def megatron_on_cpu() -> Iterator[None]:
    """P2: ~40 megatron call sites pass `torch.cuda.current_device()` as a device; it must be cpu.

    `torch.cuda.synchronize` becomes a no-op because there is no stream to wait for.
    Re-entrant: nested uses leave the outer patch in place.
    """
    global _scope_depth
    patch_moe_without_transformer_engine()  # idempotent; a module global, invisible to vLLM
    if _scope_depth:
        _scope_depth += 1
        try:
            yield
        finally:
            _scope_depth -= 1
        return
    saved = (torch.cuda.current_device, torch.cuda.synchronize, torch.cuda.Stream, torch.cuda.current_stream,
             torch.cuda.stream)
    torch.cuda.current_device = lambda: torch.device("cpu")
    torch.cuda.synchronize = lambda *args, **kwargs: None
    # P6: the alltoall MoE dispatcher (packed micro-batches under pipeline parallelism) copies its split sizes to
    # the host on a side stream; on CPU every stream is the one stream, and its events are already complete.
    torch.cuda.Stream = lambda *args, **kwargs: _ONE_STREAM
    torch.cuda.current_stream = lambda *args, **kwargs: _ONE_STREAM
    torch.cuda.stream = lambda *args, **kwargs: contextlib.nullcontext()
    _scope_depth = 1
    try:
        with cuda_factories_on_cpu():
            yield
    finally:
        _scope_depth = 0
        (torch.cuda.current_device, torch.cuda.synchronize, torch.cuda.Stream, torch.cuda.current_stream,
         torch.cuda.stream) = saved


class _CpuStream:
    """The one stream of a CPU process: waits are no-ops, events are complete."""

    def wait_stream(self, _other) -> None:
        pass

    def record_event(self, _event=None):
        return self

    def synchronize(self) -> None:
        pass


_ONE_STREAM = _CpuStream()


def patch_moe_without_transformer_engine() -> None:
    """P5: megatron's router GEMM reads `moe_utils.te_general_gemm`, which is only bound when
    TransformerEngine imports (NameError at moe_utils.py:1192 otherwise); None means "no TE". And P8."""
    from megatron.core.transformer.moe import moe_utils

    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None
    _patch_uneven_all_gather()


def _patch_uneven_all_gather() -> None:
    """P8: with expert TP > 1 the alltoall MoE dispatcher all-gathers each rank's tokens over the TP group in uneven
    parts (`output_split_sizes`; packed micro-batches under PP use that dispatcher), which gloo refuses ("invalid
    tensor size"). Over gloo each part is padded to the largest, gathered evenly and cut back: the same tensor.
    The backward's uneven reduce-scatter works on gloo as it is. Other backends keep Megatron's function."""
    from megatron.core.tensor_parallel import mappings

    original = mappings._gather_along_first_dim
    if getattr(original, "pads_uneven_parts", False):
        return

    def gather_along_first_dim(input_, group, output_split_sizes=None, use_global_buffer=False):
        if output_split_sizes is None or group.size() == 1 or torch.distributed.get_backend(group) != "gloo":
            return original(input_, group, output_split_sizes, use_global_buffer)
        largest = max(output_split_sizes)
        padded = torch.nn.functional.pad(input_.contiguous(), (0, 0) * (input_.dim() - 1) + (0, largest - len(input_)))
        parts = [torch.empty_like(padded) for _ in output_split_sizes]
        torch.distributed.all_gather(parts, padded, group=group)
        return torch.cat([part[:size] for part, size in zip(parts, output_split_sizes)])

    gather_along_first_dim.pads_uneven_parts = True
    mappings._gather_along_first_dim = gather_along_first_dim


class SequenceParallelRMSNorm:
    """P6: the local spec's WrappedTorchNorm asserts `not sequence_parallel`, yet megatron requires
    sequence parallel for MoE with TP > 1. A torch RMSNorm whose weight is marked
    `sequence_parallel`, so finalize_model_grads all-reduces its grad over TP as for TE norms."""

    def __new__(cls, config, hidden_size: int, eps: float = 1e-5, **_unused):
        norm = torch.nn.RMSNorm(normalized_shape=hidden_size, eps=eps)
        norm.weight.sequence_parallel = bool(config.sequence_parallel)
        return norm


def with_sequence_parallel_norms(layer_spec, num_layers: int):
    """P6: the block spec of `num_layers` layers whose norms (layer, q/k, final) are SP-capable."""
    from megatron.core.transformer.transformer_block import TransformerBlockSubmodules

    spec = sequence_parallel_layer_spec(layer_spec)
    return TransformerBlockSubmodules(layer_specs=[spec] * num_layers, layer_norm=SequenceParallelRMSNorm)


def sequence_parallel_layer_spec(layer_spec):
    """P6: a copy of one layer spec whose torch norms (layer, q/k, MLA's kv) are SP-capable."""
    import copy

    from megatron.core.transformer.torch_norm import WrappedTorchNorm

    spec = copy.deepcopy(layer_spec)
    layer = spec.submodules
    for name in ("input_layernorm", "pre_mlp_layernorm"):
        if getattr(layer, name) is WrappedTorchNorm:
            setattr(layer, name, SequenceParallelRMSNorm)
    attention = layer.self_attention.submodules
    for name in ("q_layernorm", "k_layernorm", "kv_layernorm"):
        if getattr(attention, name, None) is WrappedTorchNorm:
            setattr(attention, name, SequenceParallelRMSNorm)
    return spec
