"""The inference engine's two offloadable states: its weights and its KV cache.

Default path (every platform): the weights are a storage group over vLLM's live parameters
(`VLLMEngine.named_weights()`), the KV cache is released and rebuilt by hand (storage resize).
Both keep tensor addresses stable only while vLLM runs eagerly; with CUDA graphs the captured
addresses must survive, which only vLLM's own sleep/wake (a CuMem pool that unmaps and remaps the
same virtual addresses) guarantees. So where the engine was built with `enable_sleep_mode`
(CUDA), `VllmSleepWake` drives both states through `llm.sleep` / `llm.wake_up` instead.
vLLM rejects sleep mode on CPU, so that path is not exercised on this machine.
"""
from __future__ import annotations

from typing import Iterable

import torch

from mindspeed_rl.accelerator import Accelerator
from mindspeed_rl.memory.offload import Offloader, StorageGroup
from mindspeed_rl.memory.residency import INFER_WEIGHTS, KV_CACHE



class KVCacheState:
    """The engine's KV cache; its contents are always dropped (a cache is rebuilt empty)."""

    name = KV_CACHE

    def __init__(self, engine):
        self.engine = engine

    @property
    def resident(self) -> bool:
        return self.engine.kv_cache_resident  # read live: the sharding manager also releases/rebuilds it

    def resident_bytes(self) -> int:
        return self.engine.kv_cache_bytes()

    def offload(self, *, keep_contents: bool | None = None) -> int:
        self.engine.release_kv_cache()
        return 0

    def reload(self) -> int:
        self.engine.rebuild_kv_cache()
        return 0


def sleep_mode_enabled(engine) -> bool:
    config = getattr(getattr(engine, "llm", None), "llm_engine", None)
    config = getattr(config, "vllm_config", None)
    return bool(config is not None and getattr(config.model_config, "enable_sleep_mode", False))


class VllmSleepWake:
    """Both inference states through vLLM's sleep/wake (CUDA with `enable_sleep_mode`).

    vLLM sleeps weights and KV together (level 1 backs the weights up to host memory, level 2
    drops them) and wakes them by tag, so one category alone is offloaded by sleeping both and
    waking the other.
    """

    TAGS = {INFER_WEIGHTS: "weights", KV_CACHE: "kv_cache"}

    def __init__(self, engine):
        self.engine = engine
        self.asleep: set[str] = set()
        self.weights_kept = True
        self.weight_bytes = sum(t.nbytes for t in engine.named_weights().values())

    def states(self) -> list["_SleepState"]:
        return [_SleepState(self, INFER_WEIGHTS), _SleepState(self, KV_CACHE)]

    def offload(self, category: str, keep_contents: bool) -> int:
        if category in self.asleep:
            return 0
        target = self.asleep | {category}
        keep_weights = keep_contents if category == INFER_WEIGHTS else (INFER_WEIGHTS not in target or self.weights_kept)
        llm = self.engine.llm
        if self.asleep:
            llm.wake_up()  # vLLM cannot sleep a subset: wake all, then sleep all
        llm.sleep(level=1 if keep_weights else 2)
        awake = [self.TAGS[c] for c in self.TAGS if c not in target]
        if awake:
            llm.wake_up(tags=awake)
        self.asleep, self.weights_kept = target, keep_weights
        return self.weight_bytes if category == INFER_WEIGHTS and keep_weights else 0

    def reload(self, category: str) -> int:
        if category not in self.asleep:
            return 0
        self.engine.llm.wake_up(tags=[self.TAGS[category]])
        self.asleep.discard(category)
        return self.weight_bytes if category == INFER_WEIGHTS and self.weights_kept else 0

    def resident_bytes(self, category: str) -> int:
        if category in self.asleep:
            return 0  # sleeping tensors keep their sizes; only our flag knows they are unmapped
        return self.weight_bytes if category == INFER_WEIGHTS else self.engine.kv_cache_bytes()


class _SleepState:
    def __init__(self, controller: VllmSleepWake, name: str):
        self.controller, self.name = controller, name

    @property
    def resident(self) -> bool:
        return self.name not in self.controller.asleep

    def resident_bytes(self) -> int:
        return self.controller.resident_bytes(self.name)

    def offload(self, *, keep_contents: bool | None = None) -> int:
        return self.controller.offload(self.name, True if keep_contents is None else keep_contents)

    def reload(self) -> int:
        return self.controller.reload(self.name)


def inference_weight_tensors(engine) -> Iterable[torch.Tensor]:
    return engine.named_weights().values()


def register_inference_states(offloader: Offloader, engine, accelerator: Accelerator) -> None:
    """Add `inference_weights` and `kv_cache` to `offloader`, by sleep/wake where vLLM supports it."""
    if not accelerator.is_host and sleep_mode_enabled(engine):
        for state in VllmSleepWake(engine).states():
            offloader.add(state)
        return
    offloader.add(InferenceWeights(engine, accelerator))
    offloader.add(KVCacheState(engine))


class InferenceWeights:
    """vLLM's live parameters (a storage group) and, on CPU, the oneDNN-packed copies its GEMMs read
    (engines/vllm_cpu_linears.py), counted with them: the copies go when the parameters leave, and are made again
    from them by the next push, or at once by a reload that brought the loaded weights back."""

    name = INFER_WEIGHTS

    def __init__(self, engine, accelerator: Accelerator):
        self.engine = engine
        # Manual offloads keep the weights (a bit-exact round trip); the automatic path after a
        # generate call passes keep_contents=False since the next switch overwrites them anyway.
        self.group = StorageGroup(INFER_WEIGHTS, lambda: inference_weight_tensors(engine), accelerator,
                                  keep_contents=True)

    @property
    def resident(self) -> bool:
        return self.group.resident

    def resident_bytes(self) -> int:
        return self.group.resident_bytes() + self.engine.packed_linear_bytes()

    def storage_keys(self) -> set[int]:
        return self.group.storage_keys()

    def host_bytes(self) -> int:
        return self.group.host_bytes()

    def offload(self, *, keep_contents: bool | None = None) -> int:
        self.engine.drop_packed_linears()
        return self.group.offload(keep_contents=keep_contents)

    def reload(self) -> int:
        copied = self.group.reload()
        if copied and self.engine.weights_loaded:
            self.engine.pack_linears()
        return copied
