"""ActorHybridWorker: one rank of the hybrid actor (Megatron model + optimizer, vLLM engine, sharding
manager) with the reference model beside it (integrated mode), and the two halves of a disaggregated
actor (`TrainWorkerBase`: Megatron only; `InferWorkerBase`: vLLM only), which are the same class
building one side.

The driver calls every method on every rank (SPMD); ranks return their share of the result and the rank
group (workers/actor_group.py) assembles it. Each RPC declares its phase of the residency table
(`@phase_rpc`); the sharding manager moves the states, nothing else does.
"""
from __future__ import annotations

import contextlib
import os
import time

import torch

from mindspeed_rl.accelerator.host_memory import return_free_heap
from mindspeed_rl.config import GRPOConfig
from mindspeed_rl.memory.residency import (GENERATE, IDLE, OLD_LOGPROB, REF_LOGPROB, REWARD, SWITCH, UPDATE,
                                           ResidencyPolicy)
from mindspeed_rl.protocol import RolloutBatch, Shard
from mindspeed_rl.workers.actor_steps import (MiniBatchShuffler, loss_config_for, over_mini_batches, packing_for,
                                            sampling_seed, train_dp_slice, train_on_mini_batch)
from mindspeed_rl.workers import critic_steps
from mindspeed_rl.workers.phase_rpc import phase_rpc
from mindspeed_rl.workers.rank_process import RankInfo, RankProcess

TRAIN_ROLE, INFER_ROLE = "actor_train", "actor_infer"


