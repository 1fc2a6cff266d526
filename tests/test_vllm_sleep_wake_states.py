"""The inference states through vLLM's sleep/wake (the CUDA path with `enable_sleep_mode`).

vLLM refuses sleep mode on CPU, so the engine here is a stand-in, not vLLM: `SleepingLLM` models
the semantics of vLLM 0.32 as read from its source (v1/executor/abstract.py,
device_allocator/cumem.py): the executor ignores `sleep()` while "weights" sleep, `wake_up(tags)`
wakes only allocations that sleep (any tag when `tags` is None) and ignores a tag that is awake,
level 1 backs the weights up to host memory and discards the KV cache, and level 2 discards both.
What is checked is our controller: which calls it makes, the bytes it reports, and that weights
kept through a sleep come back bit-exact.

Runs where: in the pytest process, CPU; < 1 s.
"""
from types import SimpleNamespace

import pytest
import torch

from mindspeed_rl.accelerator import get_accelerator
from mindspeed_rl.memory import Offloader
from mindspeed_rl.memory.vllm_states import (INFER_WEIGHTS, KV_CACHE, InferenceWeights, VllmSleepWake,
                                             register_inference_states)

KV_BYTES = 4096


class SleepingLLM:
    """Stand-in for `vllm.LLM(enable_sleep_mode=True)`: see the module docstring."""

    def __init__(self, weights: torch.Tensor):
        self.weights = weights
        self.sleeping: dict[str, str] = {}  # tag -> "backed_up" | "discarded"
        self.backup: torch.Tensor | None = None
        self.ignored_calls: list[str] = []  # calls vLLM would only log a warning for

    def sleep(self, level: int = 1) -> None:
        if "weights" in self.sleeping:
            self.ignored_calls.append(f"sleep({level})")
            return
        for tag in ("weights", "kv_cache"):
            if tag in self.sleeping:
                continue  # the allocator skips allocations that already sleep
            if tag == "weights" and level == 1:
                self.backup = self.weights.clone()
                self.sleeping[tag] = "backed_up"
            else:
                self.sleeping[tag] = "discarded"
        self.weights.fill_(float("nan"))  # unmapped: whatever is read now is not the weights

    def wake_up(self, tags: list[str] | None = None) -> None:
        if not self.sleeping or (tags and any(tag not in self.sleeping for tag in tags)):
            self.ignored_calls.append(f"wake_up({tags})")
            return
        for tag in list(self.sleeping):
            if tags is not None and tag not in tags:
                continue
            if tag == "weights":
                if self.sleeping[tag] == "backed_up":
                    self.weights.copy_(self.backup)
                    self.backup = None
                else:
                    self.weights.fill_(-7.0)  # fresh memory: contents undefined
            del self.sleeping[tag]


def _engine(weights: torch.Tensor):
    llm = SleepingLLM(weights)
    model_config = SimpleNamespace(enable_sleep_mode=True)
    llm.llm_engine = SimpleNamespace(vllm_config=SimpleNamespace(model_config=model_config))
    return SimpleNamespace(llm=llm, named_weights=lambda: {"w": weights}, kv_cache_bytes=lambda: KV_BYTES)


def _check(controller: VllmSleepWake, llm: SleepingLLM) -> None:
    asleep_tags = {VllmSleepWake.TAGS[category] for category in controller.asleep}
    assert asleep_tags == set(llm.sleeping), "our bookkeeping and vLLM's disagree"
    assert not llm.ignored_calls, f"vLLM would have ignored {llm.ignored_calls}"


def test_sleep_wake_controller_keeps_vllm_consistent_and_weights_bit_exact():
    original = torch.randn(256, generator=torch.Generator().manual_seed(0))
    weights = original.clone()
    engine = _engine(weights)
    llm = engine.llm
    controller = VllmSleepWake(engine)
    states = {state.name: state for state in controller.states()}
    weight_bytes = original.nbytes

    # The KV cache alone: vLLM cannot sleep one part, so both sleep and the weights wake at once.
    assert states[KV_CACHE].offload() == 0
    _check(controller, llm)
    assert set(llm.sleeping) == {"kv_cache"} and torch.equal(weights, original)
    assert states[KV_CACHE].resident_bytes() == 0 and states[INFER_WEIGHTS].resident_bytes() == weight_bytes

    # Then the weights, kept: the sleeping KV cache is woken first, or vLLM would skip the sleep.
    assert states[INFER_WEIGHTS].offload(keep_contents=True) == weight_bytes
    _check(controller, llm)
    assert llm.sleeping == {"weights": "backed_up", "kv_cache": "discarded"}
    assert not states[INFER_WEIGHTS].resident and states[INFER_WEIGHTS].resident_bytes() == 0

    assert states[KV_CACHE].reload() == 0
    _check(controller, llm)
    assert states[INFER_WEIGHTS].reload() == weight_bytes
    _check(controller, llm)
    assert torch.equal(weights, original), "weights kept through a sleep must come back bit-exact"
    assert states[INFER_WEIGHTS].reload() == 0 and states[KV_CACHE].reload() == 0  # already resident

    # Weights dropped (after a generate call the next switch overwrites them): level 2, KV stays up.
    assert states[INFER_WEIGHTS].offload(keep_contents=False) == 0
    _check(controller, llm)
    assert llm.sleeping == {"weights": "discarded"} and states[KV_CACHE].resident

    # The KV cache next: dropped weights must stay dropped, not be backed up (level 2 again).
    assert states[KV_CACHE].offload() == 0
    _check(controller, llm)
    assert llm.sleeping == {"weights": "discarded", "kv_cache": "discarded"} and llm.backup is None

    assert states[INFER_WEIGHTS].reload() == 0 and states[KV_CACHE].reload() == 0
    _check(controller, llm)
    assert not torch.equal(weights, original), "dropped weights come back undefined (the stand-in's -7)"


@pytest.mark.parametrize("device, sleep_mode, expect_sleep_path", [
    ("cpu", True, False),    # vLLM refuses sleep mode on CPU: always the storage-group path
    ("cuda", False, False),  # no enable_sleep_mode: storage groups and a hand-released KV cache
    ("cuda", True, True),
])
def test_inference_states_take_sleep_wake_only_where_vllm_supports_it(device, sleep_mode, expect_sleep_path):
    engine = _engine(torch.zeros(8))
    engine.llm.llm_engine.vllm_config.model_config.enable_sleep_mode = sleep_mode
    offloader = Offloader(get_accelerator("cpu"))  # holds the states; registration reads the device below
    register_inference_states(offloader, engine, get_accelerator(device))
    assert set(offloader.states) == {INFER_WEIGHTS, KV_CACHE}
    took_sleep_path = not isinstance(offloader.states[INFER_WEIGHTS], InferenceWeights)
    assert took_sleep_path == expect_sleep_path
