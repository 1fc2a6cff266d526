"""Disaggregated actor: actor_train and actor_infer on their own devices (ROLL's disaggregated layout).

Training ranks (Megatron actor and reference, taking turns on their devices as in the colocated mode)
and inference ranks (vLLM, weights and KV cache always resident) are two Ray groups, each with its
own torch.distributed world. After every change of the training weights, the next generate first
pushes them over the bridge (resharding/bridge.py) through the same resharding plan as the colocated
switch, planned between the two rank sets: an inference rank receives exactly its shard, and nothing
is gathered whole. The driver sees one object with RayActorGroup's interface, so the GRPO loop is the
same in both modes.
"""
from __future__ import annotations

import time
from typing import Any

import ray
import torch

from mindspeed_rl.memory.residency import REF_PARAMS
from mindspeed_rl.memory.roles import ACTOR_FORWARD, offloaded_rpc
from mindspeed_rl.workers.actor_hybrid_worker import ActorHybridWorkerBase, Shard, set_collective_timeout
from mindspeed_rl.workers.group import GRACEFUL_SHUTDOWN_SECONDS, RayActorGroup, _free_port, merge_metrics, wait_all
from mindspeed_rl.workers.supervision import WorkerFailure

TRAIN_ROLE, INFER_ROLE = "actor_train", "actor_infer"
# Calls after which the inference weights are stale: the next generate pushes first.
_CHANGES_WEIGHTS = frozenset({"update", "load_checkpoint"})


class _BridgeEnd:
    """Leaves the bridge before the rank's own world at shutdown (its store lives on training rank 0)."""

    _bridge = None

    def shutdown(self) -> None:
        if self._bridge is not None:
            self._bridge.barrier()
            self._bridge = None
        super().shutdown()


class TrainWorkerBase(_BridgeEnd, ActorHybridWorkerBase):
    """One training rank: Megatron actor (with optimizer) and reference, no inference engine."""

    ROLE = TRAIN_ROLE

    def initialize(self) -> dict[str, float]:
        from mindspeed_rl.accelerator import get_accelerator
        from mindspeed_rl.memory.offload import Offloader
        from mindspeed_rl.workers.sharding_manager import ResidencyManager

        started = time.perf_counter()
        cfg = self.config
        self.accelerator = get_accelerator(cfg.runtime.device)
        self.accelerator.set_device(0)
        self._init_distributed(cfg.runtime, cfg.actor_config)
        self.accelerator.seed_model_parallel_rng(cfg.megatron_training.seed)
        self.actor, self.reference = self._build_megatron_engines(cfg.megatron_training, started)
        self.offloader = self._build_offloader(Offloader(self.accelerator))
        self.offloader.offload(REF_PARAMS)
        self.sharding_manager = ResidencyManager(offloader=self.offloader, policy=self._residency_policy())
        self._setup_memory()
        return {"timing/initialize": time.perf_counter() - started}

    def connect_bridge(self, host: str, port: int, infer_world_size: int, infer_dtypes: dict) -> None:
        """Join the bridge as rank `rank` of training ranks + inference ranks; plan the push."""
        self._bridge, self._plan, self._transfer = _connect(
            self, host=host, port=port, bridge_rank=self.rank_info.rank, infer_world_size=infer_world_size,
            spec=self.actor.spec, dtypes=infer_dtypes)
        self._infer_dtypes = infer_dtypes

    @offloaded_rpc("push_weights", ACTOR_FORWARD)
    @torch.no_grad()
    def push_weights(self) -> dict[str, float]:
        """Collective with every inference rank's receive_weights: this rank's shards, as planned."""
        from mindspeed_rl.resharding.fingerprint import verify_transfer

        started = time.perf_counter()
        sources = self.actor.named_weights()
        metrics = self._transfer.run(sources, {}).as_metrics()
        if self.config.generate_config.check_weights_after_switch:
            verify_transfer(self._plan, self.rank_info.rank, sources, {}, group=self._bridge, dtypes=self._infer_dtypes)
        metrics["timing/push_weights"] = time.perf_counter() - started
        return metrics


