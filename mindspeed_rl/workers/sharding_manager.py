"""The train <-> infer switch of the hybrid actor, and the one place states move between phases.

`enter(phase)` makes the resident state groups equal that phase's row of the residency table
(memory/residency.py): it offloads what the row leaves out first, then reloads what it needs, so two
phases' states never peak together. enter_infer_mode reshards the training weights straight into
vLLM's live parameters (planned transfer, bounded buckets, fingerprint check) and then enters
`generate` (train states leave per the `offload_train_*` flags, the KV cache is rebuilt last).
"""
from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass

import torch

from mindspeed_rl.engines.megatron_engine import MegatronEngine
from mindspeed_rl.engines.vllm_engine import VLLMEngine
from mindspeed_rl.memory.offload import Offloader
from mindspeed_rl.memory.residency import INFER_WEIGHTS, KV_CACHE, STATE_GROUPS, TRAIN_PARAMS, ResidencyPolicy
from mindspeed_rl.resharding.fingerprint import verify_transfer
from mindspeed_rl.resharding.layouts import tensor_view, uncovered_ranges
from mindspeed_rl.resharding.plan import InferLayout, TrainLayout, build_plan
from mindspeed_rl.resharding.transfer import Transfer, destination_dtypes


@dataclass(frozen=True, kw_only=True)
class SwitchSettings:
    train: TrainLayout
    infer: InferLayout
    rank: int
    world_size: int
    bucket_bytes: int
    check_weights: bool


class ResidencyManager:
    """The phases' state moves, on any rank; a disaggregated training rank has only these (no inference
    engine beside it, but the actor and the reference still take turns on its device)."""

    def __init__(self, *, offloader: Offloader, policy: ResidencyPolicy):
        self.offloader = offloader
        self.policy = policy
        self.timings: dict[str, float] = {}

    def _timed(self, key: str):
        @contextlib.contextmanager
        def timer():
            start = time.perf_counter()
            yield
            self.timings[key] = self.timings.get(key, 0.0) + time.perf_counter() - start
        return timer()

    # -- phases ------------------------------------------------------------------------------------
    def enter(self, phase: str) -> None:
        """Resident state groups := the phase's row: offloads first, then reloads (the KV cache last)."""
        target = self.policy.resident(phase)
        for name in self._registered():
            if name not in target and self.offloader.is_resident(name):
                # Every switch overwrites vLLM's weights: their contents are not worth a copy.
                self.offloader.offload(name, keep_contents=False if name == INFER_WEIGHTS else None)
        for name in sorted(target & set(self._registered()), key=lambda n: n == KV_CACHE):
            self.offloader.reload(name)

    def _registered(self) -> list[str]:
        return [name for name in STATE_GROUPS if name in self.offloader.states]

    # -- infer -> train --------------------------------------------------------------------------
    def enter_forward_mode(self) -> None:
        with self._timed("timing/onload_forward"):
            self.enter("old_logprob")

    def enter_train_mode(self) -> None:
        with self._timed("timing/onload_train"):
            self.enter("update")

    def exit_train_mode(self) -> None:
        """States stay resident: the next enter_infer_mode pushes weights from them first."""

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


class ShardingManager(ResidencyManager):
    """The colocated switch: the same ranks hold the training shards and vLLM's live parameters."""

    def __init__(self, *, actor: MegatronEngine, rollout: VLLMEngine, offloader: Offloader, policy: ResidencyPolicy,
                 switch: SwitchSettings):
        super().__init__(offloader=offloader, policy=policy)
        self.actor = actor
        self.rollout = rollout
        self.switch = switch
        self.plan = build_plan(actor.spec, switch.train, switch.infer, switch.world_size)
        # Megatron's shards mix dtypes (fp32 norms in a bf16 model); the wire carries each range in
        # its vLLM parameter's dtype, which every rank knows (same inference model everywhere).
        self.infer_dtypes = all_stage_dtypes(rollout.named_weights(), switch.infer)
        self.transfer = Transfer(self.plan, rank=switch.rank, bucket_bytes=switch.bucket_bytes,
                                 dtype=self.infer_dtypes)
        check_and_clear_padding(self.plan, switch.rank, rollout.named_weights())

    # -- train -> infer --------------------------------------------------------------------------
    def enter_infer_mode(self) -> None:
        with self._timed("timing/resharding_enter_infer"):
            # Both ends of the push must be resident (a no-op when the RPC already reloaded them).
            self.offloader.reload(TRAIN_PARAMS)
            self.offloader.reload(INFER_WEIGHTS)
            self.push_weights()
            self.enter("generate")

    def exit_infer_mode(self) -> None:
        with self._timed("timing/resharding_exit_infer"):
            self.rollout.release_kv_cache()

    @torch.no_grad()
    def push_weights(self) -> dict[str, float]:
        """Training shards -> live inference shards, through the plan; verified unless disabled."""
        sources, destinations = self.actor.named_weights(), self.rollout.named_weights()
        stats = self.transfer.run(sources, destinations)
        metrics = stats.as_metrics()
        if self.switch.check_weights:
            started = time.perf_counter()
            metrics["resharding/ranges_verified"] = float(
                verify_transfer(self.plan, self.switch.rank, sources, destinations, dtypes=self.infer_dtypes))
            metrics["timing/resharding_fingerprint"] = time.perf_counter() - started
        self.rollout.mark_weights_loaded()
        for key, value in metrics.items():
            self.timings[key] = self.timings.get(key, 0.0) + value
        return metrics

    @contextlib.contextmanager
    def infer_mode(self):
        self.enter_infer_mode()
        try:
            yield
        finally:
            self.exit_infer_mode()


def all_stage_dtypes(destinations, infer: InferLayout) -> dict:
    """The wire dtype of every inference parameter. With inference PP a rank holds only its stage's
    parameters but sends ranges for every stage's, so the stages' names are gathered once (a
    collective over all ranks, at construction)."""
    dtypes = destination_dtypes(destinations)
    if infer.pp == 1:
        return dtypes
    import torch.distributed as dist

    gathered: list = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, dtypes)
    return {name: dtype for stage in gathered for name, dtype in stage.items()}


def check_and_clear_padding(plan, rank: int, destinations) -> None:
    """The live vLLM shapes must be the layout's; padding rows never receive data, so zero them once."""
    for key, local in plan.infer_tensors[rank].items():
        try:
            target = tensor_view(destinations, key)
        except (KeyError, IndexError):
            raise ValueError(f"vLLM has no parameter {key} that the resharding layout expects") from None
        if tuple(target.shape) != local.shape:
            raise ValueError(f"vLLM parameter {key}: live shape {tuple(target.shape)}, "
                             f"resharding layout expects {local.shape}")
        for start, length in uncovered_ranges(local):
            target.narrow(local.dim, start, length).zero_()
