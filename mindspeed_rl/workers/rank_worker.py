"""One rank of a run: the parts its role composes (workers/parts/), each an object built with this rank's one
`RankContext`, and what every rank has around them: its world and parallel groups, the offloader of its states, the
sharding manager that moves them by the residency table, the weight push between the parts' two ends, the memory
ledger and ROLL's manual state control.

The driver calls every method on every rank of a group (SPMD); ranks return their share of the result and the rank
group (workers/actor_group.py) assembles it. The rank class of a role (`compose`) forwards each RPC its parts declare
to the part; each RPC declares its phase of the residency table (`@phase_rpc`); the sharding manager moves the
states, nothing else does.
"""
from __future__ import annotations

import contextlib
import inspect
import os
import time
from typing import Callable

from mindspeed_rl.config import GRPOConfig
from mindspeed_rl.memory.residency import IDLE, ResidencyPolicy
from mindspeed_rl.workers.parts import DESTINATION, MEGATRON, SOURCE, VLLM, Part, RankContext, declared_rpcs
from mindspeed_rl.workers.rank_process import RankInfo, RankProcess
from mindspeed_rl.workers.stage_probe import key_data_saver, probe_of

# What a forwarded RPC carries of its declaration (workers/phase_rpc.py, workers/parts/part_rpc).
_DECLARATION = ("phase", "progress", "changes_weights", "dispatch", "rpc")


def compose(role: str, parts: tuple[type[Part], ...], *, layout_of: Callable | None = None) -> type:
    """The rank class of `role` (the class Ray makes an actor of): the rank base holding one object per part, with a
    method per RPC the parts declare that forwards to the part. `layout_of(config)`: the role's own layout (a teacher
    of its own), where it is not the run's."""
    name = "".join(word.title() for word in (role or "actor_hybrid").split("_")) + "Worker"
    namespace: dict = {"ROLE": role, "PARTS": tuple(parts)}
    if layout_of is not None:
        namespace["layout"] = property(lambda self: layout_of(self.config), doc=layout_of.__doc__)
    for part in parts:
        for method, rpc in declared_rpcs(part).items():
            namespace[method] = _forwarder(part.NAME, method, rpc)
    return type(name, (RankWorker,), namespace)


def _forwarder(part_name: str, method: str, rpc: Callable) -> Callable:
    def forward(self, *args, **kwargs):
        if not self.stage_hooks:
            return getattr(self.parts[part_name], method)(*args, **kwargs)
        with contextlib.ExitStack() as around:  # profiler_config's torch.profiler, msprobe_config's dumps
            for hook in self.stage_hooks:
                around.enter_context(hook.around(method))
            return getattr(self.parts[part_name], method)(*args, **kwargs)

    forward.__name__ = forward.__qualname__ = method
    forward.__doc__ = rpc.__doc__
    # Ray checks every call against the signature it finds (the RPC's own, `meta_info` included).
    forward.__signature__ = inspect.signature(rpc)
    for attribute in _DECLARATION:
        if hasattr(rpc, attribute):
            setattr(forward, attribute, getattr(rpc, attribute))
    return forward