class InferWorkerBase(_BridgeEnd, ActorHybridWorkerBase):
    """One inference rank: vLLM only; its devices are its own, so nothing is ever offloaded."""

    ROLE = INFER_ROLE

    def initialize(self) -> dict[str, float]:
        import torch.distributed as dist

        from mindspeed_rl.accelerator import get_accelerator
        from mindspeed_rl.memory import MemoryLedger
        from mindspeed_rl.memory.context_managers import register_memory_source
        from mindspeed_rl.memory.offload import Offloader
        from mindspeed_rl.memory.vllm_states import register_inference_states

        started = time.perf_counter()
        cfg = self.config
        self.accelerator = get_accelerator(cfg.runtime.device)
        self.accelerator.set_device(0)
        # vLLM (external_launcher) builds its TP/DP groups over the world it finds: the inference ranks.
        dist.init_process_group(self.accelerator.distributed_backend, rank=self.rank_info.rank,
                                world_size=self.rank_info.world_size,
                                timeout=set_collective_timeout(cfg.runtime.collective_timeout_seconds))
        self.inference_model = self._build_rollout()
        self._progress("vLLM started", started)
        self.offloader = Offloader(self.accelerator)
        register_inference_states(self.offloader, self.inference_model, self.accelerator)  # for the ledger
        self.ledger = MemoryLedger(self.offloader.resident_bytes, self.accelerator)
        register_memory_source(self.offloader.resident_bytes, self.accelerator)
        self.ledger.record("initialize")
        return {"timing/initialize": time.perf_counter() - started}

    def inference_dtypes(self) -> dict:
        """Parameter name -> dtype of vLLM's parameters: the wire dtypes the training ranks pack in."""
        from mindspeed_rl.resharding.transfer import destination_dtypes

        return destination_dtypes(self.inference_model.named_weights())

    def connect_bridge(self, host: str, port: int, train_world_size: int) -> None:
        from transformers import AutoConfig

        from mindspeed_rl.models.qwen2 import Qwen2Spec
        from mindspeed_rl.workers.sharding_manager import check_and_clear_padding

        spec = Qwen2Spec.from_hf_config(AutoConfig.from_pretrained(self.model_dir))
        self._bridge_rank = train_world_size + self.rank_info.rank
        self._bridge, self._plan, self._transfer = _connect(
            self, host=host, port=port, bridge_rank=self._bridge_rank, infer_world_size=self.rank_info.world_size,
            spec=spec, dtypes=self.inference_dtypes(), train_world_size=train_world_size)
        check_and_clear_padding(self._plan, self._bridge_rank, self.inference_model.named_weights())

    @torch.no_grad()
    def receive_weights(self) -> dict[str, float]:
        """Collective with every training rank's push_weights: this rank's vLLM shard, verified unless disabled."""
        from mindspeed_rl.resharding.fingerprint import verify_transfer

        started = time.perf_counter()
        destinations = self.inference_model.named_weights()
        metrics = self._transfer.run({}, destinations).as_metrics()
        if self.config.generate_config.check_weights_after_switch:
            metrics["resharding/ranges_verified"] = float(
                verify_transfer(self._plan, self._bridge_rank, {}, destinations, group=self._bridge))
        self.inference_model.mark_weights_loaded()
        metrics["resharding/planned_bytes_received"] = float(
            sum(c.numel * destinations_itemsize(destinations, c.dst_tensor) for c in self._plan.copies_to(self._bridge_rank)))
        metrics["timing/receive_weights"] = time.perf_counter() - started
        return metrics

    def generate_sequences(self, prompt_token_ids: list[list[int]],
                           iteration: int | None = None) -> tuple[Shard, dict[str, float]]:
        return self._sample(prompt_token_ids, iteration)


def destinations_itemsize(destinations: dict, key: str) -> int:
    from mindspeed_rl.resharding.layouts import tensor_view

    return tensor_view(destinations, key).element_size()


def _connect(worker, *, host: str, port: int, bridge_rank: int, infer_world_size: int, spec, dtypes,
             train_world_size: int | None = None):
    from mindspeed_rl.resharding.bridge import BridgeGroup
    from mindspeed_rl.resharding.plan import build_plan
    from mindspeed_rl.resharding.transfer import Transfer

    cfg = worker.config
    train_world_size = train_world_size or worker.rank_info.world_size
    bridge = BridgeGroup(host=host, port=port, rank=bridge_rank, size=train_world_size + infer_world_size,
                         timeout_seconds=cfg.runtime.collective_timeout_seconds,
                         backend=worker.accelerator.distributed_backend)
    train, infer = worker._switch_layouts()
    plan = build_plan(spec, train, infer, train_world_size, infer_world_size=infer_world_size)
    transfer = Transfer(plan, rank=bridge_rank, bucket_bytes=int(cfg.generate_config.resharding_bucket_mb * 2**20),
                        dtype=dtypes, group=bridge)
    return bridge, plan, transfer


TrainWorker = ray.remote(TrainWorkerBase)
InferWorker = ray.remote(InferWorkerBase)


