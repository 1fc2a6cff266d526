"""What one rank does for PPO's critic (engines/critic.py): build it, its values of a rollout, its update.

The critic is colocated with the actor and shares its parallel groups (config/algorithm_checks.check_critic), so
its data-parallel slice of a batch is the actor's.
"""
from __future__ import annotations

import os
import time
from typing import Callable

import torch

from mindspeed_rl.algorithms.grpo import count_loss_units
from mindspeed_rl.algorithms.ppo import clipped_value_loss
from mindspeed_rl.config import GRPOConfig
from mindspeed_rl.memory.residency import CRITIC_UPDATE, CRITIC_VALUES
from mindspeed_rl.protocol import MicroBatch, RolloutBatch, Shard
from mindspeed_rl.workers.actor_steps import (MiniBatchShuffler, loss_agg_mode, lr_schedule, over_mini_batches,
                                            packing_for, train_dp_slice)
from mindspeed_rl.workers.phase_rpc import phase_rpc

CRITIC_SEED_OFFSET = 1  # the critic's mini-batch order and fresh head: a stream of their own


def critic_optimizer_settings(cfg: GRPOConfig):
    """critic_config's Adam and LR schedule, over as many optimizer steps as the actor's."""
    from mindspeed_rl.engines.megatron_engine import OptimizerSettings

    c = cfg.critic_config
    return OptimizerSettings(lr=c.lr, min_lr=c.min_lr, weight_decay=c.weight_decay, adam_beta1=c.adam_beta1,
                             adam_beta2=c.adam_beta2, adam_eps=c.adam_eps, clip_grad=c.clip_grad,
                             schedule=lr_schedule(cfg, section=c),
                             use_distributed_optimizer=cfg.megatron_training.use_distributed_optimizer)


def build_critic(config: GRPOConfig, accelerator, options, *, model_dir: str, progress: Callable[[str], None]):
    """The critic from critic_config.load (an HF reward model or causal LM) or else the actor's initial
    weights; None without a critic_config."""
    if config.critic_config is None:
        return None
    from mindspeed_rl.checkpoint.store import is_checkpoint_dir
    from mindspeed_rl.engines.critic import CriticEngine
    from mindspeed_rl.models.checkpoint import load_hf_checkpoint
    from mindspeed_rl.workers.engine_builders import params_dtype, train_spec

    from dataclasses import replace

    c = config.critic_config
    spec, state = load_hf_checkpoint(c.load if c.load and not is_checkpoint_dir(c.load) else model_dir)
    options = replace(options, recompute_granularity=c.recompute_granularity, recompute_method=c.recompute_method,
                      recompute_num_layers=c.recompute_num_layers)  # the critic's own activation recompute
    critic = CriticEngine(spec=train_spec(config, spec), hf_state=state, params_dtype=params_dtype(config),
                          accelerator=accelerator, optimizer=critic_optimizer_settings(config), options=options,
                          head_seed=config.megatron_training.seed + CRITIC_SEED_OFFSET)
    progress("Megatron critic built")
    return critic


def critic_shuffler(config: GRPOConfig) -> MiniBatchShuffler:
    return MiniBatchShuffler(seed=config.megatron_training.seed + CRITIC_SEED_OFFSET,
                             shuffle=config.rl_config.shuffle_mini_batch)


def critic_values(critic, config: GRPOConfig, batch: RolloutBatch) -> tuple[int, int, torch.Tensor]:
    """This rank's DP slice [start, stop) of the batch and the critic's values there."""
    start, stop = train_dp_slice(len(batch))
    values = critic.compute_values(batch.select(slice(start, stop)),
                                   micro_batch_size=config.critic_config.micro_batch_size,
                                   packing=packing_for(config.rl_config, "actor"))
    return start, stop, values


