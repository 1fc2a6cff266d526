"""One small interface over cpu (gloo), cuda (nccl) and npu (hccl, torch_npu)."""
from __future__ import annotations

import contextlib
import functools
import importlib.util
from dataclasses import dataclass

import torch

from mindspeed_rl.accelerator.host_memory import huge_page_storage, last_level_cache_bytes


@dataclass(frozen=True)
class Accelerator:
    name: str  # "cpu" | "cuda" | "npu"

    @property
    def device(self) -> torch.device:
        if self.name == "cpu":
            return torch.device("cpu")
        return torch.device(self.name, self._module().current_device())

    @property
    def distributed_backend(self) -> str:
        return {"cpu": "gloo", "cuda": "nccl", "npu": "hccl"}[self.name]

    @property
    def supports_pinned_memory(self) -> bool:
        return self.name != "cpu"

    @property
    def is_host(self) -> bool:
        """True when 'device' memory is host memory: offload then moves bytes within RAM."""
        return self.name == "cpu"

    @property
    def chunk_bytes_in_cache(self) -> int | None:
        """The size of a chunk of fp32 work that several elementwise passes read in turn (the log-softmax over a
        vocabulary shard): on a host a quarter of the last-level cache, so that every pass but the first reads
        it from cache (log-probs 2-4x faster than in chunks of 1024 rows of 32768: benchmarks/bench_logprob_chunks.py);
        None on a device, whose kernels stream from its memory at any chunk size and prefer fewer launches."""
        return last_level_cache_bytes() // 4 if self.is_host else None

    def _module(self):
        if self.name == "cuda":
            return torch.cuda
        if self.name == "npu":
            import torch_npu  # noqa: F401  (registers torch.npu)

            return torch.npu
        raise AssertionError("the cpu accelerator has no device module")

    def set_device(self, local_rank: int) -> None:
        if self.name != "cpu":
            self._module().set_device(local_rank)

    def synchronize(self) -> None:
        if self.name != "cpu":
            self._module().synchronize()

    def copy_stream(self):
        """A stream beside the compute stream, for copies that overlap compute (the swap optimizer's next bucket);
        None on cpu, where a copy is the cores' own work and there is no copy engine to overlap it with."""
        return None if self.is_host else self._module().Stream()

    def after_current_work(self, stream) -> contextlib.AbstractContextManager:
        """Work enqueued inside runs on `stream`, after what the current stream has enqueued so far (nothing
        changes on cpu, or with stream None)."""
        if stream is None:
            return contextlib.nullcontext()
        stream.wait_stream(self._module().current_stream())
        return self._module().stream(stream)

    def wait_for(self, stream) -> None:
        """The current stream's later work waits for what `stream` has enqueued so far (None: nothing to wait for)."""
        if stream is not None:
            self._module().current_stream().wait_stream(stream)

    def empty_cache(self) -> None:
        if self.name != "cpu":
            self._module().empty_cache()

    def memory_allocated_bytes(self) -> int | None:
        """The allocator's own count, to cross-check the ledger; None where no allocator exists."""
        if self.name == "cpu":
            return None
        return int(self._module().memory_allocated())

    def max_memory_allocated_bytes(self) -> int | None:
        if self.name == "cpu":
            return None
        return int(self._module().max_memory_allocated())

    def limit_memory(self, capacity_bytes: int) -> None:
        """Cap the device allocator at `capacity_bytes` (runtime.device_memory_limit); on cpu the memory ledger
        enforces the capacity instead (memory/capacity.py)."""
        if self.name != "cpu":
            module = self._module()
            total = module.get_device_properties(module.current_device()).total_memory
            module.set_per_process_memory_fraction(min(1.0, capacity_bytes / total))

    def host_buffer(self, nbytes: int) -> torch.UntypedStorage:
        """A host mirror for offloading; pinned where the device can DMA from it, huge pages on CPU."""
        if self.is_host:
            return huge_page_storage(nbytes)
        return torch.empty(nbytes, dtype=torch.uint8, device="cpu", pin_memory=True).untyped_storage()

    def release_storage(self, storage: torch.UntypedStorage) -> None:
        """Free a storage's device memory in place: every tensor viewing it stays bound to it.

        On a device the storage goes back to the caching allocator (`resize_(0)`). On CPU its memory
        is swapped out into a temporary that dies at once, which also frees storages torch cannot
        resize (our huge-page mappings); either way the storage then has 0 bytes.
        """
        if self.is_host:
            storage._swap_data_ptr_(torch.UntypedStorage(0))
        else:
            storage.resize_(0)

    def acquire_storage(self, storage: torch.UntypedStorage, nbytes: int, *, zeroed: bool = False) -> None:
        """Give a released storage `nbytes` of fresh device memory: zeros with `zeroed`, else undefined."""
        assert storage.nbytes() == 0, "only a released storage is re-acquired"
        if self.is_host:
            storage._swap_data_ptr_(huge_page_storage(nbytes, zeroed=zeroed))
        else:
            storage.resize_(nbytes)
            if zeroed:
                storage.fill_(0)

    def megatron_context(self) -> contextlib.AbstractContextManager:
        """Megatron-core assumes CUDA; on CPU its calls run inside the compatibility layer.

        The layer is scoped (entered per call, not installed process-wide) because the vLLM
        engine living in the same process must keep seeing the real `torch.cuda`.
        """
        if self.name == "cpu":
            from mindspeed_rl.accelerator.megatron_cpu import megatron_on_cpu

            return megatron_on_cpu()
        return contextlib.nullcontext()

    def resolve_kernels(self, request):
        """The fused kernels of a `KernelRequest` this device can run (TransformerConfig fields) and
        the ones it cannot (see `accelerator/kernels.py`)."""
        from mindspeed_rl.accelerator.kernels import resolve_kernels

        return resolve_kernels(request, self.name)

    def varlen_causal_attention(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, *,
                                cu_seqlens: torch.Tensor, max_seqlen: int, scale: float) -> torch.Tensor:
        """Causal attention of packed samples, THD ([t, heads, head_dim]); see accelerator/varlen_attention.py."""
        from mindspeed_rl.accelerator.varlen_attention import varlen_causal_attention

        return varlen_causal_attention(self.name, query, key, value, cu_seqlens=cu_seqlens, max_seqlen=max_seqlen,
                                       scale=scale)

    def seed_model_parallel_rng(self, seed: int) -> None:
        if self.name == "cpu":
            from mindspeed_rl.accelerator.megatron_cpu import model_parallel_cpu_manual_seed

            model_parallel_cpu_manual_seed(seed)
        else:
            from megatron.core import tensor_parallel

            tensor_parallel.model_parallel_cuda_manual_seed(seed)


def detect_device() -> str:
    """The best device on this machine: npu if torch_npu is importable, then cuda, else cpu."""
    if importlib.util.find_spec("torch_npu") is not None:
        return "npu"
    if torch.cuda.is_available():
        return "cuda"
    return "cpu"


def missing_device(name: str) -> str | None:
    """Why `name` cannot run on this host, or None if it can (cpu and auto always can)."""
    if name == "cuda" and not torch.cuda.is_available():
        return f"no CUDA device is visible to torch {torch.__version__} (torch.cuda.is_available() is False)"
    if name == "npu":
        if importlib.util.find_spec("torch_npu") is None:
            return "torch_npu is not installed, so no Ascend NPU can be used"
        import torch_npu  # noqa: F401  (registers torch.npu)

        if not torch.npu.is_available():
            return "torch_npu is installed but sees no NPU (torch.npu.is_available() is False)"
    return None


@functools.lru_cache(maxsize=None)
def get_accelerator(name: str = "auto") -> Accelerator:
    if name == "auto":
        name = detect_device()
    if name not in ("cpu", "cuda", "npu"):
        raise ValueError(f"runtime.device: expected one of auto, cpu, cuda, npu, got {name!r}")
    return Accelerator(name=name)

