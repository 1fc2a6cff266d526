"""One rank of a run: the parts its role composes (workers/parts/), and what every rank has around them: its world, the
offloader of its states, the sharding manager that moves them by the residency table, the weight push between the
parts' two ends, the memory ledger and ROLL's manual state control.

The driver calls every method on every rank of a group (SPMD); ranks return their share of the result and the rank
group (workers/actor_group.py) assembles it. Each part's RPC declares its phase of the residency table
(`@phase_rpc`); the sharding manager moves the states, nothing else does.
"""
from __future__ import annotations

import functools
import os
import time

from mindspeed_rl.config import GRPOConfig
from mindspeed_rl.memory.residency import IDLE, ResidencyPolicy
from mindspeed_rl.workers.parts import DESTINATION, MEGATRON, SOURCE, VLLM, Part
from mindspeed_rl.workers.rank_process import RankInfo, RankProcess


def compose(role: str, parts: tuple[type[Part], ...]) -> type:
    """The worker class of `role`: its parts over the rank base (the class Ray makes an actor of)."""
    name = "".join(word.title() for word in (role or "actor_hybrid").split("_")) + "Worker"
    return type(name, (*parts, RankWorker), {"ROLE": role, "PARTS": tuple(parts)})


class RankWorker(RankProcess):
    # Named in failure messages beside the rank (actor_train, actor_infer, critic; "" for the colocated actor).
    ROLE = ""
    PARTS: tuple[type[Part], ...] = ()
    # Set by the parts that build them; None where this rank has no such part.
    actor = reference = inference_model = reward_model = critic = None

    def __init__(self, config: GRPOConfig, rank_info: RankInfo, *, model_dir: str, ref_model_dir: str):
        self.config = config
        self.rank_info = rank_info
        self.model_dir = model_dir
        self.ref_model_dir = ref_model_dir
        os.environ.update(
            RANK=str(rank_info.rank), LOCAL_RANK=str(rank_info.rank), WORLD_SIZE=str(rank_info.world_size),
            MASTER_ADDR=rank_info.master_addr, MASTER_PORT=str(rank_info.master_port),
        )
        if rank_info.run_key:
            from mindspeed_rl.workers.supervision import start_heartbeat

            start_heartbeat(rank_info.run_key, rank_info.rank)

    def holds(self, push_end: str) -> bool:
        return any(part.PUSH_END == push_end for part in self.PARTS)

    # -- construction ----------------------------------------------------------------------------
    def initialize(self) -> dict[str, float]:
        """Distributed groups, each part's engines, the weight push, the ledger; ends in `idle`."""
        from mindspeed_rl.accelerator import get_accelerator
        from mindspeed_rl.memory.offload import Offloader
        from mindspeed_rl.workers import engine_builders as build
        from mindspeed_rl.workers.sharding_manager import ShardingManager

        started = time.perf_counter()
        cfg = self.config
        self.accelerator = get_accelerator(cfg.runtime.device)
        # Ray makes exactly this rank's device visible to the actor; a rank in the driver takes the first visible one.
        self.accelerator.set_device(0)
        trains = any(part.STAGE == MEGATRON for part in self.PARTS)
        build.init_distributed(self.accelerator, rank=self.rank_info.rank, world_size=self.rank_info.world_size,
                               config=cfg, train_layout=self.layout.train if trains else None)
        self.offloader = Offloader(self.accelerator)
        self._checkpoints: dict[str, tuple] = {}
        self._build(MEGATRON, started)
        self.sharding_manager = ShardingManager(offloader=self.offloader, policy=self._residency_policy())
        # Only pinned states stay while vLLM starts: on an accelerator it sizes its KV cache by the free memory.
        self.sharding_manager.enter(IDLE)
        self._build(VLLM, started)
        self._checkpoints = {}
        if self.holds(SOURCE) and self.holds(DESTINATION):
            self._wire_colocated_push()
        self._setup_memory()
        return {"timing/initialize": time.perf_counter() - started}

    def _build(self, stage: str, started: float) -> None:
        for part in self.PARTS:
            if part.STAGE == stage:
                part.build_part(self, started)

    @functools.cached_property
    def layout(self):
        """The run's parallel layout (parallel/layout.py), built once on this rank: Megatron's groups, the push and
        the dispatch places come from it."""
        from mindspeed_rl.parallel.layout import ParallelLayout

        return ParallelLayout.from_config(self.config)

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

    def _residency_policy(self) -> ResidencyPolicy:
        """The table's rows for the states this rank's parts hold: vLLM's stay where nothing else shares its
        devices, the critic's where it is alone on its ranks."""
        names = {part.NAME for part in self.PARTS}
        return ResidencyPolicy.for_run(self.config, has_reward_model="reward model" in names,
                                       has_critic="critic" in names, offload_inference=len(names) > 1,
                                       critic_only=names == {"critic"})

    def _wire_colocated_push(self) -> None:
        """Both ends of the push on this rank: through the plan into the local vLLM; LoRA's moves only the adapters
        (resharding/adapter_push.py)."""
        from mindspeed_rl.resharding.adapter_push import colocated_push_of
        from mindspeed_rl.workers import engine_builders as build

        self.sharding_manager.attach_push(colocated_push_of(
            self.actor, inference_model=self.inference_model, train=self.layout.train, infer=self.layout.infer,
            rank=self.rank_info.rank, world_size=self.rank_info.world_size, bucket_bytes=build.bucket_bytes(self.config),
            check_weights=self.config.generate_config.check_weights_after_switch), colocated=True)

    def _setup_memory(self) -> None:
        """The ledger over the offloader's states; then, as ROLL's workers do after initialize, only what
        the table pins stays on the device (vLLM holds dummy weights until the first push: dropped)."""
        from mindspeed_rl.memory import MemoryLedger
        from mindspeed_rl.memory.context_managers import log_gpu_memory_usage, register_memory_source

        self.ledger = MemoryLedger(self.offloader.phase_bytes, self.accelerator,
                                   read_host_states=self.offloader.host_bytes, capacity=self._capacity())
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
        if any(part.STAGE == MEGATRON for part in self.PARTS):
            from mindspeed_rl.parallel import megatron_state

            p = megatron_state.current()
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
            inference_model=self.inference_model, host=host, port=port,
            timeout_seconds=self.config.runtime.collective_timeout_seconds,
            backend=self.accelerator.distributed_backend, bucket_bytes=build.bucket_bytes(self.config),
            check_weights=self.config.generate_config.check_weights_after_switch)
        push = bridge_push_of(lora=build.lora_settings(self.config), actor=self.actor if source else None,
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

        from mindspeed_rl.engines.vllm_engine import remove_cpu_shm_segments

        manager = getattr(self, "sharding_manager", None)
        if manager is not None:
            manager.close_push()
        if dist.is_initialized():
            dist.destroy_process_group()
        remove_cpu_shm_segments()