class DisaggregatedActor:
    """RayActorGroup's interface over the training group and the inference group."""

    def __init__(self, *, config, device: str, env_vars: dict[str, str], model_dir: str, ref_model_dir: str):
        self.config = config
        common = dict(config=config, device=device, env_vars=env_vars, model_dir=model_dir, ref_model_dir=ref_model_dir)
        self.train = RayActorGroup(worker_class=TrainWorker, world_size=config.world_size, **common)
        try:
            self.infer = RayActorGroup(worker_class=InferWorker, world_size=config.infer_world_size, **common)
        except BaseException:
            self.train.kill()
            raise
        self.addresses = self.train.addresses + self.infer.addresses
        self._weights_stale = True
        self._pending = None  # (each inference rank's generate_sequences ref, the push's metrics)

    def initialize(self) -> list[dict[str, float]]:
        """Both groups build their engines at once, then join the bridge and plan the push."""
        train_metrics, infer_metrics = wait_all([(group, "initialize", group.call("initialize", blocking=False))
                                                 for group in (self.train, self.infer)])
        for group in (self.train, self.infer):
            group.shm_segments.update(name for names in group.call("shm_segments") for name in names)
        single_host = len({a.host for a in self.addresses}) == 1
        host, port = ("127.0.0.1" if single_host else self.train.addresses[0].ip), _free_port()
        dtypes = self.infer.call("inference_dtypes")[0]
        wait_all([
            (self.train, "connect_bridge",
             self.train.call("connect_bridge", host, port, self.config.infer_world_size, dtypes, blocking=False)),
            (self.infer, "connect_bridge",
             self.infer.call("connect_bridge", host, port, self.config.world_size, blocking=False)),
        ])
        return train_metrics + infer_metrics

    def call(self, method: str, *args: Any, blocking: bool = True, **kwargs: Any) -> list[Any]:
        """generate_sequences runs on the inference ranks (after a push if the weights changed); every
        other call on the training ranks."""
        if method != "generate_sequences":
            results = self.train.call(method, *args, blocking=blocking, **kwargs)
            if method in _CHANGES_WEIGHTS:
                self._weights_stale = True
            return results
        self.start_generate(*args, **kwargs)
        return self.finish_generate()

    def start_generate(self, *args: Any, **kwargs: Any) -> None:
        """generate_sequences on the inference ranks, not waited for: the training ranks stay free, so the
        next rollout can run during this update (async_generation_ratio: 1). Pushes first if the weights
        changed; finish_generate collects it."""
        assert self._pending is None, "a rollout is already running; finish_generate first"
        pushed = self.sync_weights() if self._weights_stale else {}
        self._pending = (self.infer.call("generate_sequences", *args, blocking=False, **kwargs), pushed)

    def finish_generate(self) -> list[Any]:
        """The started rollout's results (each inference rank's), with the push's and the wait's metrics."""
        assert self._pending is not None, "no rollout was started"
        (refs, pushed), self._pending = self._pending, None
        started = time.perf_counter()
        results = wait_all([(self.infer, "generate_sequences", refs)])[0]
        shard, metrics = results[0]
        # rank 0's metrics are the iteration's (merge_metrics)
        results[0] = (shard, {**metrics, **pushed, "timing/rollout_wait": time.perf_counter() - started})
        return results

    def sync_weights(self) -> dict[str, float]:
        """Training weights -> every inference rank, through the plan; the push's metrics."""
        assert self._pending is None, "the inference ranks are generating; finish_generate before a push"
        started = time.perf_counter()
        pushed, received = wait_all([
            (self.train, "push_weights", self.train.call("push_weights", blocking=False)),
            (self.infer, "receive_weights", self.infer.call("receive_weights", blocking=False)),
        ])
        self._weights_stale = False
        metrics = {k: v for k, v in merge_metrics(pushed).items() if k.startswith(("memory/", "timing/push_weights"))}
        metrics |= merge_metrics(received)
        for key in ("resharding/bytes_received", "resharding/planned_bytes_received"):
            metrics[key + "_all_ranks"] = sum(m[key] for m in received)
        metrics["resharding/bytes_sent_all_ranks"] = sum(m["resharding/bytes_sent"] for m in pushed)
        metrics["timing/resharding_enter_infer"] = time.perf_counter() - started
        return metrics

    # ROLL's cluster-level state control, on both groups.
    def offload_states(self, include: list[str] | None = None, *, keep_contents: bool | None = None,
                       blocking: bool = True) -> list[Any]:
        return [r for g in (self.train, self.infer) for r in g.offload_states(include, keep_contents=keep_contents,
                                                                               blocking=blocking)]

    def reload_states(self, include: list[str] | None = None, *, blocking: bool = True) -> list[Any]:
        return [r for g in (self.train, self.infer) for r in g.reload_states(include, blocking=blocking)]

    def shutdown(self) -> None:
        """Both groups close at once (they leave the bridge together), then every process ends."""
        groups = (self.train, self.infer)
        try:
            for group in groups:
                group.deadlines.base["shutdown"] = GRACEFUL_SHUTDOWN_SECONDS
            wait_all([(group, "shutdown", group.call("shutdown", blocking=False)) for group in groups])
        except WorkerFailure as failure:
            print(f"[shutdown] {failure}; killing the workers", flush=True)
        finally:
            self.kill()

    def kill(self) -> None:
        try:
            self.train.kill()
        finally:
            self.infer.kill()