class RankWorker(RankProcess):
    # Named in failure messages beside the rank (actor_train, actor_infer, critic; "" for the colocated actor).
    ROLE = ""
    PARTS: tuple[type[Part], ...] = ()
    # workers/stage_profiler.py's StageProfiler, built by initialize when profiler_config.integrated.profile is on.
    profiler = None
    probe = None  # workers/stage_probe.py: msprobe_config's dumps, built with the context when msprobe is on
    # What runs around every part RPC (`around(rpc)`): the profiler and msprobe's StageProbe (workers/stage_probe.py)
    # where they are on.
    stage_hooks: tuple = ()

    def __init__(self, config: GRPOConfig, rank_info: RankInfo, *, model_dir: str, ref_model_dir: str):
        self.config = config
        self.rank_info = rank_info
        self.model_dir = model_dir
        self.ref_model_dir = ref_model_dir
        self.parts: dict[str, Part] = {}  # by NAME, in the role's order; built by initialize
        os.environ.update(
            RANK=str(rank_info.rank), LOCAL_RANK=str(rank_info.rank), WORLD_SIZE=str(rank_info.world_size),
            MASTER_ADDR=rank_info.master_addr, MASTER_PORT=str(rank_info.master_port),
        )
        if rank_info.run_key:
            from mindspeed_rl.workers.supervision import start_heartbeat

            start_heartbeat(rank_info.run_key, rank_info.rank)

    def holds(self, push_end: str) -> bool:
        return any(part.PUSH_END == push_end for part in self.PARTS)

    def _end(self, push_end: str) -> Part | None:
        """This rank's part at `push_end` of the weight push, or None."""
        return next((part for part in self.parts.values() if part.PUSH_END == push_end), None)

    # -- construction ----------------------------------------------------------------------------
    def initialize(self) -> dict[str, float]:
        """Distributed groups, each part's engines, the weight push, the ledger; ends in `idle`."""
        from mindspeed_rl.accelerator import get_accelerator
        from mindspeed_rl.workers import engine_builders as build

        started = time.perf_counter()
        cfg = self.config
        self.accelerator = get_accelerator(cfg.runtime.device)
        # Ray makes exactly this rank's device visible to the actor; a rank in the driver takes the first visible one.
        self.accelerator.set_device(0)
        trains = any(part.STAGE == MEGATRON for part in self.PARTS)
        self.groups = build.init_distributed(self.accelerator, rank=self.rank_info.rank,
                                             world_size=self.rank_info.world_size, config=cfg,
                                             train_layout=self.layout.train if trains else None)
        context = self._context(started)
        self._build(context, MEGATRON)
        # Only pinned states stay while vLLM starts: on an accelerator it sizes its KV cache by the free memory.
        self.sharding_manager.enter(IDLE)
        self._build(context, VLLM)
        self._checkpoints = {}
        if self.holds(SOURCE) and self.holds(DESTINATION):
            self._wire_colocated_push()
        self._setup_memory()
        if cfg.profiling:
            from mindspeed_rl.workers.stage_profiler import StageProfiler

            self.profiler = StageProfiler(cfg.profiler_config.integrated, rank=self.rank_info.rank,
                                          device_type=self.accelerator.name)
        self.stage_hooks = tuple(hook for hook in (self.profiler, self.probe) if hook is not None)
        return {"timing/initialize": time.perf_counter() - started}

    def begin_iteration(self, iteration: int) -> None:
        """The trainer's iteration, for profiler_config's step range (called only when profiling is on)."""
        if self.profiler is not None:
            self.profiler.begin_iteration(iteration)

    def _context(self, started: float) -> RankContext:
        """The one context every part is built with; the mechanisms in it exist before any part (the ledger's
        capacity is set once they are all built, as the device settles)."""
        from mindspeed_rl.memory import MemoryLedger
        from mindspeed_rl.memory.offload import Offloader
        from mindspeed_rl.workers.sharding_manager import ShardingManager

        self.offloader = Offloader(self.accelerator)
        self.sharding_manager = ShardingManager(offloader=self.offloader, policy=self.residency_policy_of(self.config))
        self.ledger = MemoryLedger(self.offloader.phase_bytes, self.accelerator,
                                   read_host_states=self.offloader.host_bytes)
        self._checkpoints: dict[str, tuple] = {}
        self.probe = probe_of(self.config, self.parts, tuple(part.NAME for part in self.PARTS))
        return RankContext(
            config=self.config, rank_info=self.rank_info, role=self.ROLE,
            part_names=tuple(part.NAME for part in self.PARTS), model_dir=self.model_dir,
            ref_model_dir=self.ref_model_dir, accelerator=self.accelerator, layout=self.layout, groups=self.groups,
            offloader=self.offloader, sharding_manager=self.sharding_manager, ledger=self.ledger,
            progress=lambda step: self._progress(step, started), hf_checkpoint=self.hf_checkpoint,
            model_options=self.model_options, key_data=key_data_saver(self.probe))

    def _build(self, context: RankContext, stage: str) -> None:
        """This stage's parts, in the role's order: each gets the parts it borrows from (built before it)."""
        for part_class in self.PARTS:
            if part_class.STAGE == stage:
                borrowed = {name: self.parts[name] for name in part_class.BORROWS if name in self.parts}
                part = self.parts[part_class.NAME] = part_class(context, borrowed)
                part.build()

    @property
    def layout(self):
        """The run's parallel layout (parallel/layout.py), the config's one object: Megatron's groups, the push and
        the dispatch places come from it."""
        return self.config.layout

    def hf_checkpoint(self, model_dir: str) -> tuple:
        """(spec, state) of an HF directory, read once per initialize (the actor and the reference share one)."""
        from mindspeed_rl.models.checkpoint import load_hf_checkpoint

        if model_dir not in self._checkpoints:
            self._checkpoints[model_dir] = load_hf_checkpoint(model_dir)
        return self._checkpoints[model_dir]

    def model_options(self):
        """The config's model knobs with this device's kernels, shared by the rank's Megatron models (said once)."""
        from mindspeed_rl.workers import engine_builders as build

        if not hasattr(self, "_model_options"):
            announce = self.rank_info.rank == 0 and self.ROLE != "critic"
            self._model_options = build.model_options(self.config, self.accelerator, announce=announce)
        return self._model_options

    @classmethod
    def residency_policy_of(cls, config: GRPOConfig) -> ResidencyPolicy:
        """The table's rows for the states this role's parts declare (the planner asks the same function with the
        run's)."""
        return ResidencyPolicy.for_states(config, frozenset().union(*(part.STATES for part in cls.PARTS)))

    def _wire_colocated_push(self) -> None:
        """Both ends of the push on this rank: through the plan into the local vLLM; LoRA's moves only the adapters
        (resharding/adapter_push.py)."""
        from mindspeed_rl.resharding.adapter_push import colocated_push_of
        from mindspeed_rl.workers import engine_builders as build

        self.sharding_manager.attach_push(colocated_push_of(
            self._end(SOURCE).actor, inference_model=self._end(DESTINATION).inference_model, train=self.layout.train,
            infer=self.layout.infer, rank=self.rank_info.rank, world_size=self.rank_info.world_size,
            bucket_bytes=build.bucket_bytes(self.config),
            check_weights=self.config.generate_config.check_weights_after_switch), colocated=True)

    def _setup_memory(self) -> None:
        """The ledger's capacity; then, as ROLL's workers do after initialize, only what the table pins stays on the
        device (vLLM holds dummy weights until the first push: dropped)."""
        from mindspeed_rl.memory.context_managers import log_gpu_memory_usage, register_memory_source

        self.ledger.capacity = self._capacity()
        self.sharding_manager.capacity = self.ledger.capacity
        register_memory_source(self.offloader.resident_bytes, self.accelerator)
        self.sharding_manager.enter(IDLE)
        self.ledger.record("initialize")
        log_gpu_memory_usage(head="initialized", rank=0)

    def _capacity(self):
        """runtime.device_memory_limit as this rank's device capacity (memory/capacity.py); None without one."""
        from mindspeed_rl.memory.capacity import DeviceCapacity

        limit = self.config.runtime.device_memory_limit_bytes
        if limit is None:
            return None
        self.accelerator.limit_memory(limit)
        return DeviceCapacity(limit)

    def _progress(self, step: str, started: float) -> None:
        """One line per long start-up step (rank 0 speaks for all), so a slow start shows where it is."""
        if self.rank_info.rank == 0:
            print(f"[init] {step} ({time.perf_counter() - started:.1f}s)", flush=True)

    def dispatch_places(self) -> dict:
        """Where this rank sits in each data-parallel split its parts compute in (workers/dispatch.py): Megatron's
        (its results collected from TP rank 0, CP rank 0 of the last stage) and vLLM's (from the first rank of
        each TP x PP block, vLLM's order)."""
        from mindspeed_rl.workers.dispatch import INFER_DP, TRAIN_DP, DataParallelPlace

        places = {}
        if self.groups is not None:
            p = self.groups
            places[TRAIN_DP] = DataParallelPlace(dp_rank=p.dp_rank, dp_size=p.dp,
                                                 collected=p.tp_rank == 0 and p.cp_rank == 0 and p.last_stage)
        if any(part.STAGE == VLLM for part in self.PARTS):
            layout, rank = self.layout, self.rank_info.rank
            places[INFER_DP] = DataParallelPlace(dp_rank=layout.infer.dp_rank(rank), dp_size=layout.infer_dp,
                                                 collected=rank % (layout.infer.tp * layout.infer.pp) == 0)
        return places

    # -- the weight push across rank sets (disaggregated) ------------------------------------------
    def connect_bridge(self, host: str, port: int, *, train_world_size: int, infer_world_size: int,
                       infer_dtypes: dict | None = None) -> None:
        """Join the bridge (training ranks first, then inference ranks) and plan this rank's end of the push: a LoRA
        actor's moves the adapters only (resharding/adapter_push.py), else the weights go through the plan."""
        from mindspeed_rl.models.checkpoint import read_spec
        from mindspeed_rl.resharding.adapter_push import bridge_push_of
        from mindspeed_rl.workers import engine_builders as build

        source = self.holds(SOURCE)
        common = dict(
            spec=build.train_spec(self.config, read_spec(self.model_dir)), train=self.layout.train,
            infer=self.layout.infer,
            train_world_size=train_world_size, infer_world_size=infer_world_size,
            bridge_rank=self.rank_info.rank + (0 if source else train_world_size),
            dtypes=infer_dtypes if infer_dtypes is not None else self.inference_dtypes(),
            inference_model=getattr(self._end(DESTINATION), "inference_model", None), host=host, port=port,
            timeout_seconds=self.config.runtime.collective_timeout_seconds,
            backend=self.accelerator.distributed_backend, bucket_bytes=build.bucket_bytes(self.config),
            check_weights=self.config.generate_config.check_weights_after_switch)
        push = bridge_push_of(lora=build.lora_settings(self.config), actor=self._end(SOURCE).actor if source else None,
                              adapter_dtype=build.params_dtype(self.config), **common)
        self.sharding_manager.attach_push(push, colocated=False)

    # -- manual state control (ROLL), through the sharding manager -----------------------------------
    def offload_states(self, include: list[str] | None = None, keep_contents: bool | None = None) -> dict[str, float]:
        """Move states (default: all) off the device. Contents are kept, except grads (dropped
        unless `keep_contents=True`) and the KV cache, so reload_states() restores them bit-exact."""
        started = time.perf_counter()
        copied = self.sharding_manager.offload_states(include, keep_contents=keep_contents)
        return {"timing/offload_states": time.perf_counter() - started,
                "offload/offload_states/offload_bytes": float(copied),
                **self.ledger.record("offload_states").metrics()}

    def reload_states(self, include: list[str] | None = None) -> dict[str, float]:
        """Bring states (default: all) back to the device."""
        started = time.perf_counter()
        copied = self.sharding_manager.reload_states(include)
        return {"timing/reload_states": time.perf_counter() - started,
                "offload/reload_states/reload_bytes": float(copied),
                **self.ledger.record("reload_states").metrics()}

    def resident_bytes(self) -> dict[str, int]:
        """Device-resident bytes per category right now (the memory ledger's raw numbers)."""
        return self.offloader.resident_bytes()

    def shutdown(self) -> None:
        """Leave the bridge (disaggregated), then this rank's world; unlink vLLM's segments."""
        import torch.distributed as dist

        from mindspeed_rl.engines.vllm_cpu_process import remove_cpu_shm_segments

        manager = getattr(self, "sharding_manager", None)
        if manager is not None:
            manager.close_push()
        if dist.is_initialized():
            dist.destroy_process_group()
        remove_cpu_shm_segments()
