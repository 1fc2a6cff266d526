"""ActorHybridWorker: one rank of the hybrid actor (Megatron model + optimizer, vLLM engine,
sharding manager) with the reference model beside it (integrated mode).

The driver calls every method on every rank (SPMD); ranks return their share of the result
and `mindspeed_rl.workers.group.RayActorGroup` assembles it. A run with one rank process holds its
rank as an object of the driver instead (`mindspeed_rl.workers.local_group.LocalActorGroup`).
"""
from __future__ import annotations

import os
import time
from dataclasses import dataclass

import ray
import torch

from mindspeed_rl.algorithms.grpo import GRPOLossConfig
from mindspeed_rl.config import GRPOConfig
from mindspeed_rl.models.checkpoint import load_hf_checkpoint
from mindspeed_rl.memory.residency import REF_PARAMS, REWARD_PARAMS
from mindspeed_rl.memory.roles import ACTOR_FORWARD, ACTOR_INFER, ACTOR_TRAIN, REFERENCE, REWARD_MODEL, offloaded_rpc
from mindspeed_rl.workers.actor_steps import (MiniBatchShuffler, optimizer_settings, sampling_seed, train_dp_slice,
                                              train_on_mini_batch)
from mindspeed_rl.protocol import RolloutBatch


@dataclass(frozen=True, kw_only=True)
class RankInfo:
    rank: int
    world_size: int
    master_addr: str
    master_port: int
    # Names this run's heartbeats in Ray's key-value store (workers/supervision.py).
    run_key: str = ""


@dataclass(frozen=True, kw_only=True)
class Shard:
    """What one rank returns: the slice [start, stop) of the samples, or nothing."""

    start: int
    stop: int
    value: object


