"""The training engine: the actor's Megatron model and optimizer on this rank's shard. Its old log-probs, its update,
its checkpoints and HF export; the source end of the weight push."""
from __future__ import annotations

import contextlib
import time

from mindspeed_rl.accelerator.host_memory import return_free_heap
from mindspeed_rl.memory.residency import (ADAPTER_PARAMS, OLD_LOGPROB, SWITCH, TRAIN_GRADS, TRAIN_OPTIMIZER,
                                           TRAIN_PARAMS, UPDATE)
import torch

from mindspeed_rl.protocol import RolloutBatch
from mindspeed_rl.workers.actor_steps import (MiniBatchShuffler, dpo_mini_batch_step, loss_config_for,
                                            over_mini_batches, packing_for, train_on_mini_batch)
from mindspeed_rl.workers.dispatch import TRAIN_DP, Dispatch
from mindspeed_rl.workers.parts import MEGATRON, SOURCE, Checkpointed, Part
from mindspeed_rl.workers.phase_rpc import phase_rpc


class TrainingPart(Part):
    NAME = "training engine"
    STATES = frozenset({TRAIN_PARAMS, ADAPTER_PARAMS, TRAIN_GRADS, TRAIN_OPTIMIZER})
    STAGE = MEGATRON
    PUSH_END = SOURCE
    CHECKPOINT = Checkpointed(save="save_checkpoint", load="load_checkpoint", state_key="scheduler")

    def build(self) -> None:
        from mindspeed_rl.memory.megatron_states import register_megatron_states
        from mindspeed_rl.workers import engine_builders as build

        ctx, mt = self.context, self.config.megatron_training
        self.shuffler = MiniBatchShuffler(seed=mt.seed, shuffle=self.config.rl_config.shuffle_mini_batch)
        self.actor = build.build_actor(self.config, ctx.accelerator, ctx.model_options(), parallel=ctx.groups,
                                       checkpoint=ctx.hf_checkpoint(ctx.model_dir), progress=ctx.progress)
        register_megatron_states(ctx.offloader, self.actor,
                                 swap_optimizer_times=mt.swap_optimizer_times if mt.swap_optimizer else None)

    @property
    def model(self):
        """The training model (Megatron DDP-wrapped GPTModel), MindSpeed-RL's `model` member."""
        return self.actor.model

    @property
    def optimizer(self):
        return self.actor.optimizer

    @phase_rpc(OLD_LOGPROB, progress="old log-probs", dispatch=Dispatch(TRAIN_DP, "batch"))
    def compute_log_prob(self, batch: RolloutBatch) -> tuple[torch.Tensor, dict[str, float]]:
        """The actor's log-probs of this rank's share of the batch; with `batch.meta_info["disable_adapter"]`
        (ROLL's LoRA reference call), its backbone's, with the adapters off."""
        in_phase = self.ledger.record(OLD_LOGPROB)
        disabled = batch.meta_info.get("disable_adapter", False)  # ROLL's API, not a flag of ours
        with self.actor.adapters_disabled() if disabled else contextlib.nullcontext():
            logprobs = forward_logprobs(self, self.actor, batch, reference=False)
        routing = self.actor.routing_metrics()
        return logprobs, in_phase.metrics() | ({} if disabled else routing)

    @phase_rpc(OLD_LOGPROB, progress="replayed log-probs", dispatch=Dispatch(TRAIN_DP, "batch"))
    def compute_replayed_log_prob(self, batch: RolloutBatch) -> tuple[torch.Tensor, dict[str, float]]:
        """The actor's log-probs of this rank's share with vLLM's recorded routes forced (the batch's routes column),
        routing replay on or not: the mismatch ledger's `L_replayed`, which splits off its routing share."""
        in_phase = self.ledger.record(OLD_LOGPROB)
        replay = self.actor.routing_replay
        with replay.forced(True) if replay is not None else contextlib.nullcontext():
            logprobs = forward_logprobs(self, self.actor, batch, reference=False)
        self.actor.routing_metrics()  # forced routes flip nothing: their counts are taken and not reported
        return logprobs, in_phase.metrics()

    @phase_rpc(UPDATE, progress="update", changes_weights=True, dispatch=Dispatch(TRAIN_DP, "batch"))
    def update(self, batch: RolloutBatch, kl_coef: float) -> dict[str, float]:
        """`epochs` passes over this rank's share of the batch in mini-batches, one optimizer step per mini-batch
        (each the DP ranks' same-numbered mini-batches together)."""
        from mindspeed_rl.memory import ActivationMeter

        rl = self.config.rl_config
        loss_config = loss_config_for(self.config, kl_coef)
        distill = self.config.distillation.distillation_loss if self.config.distills else None

        def step(mini_batch: RolloutBatch) -> dict[str, float]:
            return train_on_mini_batch(self.actor, mini_batch, loss_config,
                                       micro_batch_size=self.config.actor_config.micro_batch_size,
                                       temperature=self.config.generate_config.sampling_config.temperature,
                                       packing=packing_for(rl, "update"), distill=distill,
                                       key_data=self.context.key_data)

        if not self.config.generates:  # DPO: given pairs and their own loss (algorithms/dpo.py)
            step = dpo_mini_batch_step(self.config, self.actor, packing_for(rl, "update"))
        guard = self.ledger.activation_guard(UPDATE, self.context.offloader.resident_bytes())
        with ActivationMeter(self.context.offloader.storage_keys(), on_grow=guard) as activations:
            metrics, steps = over_mini_batches(batch, rl, self.shuffler, step, lr_key="actor/lr",
                                               data_parallel_size=self.actor.parallel.dp)
            # Recorded after the steps: the optimizer creates its moments lazily at the first one.
            in_phase = self.ledger.record(UPDATE, extra={"activations": activations.peak_bytes})
        metrics["actor/optimizer_steps"] = float(steps)
        routing = self.actor.routing_metrics()
        if "old_logprobs" not in batch.columns:  # on-policy: the update's forward is the old-log-prob forward
            metrics |= routing
        return_free_heap()  # the update ends a rank's iteration
        return {**metrics, **in_phase.metrics()}

    @phase_rpc(SWITCH, progress="weight push")
    def switch(self) -> dict[str, float]:
        """The switch row on a rank whose vLLM is elsewhere: entering it sends this rank's end of the push (the
        sharding manager runs it); nothing else to do."""
        return {}

    # -- checkpoints (mindspeed_rl/checkpoint/FORMAT.md) -------------------------------------------
    # In the update row: train params and optimizer states are on the device whatever was offloaded before.
    @phase_rpc(UPDATE, label="save_checkpoint", progress="checkpoint save")
    def save_checkpoint(self, checkpoint_dir: str, *, with_optimizer: bool = True,
                        with_rng: bool = True) -> tuple[dict | None, dict[str, float]]:
        """Collective: model (+ optimizer) as Megatron dist checkpoints (+ this rank's RNG states); returns
        the scheduler state (rank 0 writes it into trainer_state.json)."""
        from mindspeed_rl.checkpoint.rng_state import save_rng_state

        started = time.perf_counter()
        with self._whole_optimizer(with_optimizer):
            scheduler_state = self.actor.save_sharded(checkpoint_dir, with_optimizer=with_optimizer)
        if with_rng:
            save_rng_state(checkpoint_dir, self.context.rank_info.rank, {"shuffler": self.shuffler.generator})
        return scheduler_state, {"timing/save_checkpoint": time.perf_counter() - started}

    @phase_rpc(UPDATE, label="load_checkpoint", progress="checkpoint load", changes_weights=True)
    def load_checkpoint(self, checkpoint_dir: str, *, load_optimizer: bool, load_rng: bool,
                        scheduler_state: dict | None) -> dict[str, float]:
        """Collective: the inverse of save_checkpoint into this rank's layout (any TP/PP)."""
        from mindspeed_rl.checkpoint.rng_state import load_rng_state

        started = time.perf_counter()
        with self._whole_optimizer(load_optimizer):
            self.actor.load_sharded(checkpoint_dir, load_optimizer=load_optimizer, scheduler_state=scheduler_state)
        if load_rng:
            load_rng_state(checkpoint_dir, self.context.rank_info.rank, {"shuffler": self.shuffler.generator})
        return {"timing/load_checkpoint": time.perf_counter() - started}

    @contextlib.contextmanager
    def _whole_optimizer(self, needed: bool):
        """With the swap optimizer, every optimizer state on the device for the block (a checkpoint's save or load
        reads and writes the whole state dict: Megatron's dist-checkpointing has no bucketed path), back after."""
        swapped = needed and self.sharding_manager.policy.swap_optimizer
        if swapped:
            self.sharding_manager.reload_states([TRAIN_OPTIMIZER])
        try:
            yield
        finally:
            if swapped:
                self.sharding_manager.offload_states([TRAIN_OPTIMIZER])

    # An export reads the train params only: the old_logprob row.
    @phase_rpc(OLD_LOGPROB, label="export_hf", progress="HF export")
    def export_hf(self, output_dir: str, config_dir: str) -> tuple[str | None, dict[str, float]]:
        """Collective (megatron_training.save_hf): the actor's weights as an HF checkpoint at `output_dir`,
        written atomically by global rank 0; returns the path there, None on the other ranks."""
        from mindspeed_rl.checkpoint.hf_export import export_engine

        started = time.perf_counter()
        path = export_engine(self.actor, config_dir=config_dir, output_dir=output_dir)
        return (str(path) if path is not None else None), {"timing/export_hf": time.perf_counter() - started}


def forward_logprobs(part: Part, engine, batch: RolloutBatch, *, reference: bool) -> torch.Tensor:
    """`engine`'s log-probs of `batch` (this rank's share), in the reference's or the actor's micro-batches and
    packing."""
    config = part.config
    rl = config.rl_config
    size = rl.ref_forward_micro_batch_size if reference else rl.actor_forward_micro_batch_size
    return engine.compute_logprobs(batch, micro_batch_size=size or config.actor_config.micro_batch_size,
                                   temperature=config.generate_config.sampling_config.temperature,
                                   packing=packing_for(rl, "ref" if reference else "actor"))
