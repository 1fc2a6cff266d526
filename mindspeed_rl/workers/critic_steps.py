"""What one rank does for PPO's critic (engines/critic.py): build it, its values of a rollout, its update.

The critic is colocated with the actor and shares its parallel groups (config/algorithm_checks.check_critic), so
its data-parallel slice of a batch is the actor's.
"""
from __future__ import annotations

from typing import Callable

import torch

from mindspeed_rl.algorithms.grpo import count_loss_units
from mindspeed_rl.algorithms.ppo import clipped_value_loss
from mindspeed_rl.config import GRPOConfig
from mindspeed_rl.protocol import MicroBatch, RolloutBatch
from mindspeed_rl.workers.actor_steps import (MiniBatchShuffler, loss_agg_mode, lr_schedule, over_mini_batches,
                                            packing_for)

CRITIC_SEED_OFFSET = 1  # the critic's mini-batch order and fresh head: a stream of their own


def critic_optimizer_settings(cfg: GRPOConfig):
    """critic_config's Adam and LR schedule, over as many optimizer steps as the actor's."""
    from mindspeed_rl.engines.optimizer_settings import OptimizerSettings

    c = cfg.critic_config
    return OptimizerSettings(lr=c.lr, min_lr=c.min_lr, weight_decay=c.weight_decay, adam_beta1=c.adam_beta1,
                             adam_beta2=c.adam_beta2, adam_eps=c.adam_eps, clip_grad=c.clip_grad,
                             schedule=lr_schedule(cfg, section=c),
                             use_distributed_optimizer=cfg.megatron_training.use_distributed_optimizer)


def build_critic(config: GRPOConfig, accelerator, options, *, parallel, model_dir: str,
                 progress: Callable[[str], None]):
    """The critic from critic_config.load (an HF reward model or causal LM) or else the actor's initial
    weights, in the actor's layout (`parallel`: this rank's RankGroups, the caller's); None without a
    critic_config."""
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
                          accelerator=accelerator, parallel=parallel, optimizer=critic_optimizer_settings(config),
                          options=options, head_seed=config.megatron_training.seed + CRITIC_SEED_OFFSET)
    progress("Megatron critic built")
    return critic


def critic_shuffler(config: GRPOConfig) -> MiniBatchShuffler:
    return MiniBatchShuffler(seed=config.megatron_training.seed + CRITIC_SEED_OFFSET,
                             shuffle=config.rl_config.shuffle_mini_batch)


def critic_values(critic, config: GRPOConfig, batch: RolloutBatch) -> torch.Tensor:
    """The critic's values of `batch` (this rank's share)."""
    return critic.compute_values(batch, micro_batch_size=config.critic_config.micro_batch_size,
                                 packing=packing_for(config.rl_config, "actor"))


def update_critic(critic, config: GRPOConfig, batch: RolloutBatch, shuffler: MiniBatchShuffler) -> dict[str, float]:
    """`epochs` passes over the batch in the actor's mini-batch size, one critic optimizer step per mini-batch, on
    the clipped value loss toward the batch's `returns` around its `values` (the rollout's), over the sampled tokens
    the rollout correction kept (the loss mask, as verl's critic reads its corrected response_mask)."""
    rl = config.rl_config
    mode = loss_agg_mode(rl)

    def step(mini_batch: RolloutBatch) -> dict[str, float]:
        mask = mini_batch.loss_mask()
        denominator = critic.over_data_parallel(count_loss_units(mask, mode, config.response_length_limit))
        tokens = critic.over_data_parallel(float(mask.sum()))

        def loss_fn(values: torch.Tensor, mb: MicroBatch):
            return clipped_value_loss(values, mb.extras["values"], mb.extras["returns"], mb.loss_mask(),
                                      cliprange_value=rl.cliprange_value, loss_agg_mode=mode, denominator=denominator,
                                      mini_batch_tokens=tokens)

        return critic.train_step(mini_batch, micro_batch_size=config.critic_config.micro_batch_size, loss_fn=loss_fn,
                                 packing=packing_for(rl, "update"))

    return over_mini_batches(batch, rl, shuffler, step, lr_key="critic/lr", data_parallel_size=critic.parallel.dp)[0]
