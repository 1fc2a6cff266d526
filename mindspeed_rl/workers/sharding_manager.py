"""The train <-> infer switch of the hybrid actor.

enter_infer_mode: push the training weights into vLLM, then move train states away per the
`offload_train_*` flags and rebuild the KV cache. exit_infer_mode: release the KV cache.
enter_forward_mode / enter_train_mode: bring back what the next phase needs.

This version handles layouts where every rank can build its inference weights from a full
gather (train TP/PP -> infer TP1 through vLLM's own slicing); the bucketed resharding transfer
replaces `_push_weights` without changing this contract.
"""
from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass

from mindspeed_rl.engines.megatron_engine import MegatronEngine
from mindspeed_rl.engines.vllm_engine import VLLMEngine
from mindspeed_rl.memory.offload import Offloader

TRAIN_PARAMS, TRAIN_GRADS, TRAIN_OPTIMIZER = "train_params", "train_grads", "optimizer_states"


@dataclass(frozen=True, kw_only=True)
class OffloadFlags:
    offload_train_param: bool
    offload_train_grad: bool
    offload_train_optimizer: bool


class ShardingManager:
    def __init__(self, *, actor: MegatronEngine, rollout: VLLMEngine, offloader: Offloader, flags: OffloadFlags):
        self.actor = actor
        self.rollout = rollout
        self.offloader = offloader
        self.flags = flags
        self.timings: dict[str, float] = {}

    def _timed(self, key: str):
        @contextlib.contextmanager
        def timer():
            start = time.perf_counter()
            yield
            self.timings[key] = self.timings.get(key, 0.0) + time.perf_counter() - start
        return timer()

    # -- train -> infer --------------------------------------------------------------------------
    def enter_infer_mode(self) -> None:
        with self._timed("timing/resharding_enter_infer"):
            self.offloader.reload(TRAIN_PARAMS)  # the source of the push must be resident
            self._push_weights()
            if self.flags.offload_train_param:
                self.offloader.offload(TRAIN_PARAMS)
            if self.flags.offload_train_grad:
                self.offloader.offload(TRAIN_GRADS)
            if self.flags.offload_train_optimizer:
                self.offloader.offload(TRAIN_OPTIMIZER)
            self.rollout.rebuild_kv_cache()

    def exit_infer_mode(self) -> None:
        with self._timed("timing/resharding_exit_infer"):
            self.rollout.release_kv_cache()

    def _push_weights(self) -> None:
        self.rollout.load_weights(self.actor.hf_weights_full().items())

    # -- infer -> train --------------------------------------------------------------------------
    def enter_forward_mode(self) -> None:
        with self._timed("timing/onload_forward"):
            self.offloader.reload(TRAIN_PARAMS)

    def enter_train_mode(self) -> None:
        with self._timed("timing/onload_train"):
            for group in (TRAIN_PARAMS, TRAIN_GRADS, TRAIN_OPTIMIZER):
                self.offloader.reload(group)

    def exit_train_mode(self) -> None:
        """States stay resident: the next enter_infer_mode pushes weights from them first."""

    @contextlib.contextmanager
    def infer_mode(self):
        self.enter_infer_mode()
        try:
            yield
        finally:
            self.exit_infer_mode()

    @contextlib.contextmanager
    def train_mode(self):
        self.enter_train_mode()
        try:
            yield
        finally:
            self.exit_train_mode()

    def pop_timings(self) -> dict[str, float]:
        timings, self.timings = self.timings, {}
        return timings