class ActorHybridWorkerBase(RankProcess, critic_steps.CriticMethods):
    # Named in failure messages beside the rank; the disaggregated workers are actor_train / actor_infer.
    ROLE = ""
    # What this rank builds: the training side (Megatron actor, reference, reward model), the inference side (vLLM).
    TRAINS = GENERATES = True
    actor = reference = inference_model = None
    reward_model = None  # rewards.<name>.model_path: a Megatron reward model on these ranks
    critic = None  # PPO (critic_config): a Megatron value model on these ranks (workers/critic_steps.py)

    def __init__(self, config: GRPOConfig, rank_info: RankInfo, *, model_dir: str, ref_model_dir: str):
        self.config = config
        self.rank_info = rank_info
        self.model_dir = model_dir
        self.ref_model_dir = ref_model_dir
        self.shuffler = MiniBatchShuffler(seed=config.megatron_training.seed,
                                          shuffle=config.rl_config.shuffle_mini_batch)
        self.critic_shuffler = critic_steps.critic_shuffler(config)
        os.environ.update(
            RANK=str(rank_info.rank), LOCAL_RANK=str(rank_info.rank), WORLD_SIZE=str(rank_info.world_size),
            MASTER_ADDR=rank_info.master_addr, MASTER_PORT=str(rank_info.master_port),
        )
        if rank_info.run_key:
            from mindspeed_rl.workers.supervision import start_heartbeat

            start_heartbeat(rank_info.run_key, rank_info.rank)

    # -- construction ----------------------------------------------------------------------------
    def initialize(self) -> dict[str, float]:
        """Distributed groups, the engines this rank holds, the weight push, the ledger; ends in `idle`."""
        from mindspeed_rl.accelerator import get_accelerator
        from mindspeed_rl.memory.offload import Offloader
        from mindspeed_rl.workers import engine_builders as build
        from mindspeed_rl.workers.sharding_manager import ShardingManager

        started = time.perf_counter()
        cfg = self.config
        self.accelerator = get_accelerator(cfg.runtime.device)
        # Ray makes exactly this rank's device visible to the actor; a rank in the driver takes the first visible one.
        self.accelerator.set_device(0)
        build.init_distributed(self.accelerator, rank=self.rank_info.rank, world_size=self.rank_info.world_size,
                               config=cfg, megatron_groups=self.TRAINS)
        self.offloader = Offloader(self.accelerator)
        if self.TRAINS:
            self._build_training_side(started)
        self.sharding_manager = ShardingManager(offloader=self.offloader, policy=ResidencyPolicy.for_run(
            cfg, has_reward_model=self.reward_model is not None, has_critic=self.critic is not None,
            offload_inference=self.TRAINS, critic_only=self.actor is None and self.critic is not None))
        # Only pinned states stay while vLLM starts: on an accelerator it sizes its KV cache by the free memory.
        self.sharding_manager.enter(IDLE)
        if self.GENERATES:
            self._build_inference_side(started)
        self._setup_memory()
        return {"timing/initialize": time.perf_counter() - started}

    def _build_training_side(self, started: float) -> None:
        from mindspeed_rl.workers import engine_builders as build

        progress = lambda step: self._progress(step, started)  # noqa: E731
        options = build.model_options(self.config, self.accelerator, announce=self.rank_info.rank == 0)
        self.actor, self.reference = build.build_megatron_engines(
            self.config, self.accelerator, options, model_dir=self.model_dir, ref_model_dir=self.ref_model_dir,
            progress=progress)
        self.reward_model = build.build_reward_model(self.config, self.accelerator, options, progress=progress)
        if not self.config.critic_has_own_devices:  # else its own ranks build it (workers/critic_group.py)
            self.critic = critic_steps.build_critic(self.config, self.accelerator, options, model_dir=self.model_dir,
                                                    progress=progress)
        build.register_training_states(self.offloader, self.actor, self.reference, self.reward_model, self.critic)

    def _build_inference_side(self, started: float) -> None:
        """vLLM, its states, and, where this rank also trains, the colocated weight push into it."""
        from mindspeed_rl.memory.vllm_states import register_inference_states
        from mindspeed_rl.resharding.adapter_push import colocated_adapter_push
        from mindspeed_rl.resharding.weight_push import colocated_push
        from mindspeed_rl.workers import engine_builders as build

        self.inference_model = build.build_inference_model(self.config, self.accelerator, model_dir=self.model_dir)
        self._progress("vLLM started", started)
        register_inference_states(self.offloader, self.inference_model, self.accelerator)
        if self.TRAINS:
            train, infer = build.switch_layouts(self.config)
            # LoRA: only the adapters move (resharding/adapter_push.py); else the weights through the plan.
            push = colocated_push if self.actor.lora is None else colocated_adapter_push
            self.sharding_manager.weight_push = push(
                actor=self.actor, inference_model=self.inference_model, train=train, infer=infer,
                rank=self.rank_info.rank, world_size=self.rank_info.world_size,
                bucket_bytes=build.bucket_bytes(self.config),
                check_weights=self.config.generate_config.check_weights_after_switch)

    def _setup_memory(self) -> None:
        """The ledger over the offloader's states; then, as ROLL's workers do after initialize, only what
        the table pins stays on the device (vLLM holds dummy weights until the first push: dropped)."""
        from mindspeed_rl.memory import MemoryLedger
        from mindspeed_rl.memory.context_managers import log_gpu_memory_usage, register_memory_source

        self.ledger = MemoryLedger(self.offloader.resident_bytes, self.accelerator)
        register_memory_source(self.offloader.resident_bytes, self.accelerator)
        self.sharding_manager.enter(IDLE)
        self.ledger.record("initialize")
        log_gpu_memory_usage(head="initialized", rank=0)

    def _progress(self, step: str, started: float) -> None:
        """One line per long start-up step (rank 0 speaks for all), so a slow start shows where it is."""
        if self.rank_info.rank == 0:
            print(f"[init] {step} ({time.perf_counter() - started:.1f}s)", flush=True)

    @property
    def model(self):
        """The training model (Megatron DDP-wrapped GPTModel), MindSpeed-RL's `model` member."""
        return self.actor.model

    @property
    def optimizer(self):
        return self.actor.optimizer

    # -- the weight push across rank sets (disaggregated) ------------------------------------------
    def inference_dtypes(self) -> dict:
        """Parameter name -> dtype of vLLM's parameters: the wire dtypes the training ranks pack in."""
        from mindspeed_rl.resharding.transfer import destination_dtypes

        return destination_dtypes(self.inference_model.named_weights())

    def connect_bridge(self, host: str, port: int, *, train_world_size: int, infer_world_size: int,
                       infer_dtypes: dict | None = None) -> None:
        """Join the bridge (training ranks first, then inference ranks) and plan this rank's end of the push: a LoRA
        actor's moves the adapters only (resharding/adapter_push.py), else the weights go through the plan."""
        from mindspeed_rl.models.checkpoint import read_spec
        from mindspeed_rl.resharding.adapter_push import bridge_adapter_push
        from mindspeed_rl.resharding.weight_push import bridge_push
        from mindspeed_rl.workers import engine_builders as build

        train, infer = build.switch_layouts(self.config)
        common = dict(
            spec=build.train_spec(self.config, read_spec(self.model_dir)), train=train, infer=infer,
            train_world_size=train_world_size, infer_world_size=infer_world_size,
            bridge_rank=self.rank_info.rank + (0 if self.TRAINS else train_world_size),
            dtypes=infer_dtypes if infer_dtypes is not None else self.inference_dtypes(),
            inference_model=self.inference_model, host=host, port=port,
            timeout_seconds=self.config.runtime.collective_timeout_seconds,
            backend=self.accelerator.distributed_backend, bucket_bytes=build.bucket_bytes(self.config),
            check_weights=self.config.generate_config.check_weights_after_switch)
        lora = build.lora_settings(self.config)
        if lora is None:
            push = bridge_push(read_sources=self.actor.named_weights if self.TRAINS else None, **common)
        else:
            push = bridge_adapter_push(lora=lora, adapter_dtype=build.params_dtype(self.config),
                                       actor=self.actor if self.TRAINS else None, **common)
        self.sharding_manager.bridge_push = push

    @phase_rpc(SWITCH)
    def sync_weights(self) -> dict[str, float]:
        """Collective over the training and the inference ranks: this rank's end of the push."""
        return self.sharding_manager.bridge_push.push()

    # -- the phases ------------------------------------------------------------------------------
    @phase_rpc(GENERATE)
    def generate_sequences(self, prompt_token_ids: list[list[int]], iteration: int | tuple[int, ...] | None = None,
                           n: int | None = None, greedy: bool = False,
                           max_tokens: list[int] | None = None) -> tuple[Shard, dict[str, float]]:
        """Each inference-DP group samples its slice of the prompts; one rank per group reports it. `n` samples
        per prompt (default rl_config.n_samples_per_prompt), greedily with `greedy` (evaluation), at most
        `max_tokens[i]` tokens for prompt i (default sampling_config.max_tokens; a multi-turn turn's budgets).

        With `iteration`, the sampling RNG is reseeded from f(seed, iteration, DP rank) first (seed:
        sampling_config.seed, else megatron_training.seed), so an iteration samples the same whatever came before (exact resume); without, it
        continues the running generator. vLLM's per-request seeds would do the same, but its runner
        rewinds their offsets after a chunked prefill, which CPU generators cannot do."""
        gen = self.config.generate_config
        sampling = gen.sampling_config
        dp_size = self.config.infer_data_parallel_size
        # A TP x PP block of consecutive ranks (vLLM's order) serves one DP slice; all its ranks return the
        # same samples (vLLM broadcasts the last stage's output), its first rank reports them.
        dp_rank, block_rank = divmod(self.rank_info.rank, gen.infer_tensor_parallel_size * gen.infer_pipeline_parallel_size)
        # Balanced slices: a multi-turn rollout's continuations need not divide by the DP size.
        start, stop = len(prompt_token_ids) * dp_rank // dp_size, len(prompt_token_ids) * (dp_rank + 1) // dp_size
        in_phase = self.ledger.record(GENERATE)
        if iteration is not None:
            base_seed = sampling.seed if sampling.seed is not None else self.config.megatron_training.seed
            torch.manual_seed(sampling_seed(base_seed, iteration, dp_rank))
        t0 = time.perf_counter()
        generations = [] if start == stop else self.inference_model.generate(
            prompt_token_ids[start:stop], n=n or self.config.rl_config.n_samples_per_prompt,
            max_tokens=sampling.max_tokens if max_tokens is None else max_tokens[start:stop], temperature=0.0 if greedy else sampling.temperature, top_p=sampling.top_p,
            top_k=sampling.top_k, min_p=sampling.min_p, logprobs=sampling.logprobs, seed=None,
            detokenize=sampling.detokenize,
        )
        metrics = {"timing/rollout": time.perf_counter() - t0, **in_phase.metrics()}
        value = [(start + g.prompt_index, g.token_ids, g.logprobs) for g in generations] if block_rank == 0 else None
        return_free_heap()  # an inference-only rank (disaggregated) has no update to end its iteration
        return Shard(start=start, stop=stop, value=value), metrics

    @phase_rpc(REWARD)
    def compute_reward_scores(self, batch: RolloutBatch) -> tuple[Shard, dict[str, float]]:
        """The reward model's score of each sample of this rank's train-DP slice (the last real token's head
        output); the reward params are resident only during this call."""
        in_phase = self.ledger.record(REWARD)
        start, stop = train_dp_slice(len(batch))
        scores = self.reward_model.compute_scores(batch.select(slice(start, stop)),
                                                  micro_batch_size=self._forward_micro_batch_size(reference=True))
        return Shard(start=start, stop=stop, value=scores if self._reports_train_results() else None), in_phase.metrics()

    @phase_rpc(REF_LOGPROB)
    def compute_ref_log_prob(self, batch: RolloutBatch) -> tuple[Shard, dict[str, float]]:
        """The reference model's log-probs; with LoRA's shared backbone, the actor's with its adapters off."""
        in_phase = self.ledger.record(REF_LOGPROB)
        engine = self.reference or self.actor
        with contextlib.nullcontext() if self.reference is not None else self.actor.adapters_disabled():
            shard = self._forward_logprobs(engine, batch, self._forward_micro_batch_size(reference=True),
                                           packing_for(self.config.rl_config, "ref"))
        return shard, in_phase.metrics()

    @phase_rpc(OLD_LOGPROB)
    def compute_log_prob(self, batch: RolloutBatch) -> tuple[Shard, dict[str, float]]:
        """The actor's log-probs; with `batch.meta_info["disable_adapter"]` (ROLL's LoRA reference call), its
        backbone's, with the adapters off."""
        in_phase = self.ledger.record(OLD_LOGPROB)
        disabled = batch.meta_info.get("disable_adapter", False)
        with self.actor.adapters_disabled() if disabled else contextlib.nullcontext():
            shard = self._forward_logprobs(self.actor, batch, self._forward_micro_batch_size(reference=False),
                                           packing_for(self.config.rl_config, "actor"))
        return shard, in_phase.metrics()

    def _forward_micro_batch_size(self, *, reference: bool) -> int:
        rl = self.config.rl_config
        size = rl.ref_forward_micro_batch_size if reference else rl.actor_forward_micro_batch_size
        return size or self.config.actor_config.micro_batch_size

    def _forward_logprobs(self, engine, batch: RolloutBatch, micro_batch_size: int, packing) -> Shard:
        start, stop = train_dp_slice(len(batch))
        logprobs = engine.compute_logprobs(batch.select(slice(start, stop)), micro_batch_size=micro_batch_size,
                                           temperature=self.config.generate_config.sampling_config.temperature,
                                           packing=packing)
        return Shard(start=start, stop=stop, value=logprobs if self._reports_train_results() else None)

    @phase_rpc(UPDATE)
    def update(self, batch: RolloutBatch, kl_coef: float) -> dict[str, float]:
        """`epochs` passes over the batch in mini-batches, one optimizer step per mini-batch."""
        from mindspeed_rl.memory import ActivationMeter

        rl = self.config.rl_config
        loss_config = loss_config_for(self.config, kl_coef)

        def step(mini_batch: RolloutBatch) -> dict[str, float]:
            return train_on_mini_batch(self.actor, mini_batch, loss_config,
                                       micro_batch_size=self.config.actor_config.micro_batch_size,
                                       temperature=self.config.generate_config.sampling_config.temperature,
                                       packing=packing_for(rl, "update"))

        with ActivationMeter(self.offloader.storage_keys()) as activations:
            metrics, steps = over_mini_batches(batch, rl, self.shuffler, step, lr_key="actor/lr")
            # Recorded after the steps: the optimizer creates its moments lazily at the first one.
            in_phase = self.ledger.record(UPDATE, extra={"activations": activations.peak_bytes})
        metrics["actor/optimizer_steps"] = float(steps)
        return_free_heap()  # the update ends a rank's iteration
        return {**metrics, **in_phase.metrics()}

    # -- checkpoints (mindspeed_rl/checkpoint/FORMAT.md) -------------------------------------------
    # In the update row: train params and optimizer states are on the device whatever was offloaded before.
    @phase_rpc(UPDATE, label="save_checkpoint")
    def save_checkpoint(self, checkpoint_dir: str, *, with_optimizer: bool = True,
                        with_rng: bool = True) -> tuple[dict | None, dict[str, float]]:
        """Collective: model (+ optimizer) as Megatron dist checkpoints (+ this rank's RNG states); returns
        the scheduler state (rank 0 writes it into trainer_state.json)."""
        from mindspeed_rl.checkpoint.rng_state import save_rng_state

        started = time.perf_counter()
        scheduler_state = self.actor.save_sharded(checkpoint_dir, with_optimizer=with_optimizer)
        if with_rng:
            save_rng_state(checkpoint_dir, self.rank_info.rank, self._named_generators())
        return scheduler_state, {"timing/save_checkpoint": time.perf_counter() - started}

    @phase_rpc(UPDATE, label="load_checkpoint")
    def load_checkpoint(self, checkpoint_dir: str, *, load_optimizer: bool, load_rng: bool,
                        scheduler_state: dict | None) -> dict[str, float]:
        """Collective: the inverse of save_checkpoint into this rank's layout (any TP/PP)."""
        from mindspeed_rl.checkpoint.rng_state import load_rng_state

        started = time.perf_counter()
        self.actor.load_sharded(checkpoint_dir, load_optimizer=load_optimizer, scheduler_state=scheduler_state)
        if load_rng:
            load_rng_state(checkpoint_dir, self.rank_info.rank, self._named_generators())
        return {"timing/load_checkpoint": time.perf_counter() - started}

    def _named_generators(self) -> dict:
        return {"shuffler": self.shuffler.generator}  # the critic's is in its own part (save_critic_checkpoint)

    # An export reads the train params only: the old_logprob row.
    @phase_rpc(OLD_LOGPROB, label="export_hf")
    def export_hf(self, output_dir: str, config_dir: str) -> tuple[str | None, dict[str, float]]:
        """Collective (megatron_training.save_hf): the actor's weights as an HF checkpoint at `output_dir`,
        written atomically by global rank 0; returns the path there, None on the other ranks."""
        from mindspeed_rl.checkpoint.hf_export import export_engine

        started = time.perf_counter()
        path = export_engine(self.actor, config_dir=config_dir, output_dir=output_dir)
        return (str(path) if path is not None else None), {"timing/export_hf": time.perf_counter() - started}

    @phase_rpc(REF_LOGPROB, label="load_reference")
    def load_reference_checkpoint(self, checkpoint_dir: str) -> dict[str, float]:
        """Collective: the reference model's weights from one of our checkpoints (its model/ part), into
        this rank's layout; the reference is resident only while they load."""
        started = time.perf_counter()
        self.reference.load_sharded(checkpoint_dir, load_optimizer=False, scheduler_state=None)
        return {"timing/load_reference": time.perf_counter() - started}

    def _reports_train_results(self) -> bool:
        from megatron.core import parallel_state as ps

        return ps.get_tensor_model_parallel_rank() == 0 and ps.is_pipeline_last_stage()

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
        if manager is not None and manager.bridge_push is not None:
            manager.bridge_push.close()
            manager.bridge_push = None
        if dist.is_initialized():
            dist.destroy_process_group()
        remove_cpu_shm_segments()


class TrainWorkerBase(ActorHybridWorkerBase):
    """A training rank of a disaggregated actor: Megatron actor (with optimizer) and reference, no vLLM."""

    ROLE, GENERATES = TRAIN_ROLE, False


class InferWorkerBase(ActorHybridWorkerBase):
    """An inference rank of a disaggregated actor: vLLM only; its device is its own, so nothing moves."""

    ROLE, TRAINS = INFER_ROLE, False