def update_critic(critic, config: GRPOConfig, batch: RolloutBatch, shuffler: MiniBatchShuffler) -> dict[str, float]:
    """`epochs` passes over the batch in the actor's mini-batch size, one critic optimizer step per mini-batch, on
    the clipped value loss toward the batch's `returns` around its `values` (the rollout's)."""
    rl = config.rl_config
    mode = loss_agg_mode(rl)

    def step(mini_batch: RolloutBatch) -> dict[str, float]:
        denominator = count_loss_units(mini_batch.response_mask, mode)
        start, stop = train_dp_slice(len(mini_batch))

        def loss_fn(values: torch.Tensor, mb: MicroBatch):
            return clipped_value_loss(values, mb.extras["values"], mb.extras["returns"], mb.response_mask,
                                      cliprange_value=rl.cliprange_value, loss_agg_mode=mode, denominator=denominator)

        return critic.train_step(mini_batch.select(slice(start, stop)),
                                 micro_batch_size=config.critic_config.micro_batch_size, loss_fn=loss_fn,
                                 packing=packing_for(rl, "update"))

    return over_mini_batches(batch, rl, shuffler, step, lr_key="critic/lr")[0]


class CriticMethods:
    """The rank worker's critic RPCs (mixed into workers/actor_hybrid_worker.ActorHybridWorkerBase, which gives
    `critic`, `critic_shuffler`, `config`, `ledger`, `offloader`, `sharding_manager`), each in its residency row."""

    @phase_rpc(CRITIC_VALUES)
    def compute_values(self, batch: RolloutBatch) -> tuple[Shard, dict[str, float]]:
        in_phase = self.ledger.record(CRITIC_VALUES)
        start, stop, values = critic_values(self.critic, self.config, batch)
        return Shard(start=start, stop=stop, value=values if self._reports_train_results() else None), in_phase.metrics()

    @phase_rpc(CRITIC_UPDATE)
    def update_critic(self, batch: RolloutBatch) -> dict[str, float]:
        from mindspeed_rl.memory import ActivationMeter

        with ActivationMeter(self.offloader.storage_keys()) as activations:
            metrics = update_critic(self.critic, self.config, batch, self.critic_shuffler)
            in_phase = self.ledger.record(CRITIC_UPDATE, extra={"activations": activations.peak_bytes})
        return {**metrics, **in_phase.metrics()}

    @phase_rpc(CRITIC_UPDATE, label="save_critic")
    def save_critic_checkpoint(self, checkpoint_dir: str, *, with_optimizer: bool = True,
                               with_rng: bool = True) -> tuple[dict | None, dict[str, float]]:
        """Collective over the critic's ranks: its model, optimizer and mini-batch order under <checkpoint>/critic
        (rng/ per rank); returns its scheduler state."""
        from mindspeed_rl.checkpoint.rng_state import save_rng_state

        started = time.perf_counter()
        critic_dir = os.path.join(checkpoint_dir, "critic")
        state = self.critic.save_sharded(critic_dir, with_optimizer=with_optimizer)
        if with_rng:
            save_rng_state(critic_dir, self.rank_info.rank, {"critic_shuffler": self.critic_shuffler.generator})
        return state, {"timing/save_critic": time.perf_counter() - started}

    @phase_rpc(CRITIC_UPDATE, label="load_critic")
    def load_critic_checkpoint(self, checkpoint_dir: str, *, load_optimizer: bool, load_rng: bool,
                               scheduler_state: dict | None) -> dict[str, float]:
        """The inverse of save_critic_checkpoint. Where the critic shares the actor's ranks, the actor's RNG
        states (loaded before) are the same ones again."""
        from mindspeed_rl.checkpoint.rng_state import load_rng_state

        started = time.perf_counter()
        critic_dir = os.path.join(checkpoint_dir, "critic")
        self.critic.load_sharded(critic_dir, load_optimizer=load_optimizer, scheduler_state=scheduler_state)
        if load_rng:
            load_rng_state(critic_dir, self.rank_info.rank, {"critic_shuffler": self.critic_shuffler.generator})
        return {"timing/load_critic": time.perf_counter() - started}