class ActorHybridWorkerBase:
    # Named in failure messages beside the rank; the disaggregated workers are actor_train / actor_infer.
    ROLE = ""
    inference_model = None
    reward_model = None  # rewards.<name>.model_path: a Megatron reward model on these ranks

    def __init__(self, config: GRPOConfig, rank_info: RankInfo, *, model_dir: str, ref_model_dir: str):
        self.config = config
        self.rank_info = rank_info
        self.model_dir = model_dir
        self.ref_model_dir = ref_model_dir
        self.shuffler = MiniBatchShuffler(seed=config.megatron_training.seed,
                                          shuffle=config.rl_config.shuffle_mini_batch)
        os.environ.update(
            RANK=str(rank_info.rank), LOCAL_RANK=str(rank_info.rank), WORLD_SIZE=str(rank_info.world_size),
            MASTER_ADDR=rank_info.master_addr, MASTER_PORT=str(rank_info.master_port),
        )
        if rank_info.run_key:
            from mindspeed_rl.workers.supervision import start_heartbeat

            start_heartbeat(rank_info.run_key, rank_info.rank)

    def address(self):
        """Where this rank runs (host, pid): named in every failure message."""
        from mindspeed_rl.workers.supervision import this_worker_address

        return this_worker_address(self.rank_info.rank, role=self.ROLE)

    def set_master_addr(self, master_addr: str) -> None:
        """Ranks on several nodes meet at rank 0's node (one node: the loopback address)."""
        os.environ["MASTER_ADDR"] = master_addr

    def shm_segments(self) -> list[str]:
        """The /dev/shm segments this process maps (vLLM's broadcast and all-reduce buffers): the
        driver unlinks them once the ranks are gone, since a killed process never does."""
        from mindspeed_rl.workers.group import _mapped_shm_segments

        return sorted(_mapped_shm_segments([os.getpid()]))

    # -- construction ----------------------------------------------------------------------------
    def initialize(self) -> dict[str, float]:
        """Distributed groups, the Megatron actor and reference, vLLM, the switch, the memory policy."""
        from mindspeed_rl.accelerator import get_accelerator
        from mindspeed_rl.memory.offload import Offloader

        started = time.perf_counter()
        cfg = self.config
        self.accelerator = get_accelerator(cfg.runtime.device)
        # Ray makes exactly this rank's device visible to the actor; a rank in the driver takes the first visible one.
        self.accelerator.set_device(0)
        self._init_distributed(cfg.runtime, cfg.actor_config)
        self.accelerator.seed_model_parallel_rng(cfg.megatron_training.seed)
        self.actor, self.reference = self._build_megatron_engines(cfg.megatron_training, started)
        self.reward_model = self._build_reward_model(cfg.megatron_training, started)
        self.offloader = self._build_offloader(Offloader(self.accelerator))
        self.offloader.offload(REF_PARAMS)  # before vLLM allocates: the two never peak together
        if self.reward_model is not None:
            from mindspeed_rl.engines.reward_model import register_reward_states

            register_reward_states(self.offloader, self.reward_model)
            self.offloader.offload(REWARD_PARAMS)  # likewise: on the device only in the reward phase
        self.inference_model = self._build_rollout()
        self.inference_model.release_kv_cache()
        self._progress("vLLM started", started)
        self.sharding_manager = self._build_sharding_manager(cfg.generate_config, cfg.actor_config)
        self._setup_memory()
        return {"timing/initialize": time.perf_counter() - started}

    def _init_distributed(self, runtime, actor_config) -> None:
        import torch.distributed as dist
        from megatron.core import parallel_state as ps

        collective_timeout = set_collective_timeout(runtime.collective_timeout_seconds)
        dist.init_process_group(self.accelerator.distributed_backend, rank=self.rank_info.rank,
                                world_size=self.rank_info.world_size, timeout=collective_timeout)
        ps.initialize_model_parallel(
            distributed_timeout_minutes=max(1, round(runtime.collective_timeout_seconds / 60)),
            tensor_model_parallel_size=actor_config.tensor_model_parallel_size,
            pipeline_model_parallel_size=actor_config.pipeline_model_parallel_size,
            expert_model_parallel_size=actor_config.expert_model_parallel_size,
        )

    def _build_megatron_engines(self, megatron_training, started: float):
        """The actor (with Megatron's optimizer) and the reference, from the HF checkpoints."""
        from mindspeed_rl.engines.megatron_engine import MegatronEngine

        options = self._model_options(self.accelerator)
        spec, actor_state = load_hf_checkpoint(self.model_dir)
        self._progress("checkpoint read", started)
        dtype = torch.bfloat16 if megatron_training.bf16 else torch.float32
        actor = MegatronEngine(spec=spec, hf_state=actor_state, params_dtype=dtype, accelerator=self.accelerator,
                               optimizer=optimizer_settings(self.config), options=options)
        ref_state = actor_state if self.ref_model_dir == self.model_dir else load_hf_checkpoint(self.ref_model_dir)[1]
        reference = MegatronEngine(spec=spec, hf_state=ref_state, params_dtype=dtype, accelerator=self.accelerator,
                                   optimizer=None, options=options)
        self._progress("Megatron actor and reference built", started)
        return actor, reference

    def _build_reward_model(self, megatron_training, started: float):
        """The reward model of rewards.<name>.model_path (the driver resolved the path), in the actor's
        TP/PP layout and dtype; None without one."""
        if self.config.reward_model is None:
            return None
        from mindspeed_rl.engines.reward_model import RewardModelEngine

        model_dir = self.config.reward_model[1].model_path
        spec, state = load_hf_checkpoint(model_dir)
        engine = RewardModelEngine(spec=spec, hf_state=state, accelerator=self.accelerator, model_dir=model_dir,
                                   params_dtype=torch.bfloat16 if megatron_training.bf16 else torch.float32,
                                   options=self._model_options(self.accelerator))
        self._progress("Megatron reward model built", started)
        return engine

    def _build_sharding_manager(self, gen, actor_config):
        from mindspeed_rl.workers.sharding_manager import ShardingManager, SwitchSettings

        train, infer = self._switch_layouts()
        return ShardingManager(
            actor=self.actor, rollout=self.inference_model, offloader=self.offloader, policy=self._residency_policy(),
            switch=SwitchSettings(
                train=train, infer=infer, rank=self.rank_info.rank, world_size=self.rank_info.world_size,
                bucket_bytes=int(gen.resharding_bucket_mb * 2**20), check_weights=gen.check_weights_after_switch,
            ),
        )

    def _residency_policy(self):
        from mindspeed_rl.memory.residency import ResidencyPolicy

        gen = self.config.generate_config
        return ResidencyPolicy(offload_train_param=gen.offload_train_param, offload_train_grad=gen.offload_train_grad,
                               offload_train_optimizer=gen.offload_train_optimizer,
                               has_reward_model=self.reward_model is not None)

    def _switch_layouts(self):
        """The training layout the switch reads and the inference layout it writes."""
        from mindspeed_rl.resharding.plan import InferLayout, TrainLayout

        actor_config, gen = self.config.actor_config, self.config.generate_config
        train = TrainLayout(tp=actor_config.tensor_model_parallel_size, pp=actor_config.pipeline_model_parallel_size,
                            ep=actor_config.expert_model_parallel_size)
        infer = InferLayout(tp=gen.infer_tensor_parallel_size, pp=gen.infer_pipeline_parallel_size,
                            expert_parallel=gen.infer_expert_parallel_size > 1)
        return train, infer

    def _progress(self, step: str, started: float) -> None:
        """One line per long start-up step (rank 0 speaks for all), so a slow start shows where it is."""
        if self.rank_info.rank == 0:
            print(f"[init] {step} ({time.perf_counter() - started:.1f}s)", flush=True)

    def _model_options(self, accelerator):
        """The config's model knobs, with the fused kernels this device can run; says once which it cannot."""
        from mindspeed_rl.accelerator.kernels import KernelRequest
        from mindspeed_rl.models.qwen2 import ModelOptions

        mt = self.config.megatron_training
        kernels = accelerator.resolve_kernels(KernelRequest.from_megatron_training(mt))
        message = kernels.message(accelerator.name)
        if message and self.rank_info.rank == 0:
            print(message, flush=True)
        return ModelOptions(sequence_parallel=mt.sequence_parallel, attention_dropout=mt.attention_dropout,
                            hidden_dropout=mt.hidden_dropout, attention_softmax_in_fp32=mt.attention_softmax_in_fp32,
                            kernel_fields=kernels.transformer_fields)

    def _setup_memory(self) -> None:
        """Inference states join the offloader; ROLL's roles, the ledger; then every state leaves the device."""
        from mindspeed_rl.memory import MemoryLedger
        from mindspeed_rl.memory.context_managers import log_gpu_memory_usage, register_memory_source
        from mindspeed_rl.memory.roles import build_roles
        from mindspeed_rl.memory.vllm_states import register_inference_states

        if self.inference_model is not None:  # a disaggregated training rank has none
            register_inference_states(self.offloader, self.inference_model, self.accelerator)
        self.roles = build_roles(self.offloader, self.sharding_manager.policy)
        self.ledger = MemoryLedger(self.offloader.resident_bytes, self.accelerator)
        register_memory_source(self.offloader.resident_bytes, self.accelerator)
        # As ROLL's workers do after initialize: only what the table pins stays on the device until a
        # call needs it (vLLM holds dummy weights until the first switch: they are dropped).
        self.sharding_manager.enter("idle")
        self.accelerator.empty_cache()
        self.ledger.record("initialize")
        log_gpu_memory_usage(head="initialized", rank=0)

    def _build_offloader(self, offloader):
        from mindspeed_rl.memory.megatron_states import register_megatron_states

        register_megatron_states(offloader, self.actor, self.reference)
        return offloader

    def _build_rollout(self):
        from mindspeed_rl.engines.vllm_engine import VLLMEngine, VLLMEngineConfig

        gen = self.config.generate_config
        return VLLMEngine(VLLMEngineConfig(
            model_dir=self.model_dir, tensor_parallel_size=gen.infer_tensor_parallel_size,
            pipeline_parallel_size=gen.infer_pipeline_parallel_size,
            data_parallel_size=self.config.infer_data_parallel_size, dtype=gen.dtype,
            max_model_len=gen.max_model_len, max_num_seqs=gen.max_num_seqs,
            max_num_batched_tokens=gen.max_num_batched_tokens or gen.max_model_len * gen.max_num_seqs,
            seed=self.config.megatron_training.seed, enforce_eager=gen.enforce_eager,
            gpu_memory_utilization=gen.gpu_memory_utilization, cpu_kvcache_space_gb=gen.cpu_kvcache_space_gb,
            on_cpu=self.accelerator.is_host, enable_expert_parallel=gen.infer_expert_parallel_size > 1,
            trust_remote_code=gen.trust_remote_code,
        ))

    @property
    def model(self):
        """The training model (Megatron DDP-wrapped GPTModel), MindSpeed-RL's `model` member."""
        return self.actor.model

    @property
    def optimizer(self):
        return self.actor.optimizer

    # -- the three phases ------------------------------------------------------------------------
    @offloaded_rpc("generate", ACTOR_INFER)
    def generate_sequences(self, prompt_token_ids: list[list[int]],
                           iteration: int | None = None) -> tuple[Shard, dict[str, float]]:
        """Each inference-DP group samples its slice of the prompts; one rank per group reports it."""
        with self.sharding_manager.infer_mode():
            shard, metrics = self._sample(prompt_token_ids, iteration)
        return shard, {**metrics, **self.sharding_manager.pop_timings()}

    def _sample(self, prompt_token_ids: list[list[int]], iteration: int | None) -> tuple[Shard, dict[str, float]]:
        """This rank's inference-DP slice of the prompts, sampled with vLLM (weights and KV cache resident).

        With `iteration`, the sampling RNG is reseeded from f(megatron_training.seed, iteration, DP rank)
        first, so an iteration samples the same whatever came before (exact resume); without, it
        continues the running generator. vLLM's per-request seeds would do the same, but its runner
        rewinds their offsets after a chunked prefill, which CPU generators cannot do."""
        gen = self.config.generate_config
        sampling = gen.sampling_config
        dp_size = self.config.infer_data_parallel_size
        # A TP x PP block of consecutive ranks (vLLM's order) serves one DP slice; all its ranks return the
        # same samples (vLLM broadcasts the last stage's output), its first rank reports them.
        dp_rank, block_rank = divmod(self.rank_info.rank, gen.infer_tensor_parallel_size * gen.infer_pipeline_parallel_size)
        per_rank = len(prompt_token_ids) // dp_size
        start, stop = dp_rank * per_rank, (dp_rank + 1) * per_rank
        in_phase = self.ledger.record("generate")
        if iteration is not None:
            torch.manual_seed(sampling_seed(self.config.megatron_training.seed, iteration, dp_rank))
        t0 = time.perf_counter()
        generations = self.inference_model.generate(
            prompt_token_ids[start:stop], n=self.config.rl_config.n_samples_per_prompt,
            max_tokens=sampling.max_tokens, temperature=sampling.temperature, top_p=sampling.top_p,
            top_k=sampling.top_k, min_p=sampling.min_p, logprobs=sampling.logprobs,
            seed=None,
            detokenize=sampling.detokenize,
        )
        metrics = {"timing/rollout": time.perf_counter() - t0, **in_phase.metrics()}
        value = [(start + g.prompt_index, g.token_ids, g.logprobs) for g in generations] if block_rank == 0 else None
        return Shard(start=start, stop=stop, value=value), metrics

    @offloaded_rpc("ref_logprob", REFERENCE)
    def compute_ref_log_prob(self, batch: RolloutBatch) -> tuple[Shard, dict[str, float]]:
        self.sharding_manager.enter("ref_logprob")
        in_phase = self.ledger.record("ref_logprob")
        micro_batch_size = self.config.rl_config.ref_forward_micro_batch_size or self.config.actor_config.micro_batch_size
        shard = self._forward_logprobs(self.reference, batch, micro_batch_size)
        return shard, in_phase.metrics()

    @offloaded_rpc("reward", REWARD_MODEL)
    def compute_reward_scores(self, batch: RolloutBatch) -> tuple[Shard, dict[str, float]]:
        """The reward model's score of each sample of this rank's train-DP slice (the last real token's head
        output); the reward params are resident only during this call."""
        self.sharding_manager.enter("reward")
        in_phase = self.ledger.record("reward")
        start, stop = self._train_dp_slice(len(batch))
        micro_batch_size = self.config.rl_config.ref_forward_micro_batch_size or self.config.actor_config.micro_batch_size
        scores = self.reward_model.compute_scores(batch.select(slice(start, stop)), micro_batch_size=micro_batch_size)
        shard = Shard(start=start, stop=stop, value=scores if self._reports_train_results() else None)
        return shard, in_phase.metrics()

    @offloaded_rpc("old_logprob", ACTOR_FORWARD)
    def compute_log_prob(self, batch: RolloutBatch) -> tuple[Shard, dict[str, float]]:
        self.sharding_manager.enter_forward_mode()
        in_phase = self.ledger.record("old_logprob")
        micro_batch_size = self.config.rl_config.actor_forward_micro_batch_size or self.config.actor_config.micro_batch_size
        shard = self._forward_logprobs(self.actor, batch, micro_batch_size)
        return shard, {**self.sharding_manager.pop_timings(), **in_phase.metrics()}

    def _forward_logprobs(self, engine, batch: RolloutBatch, micro_batch_size: int) -> Shard:
        start, stop = self._train_dp_slice(len(batch))
        logprobs = engine.compute_logprobs(batch.select(slice(start, stop)), micro_batch_size=micro_batch_size,
                                           temperature=self.config.generate_config.sampling_config.temperature)
        return Shard(start=start, stop=stop, value=logprobs if self._reports_train_results() else None)

    @offloaded_rpc("update", ACTOR_TRAIN)
    def update(self, batch: RolloutBatch, kl_coef: float) -> dict[str, float]:
        """`epochs` passes over the batch in mini-batches, one optimizer step per mini-batch."""
        from mindspeed_rl.memory import ActivationMeter

        rl = self.config.rl_config
        loss_config = GRPOLossConfig(clip_ratio=rl.clip_ratio, kl_penalty=rl.kl_penalty, kl_coef=kl_coef,
                                     entropy_coeff=rl.entropy_coeff, token_level_loss=rl.token_level_loss)
        mini_batch_size = rl.mini_batch_size_in_samples
        steps: list[dict[str, float]] = []
        with self.sharding_manager.train_mode(), ActivationMeter(self.offloader.storage_keys()) as activations:
            for _ in range(rl.epochs):
                order = self.shuffler.order(len(batch))
                for first in range(0, len(batch), mini_batch_size):
                    steps.append(train_on_mini_batch(
                        self.actor, batch.select(order[first:first + mini_batch_size]), loss_config,
                        micro_batch_size=self.config.actor_config.micro_batch_size,
                        temperature=self.config.generate_config.sampling_config.temperature))
            # Recorded after the steps: the optimizer creates its moments lazily at the first one.
            in_phase = self.ledger.record("update", extra={"activations": activations.peak_bytes})
        metrics = {k: sum(s[k] for s in steps) / len(steps) for k in steps[0]}
        metrics["actor/lr"] = steps[-1]["actor/lr"]  # the rate the iteration ended on, not a mean
        metrics["actor/optimizer_steps"] = float(len(steps))
        return {**metrics, **self.sharding_manager.pop_timings(), **in_phase.metrics()}

    # -- checkpoints (mindspeed_rl/checkpoint/FORMAT.md) -------------------------------------------
    # ACTOR_TRAIN: the decorator reloads the train params and optimizer states whatever is offloaded
    # now, and restores the residency after, so a save or load works in any offload state.
    @offloaded_rpc("save_checkpoint", ACTOR_TRAIN)
    def save_checkpoint(self, checkpoint_dir: str) -> tuple[dict | None, dict[str, float]]:
        """Collective: model + optimizer as Megatron dist checkpoints, this rank's RNG states; returns
        the scheduler state (rank 0 writes it into trainer_state.json)."""
        from mindspeed_rl.checkpoint.rng_state import save_rng_state

        started = time.perf_counter()
        scheduler_state = self.actor.save_sharded(checkpoint_dir, with_optimizer=True)
        save_rng_state(checkpoint_dir, self.rank_info.rank, {"shuffler": self.shuffler.generator})
        return scheduler_state, {"timing/save_checkpoint": time.perf_counter() - started}

    @offloaded_rpc("load_checkpoint", ACTOR_TRAIN)
    def load_checkpoint(self, checkpoint_dir: str, *, load_optimizer: bool, load_rng: bool,
                        scheduler_state: dict | None) -> dict[str, float]:
        """Collective: the inverse of save_checkpoint into this rank's layout (any TP/PP)."""
        from mindspeed_rl.checkpoint.rng_state import load_rng_state

        started = time.perf_counter()
        self.actor.load_sharded(checkpoint_dir, load_optimizer=load_optimizer, scheduler_state=scheduler_state)
        if load_rng:
            load_rng_state(checkpoint_dir, self.rank_info.rank, {"shuffler": self.shuffler.generator})
        return {"timing/load_checkpoint": time.perf_counter() - started}

    # ACTOR_FORWARD: an export reads the train params only, reloaded here whatever is offloaded.
    @offloaded_rpc("export_hf", ACTOR_FORWARD)
    def export_hf(self, output_dir: str, config_dir: str) -> tuple[str | None, dict[str, float]]:
        """Collective (megatron_training.save_hf): the actor's weights as an HF checkpoint at `output_dir`,
        written atomically by global rank 0; returns the path there, None on the other ranks."""
        from mindspeed_rl.checkpoint.hf_export import export_engine

        started = time.perf_counter()
        path = export_engine(self.actor, config_dir=config_dir, output_dir=output_dir)
        return (str(path) if path is not None else None), {"timing/export_hf": time.perf_counter() - started}

    @offloaded_rpc("load_reference", REFERENCE)
    def load_reference_checkpoint(self, checkpoint_dir: str) -> dict[str, float]:
        """Collective: the reference model's weights from one of our checkpoints (its model/ part), into
        this rank's layout; the reference is resident only while they load."""
        started = time.perf_counter()
        self.reference.load_sharded(checkpoint_dir, load_optimizer=False, scheduler_state=None)
        return {"timing/load_reference": time.perf_counter() - started}

    # -- helpers ---------------------------------------------------------------------------------
    def _train_dp_slice(self, num_samples: int) -> tuple[int, int]:
        return train_dp_slice(num_samples)

    def _reports_train_results(self) -> bool:
        from megatron.core import parallel_state as ps

        return ps.get_tensor_model_parallel_rank() == 0 and ps.is_pipeline_last_stage()

    # -- manual state control (ROLL) ---------------------------------------------------------------
    def offload_states(self, include: list[str] | None = None, keep_contents: bool | None = None) -> dict[str, float]:
        """Move states (default: all) off the device. Contents are kept, except grads (dropped
        unless `keep_contents=True`) and the KV cache, so reload_states() restores them bit-exact."""
        started = time.perf_counter()
        copied = self.offloader.offload_all(include, keep_contents=keep_contents)
        self.accelerator.empty_cache()
        return {"timing/offload_states": time.perf_counter() - started,
                "offload/offload_states/offload_bytes": float(copied),
                **self.ledger.record("offload_states").metrics()}

    def reload_states(self, include: list[str] | None = None) -> dict[str, float]:
        """Bring states (default: all) back to the device."""
        started = time.perf_counter()
        copied = self.offloader.reload_all(include)
        return {"timing/reload_states": time.perf_counter() - started,
                "offload/reload_states/reload_bytes": float(copied),
                **self.ledger.record("reload_states").metrics()}

    def resident_bytes(self) -> dict[str, int]:
        """Device-resident bytes per category right now (the memory ledger's raw numbers)."""
        return self.offloader.resident_bytes()

    def shutdown(self) -> None:
        import torch.distributed as dist

        from mindspeed_rl.engines.vllm_engine import remove_cpu_shm_segments

        if dist.is_initialized():
            dist.destroy_process_group()
        remove_cpu_shm_segments()


ActorHybridWorker = ray.remote(ActorHybridWorkerBase)


def set_collective_timeout(seconds: float):
    """Every process group of this process times out after `seconds`: the world, Megatron's groups
    (passed explicitly) and vLLM's, which are made without a timeout and so take torch's default."""
    from datetime import timedelta

    from torch.distributed import distributed_c10d

    timeout = timedelta(seconds=seconds)
    distributed_c10d.default_pg_timeout = timeout
    if hasattr(distributed_c10d, "default_pg_nccl_timeout"):
        distributed_c10d.default_pg_nccl_timeout = timeout
    return timeout
