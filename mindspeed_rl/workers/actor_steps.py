"""What one rank does in `update` and how the run's optimizer is set up: the mini-batch order, one GRPO optimizer
step on this rank's share of a mini-batch, the LR schedule over the run."""
from __future__ import annotations

import torch

from mindspeed_rl.algorithms.grpo import GRPOLossConfig, count_loss_units, grpo_loss
from mindspeed_rl.algorithms.rollout_correction import rollout_mismatch
from mindspeed_rl.config import GRPOConfig
from mindspeed_rl.protocol import TEACHER_COLUMN, TEACHER_TOPK_COLUMN, MicroBatch, Packing, RolloutBatch


class MiniBatchShuffler:
    """The order in which `update` cuts a rollout batch into mini-batches (one optimizer step each).

    Seeded once per worker from megatron_training.seed; every call continues the same stream, so
    iterations and epochs get different permutations and a run is reproducible from the seed.
    Each DP rank orders its own share of the batch (workers/dispatch.py); mini-batch k of an update is the DP ranks'
    k-th mini-batches together (verl's split). Every rank seeds it alike and calls it equally often, so the ranks of
    one TP x CP x PP block cut their (same) share alike.
    """

    def __init__(self, *, seed: int, shuffle: bool):
        self.shuffle = shuffle
        self.generator = torch.Generator().manual_seed(seed)

    def order(self, num_samples: int) -> torch.Tensor:
        if not self.shuffle:
            return torch.arange(num_samples)
        return torch.randperm(num_samples, generator=self.generator)


def sampling_seed(seed: int, iteration: int | tuple[int, int], stream: int) -> int:
    """The sampling seed of one iteration's stream (an inference-DP rank): independent streams from
    numpy's SeedSequence. `iteration` may be (iteration, refill): dynamic sampling's further rollouts of one
    iteration draw their own streams (refill 0 is the iteration's plain seed)."""
    import numpy as np

    key = list(iteration) if isinstance(iteration, (tuple, list)) else [iteration]
    key = key[:1] if key[1:] == [0] else key
    return int(np.random.SeedSequence([seed, key[0], stream, *key[1:]]).generate_state(1)[0] & 0x7FFFFFFF)


def train_on_mini_batch(engine, mini_batch: RolloutBatch, loss_config: GRPOLossConfig, *, micro_batch_size: int,
                        temperature: float, packing: Packing | None = None, distill=None,
                        key_data=None) -> dict[str, float]:
    """One GRPO optimizer step on `mini_batch`, this DP rank's share of the DP ranks' mini-batch.

    The loss is normalised by the whole mini-batch's count (summed over the DP ranks), the token-mean stats by its
    tokens; the engine sums the per-rank stats over DP, so the returned stats are the mini-batch's. `distill`
    (distillation.distillation_loss, where the run distills) adds the teacher's term (algorithms/distillation.py).
    `key_data` (msprobe_config.key_data_dump, workers/stage_probe.py) gets each micro-batch's loss inputs and terms.
    """
    denominator = engine.over_data_parallel(
        count_loss_units(mini_batch.loss_mask(), loss_config.loss_agg_mode, loss_config.norm_length))
    tokens = engine.over_data_parallel(float(mini_batch.loss_mask().sum()))

    def loss_fn(logprobs: torch.Tensor, entropy: torch.Tensor, mb: MicroBatch,
                student_topk_logprobs: torch.Tensor | None = None):
        old_logprobs, on_policy_stats = mb.extras.get("old_logprobs"), {}
        if old_logprobs is None:  # on-policy (GRPOConfig.old_logprobs_from_update): this forward's own values
            old_logprobs = logprobs.detach()
            rollout_logprobs = mb.extras.get("rollout_logprobs")
            if rollout_logprobs is not None:  # the separate pass's metric, measured here
                on_policy_stats = rollout_mismatch(rollout_logprobs, old_logprobs, mb.loss_mask(), tokens)
        advantages = mb.extras["advantages"]
        if distill is not None and not distill.use_task_rewards:  # verl: the task-reward loss is zeroed
            advantages = torch.zeros_like(advantages)
        loss, stats = grpo_loss(
            logprobs=logprobs, old_logprobs=old_logprobs, ref_logprobs=mb.extras.get("ref_logprobs"),
            advantages=advantages, response_mask=mb.loss_mask(), entropy=entropy,
            config=loss_config, loss_scale_denominator=denominator, mini_batch_tokens=tokens,
            is_weights=mb.extras.get("rollout_is_weights"),
        )
        if key_data is not None:  # their actor loss functions' MsProbe.save_data, in their names
            key_data({"old_log_prob": old_logprobs, "log_prob": logprobs, "ref_log_prob": mb.extras.get("ref_logprobs"),
                      "advantages": advantages, "loss": loss, "kl_loss": torch.tensor(stats["actor/kl_loss"])})
        if distill is not None:
            loss, stats = _with_distillation(loss, stats, distill, logprobs, old_logprobs, mb, loss_config,
                                             denominator, tokens, student_topk_logprobs)
        return loss, stats | on_policy_stats

    return engine.train_step(mini_batch, micro_batch_size=micro_batch_size,
                             temperature=temperature, loss_fn=loss_fn, packing=packing)


def _with_distillation(task_loss, stats: dict, distill, logprobs, old_logprobs, mb: MicroBatch,
                       loss_config: GRPOLossConfig, denominator: float, tokens: float, student_topk_logprobs=None):
    """verl's total: policy_loss + distillation_loss_coef x distillation loss with task rewards, the distillation
    loss alone without (its coefficient then has no effect, as in verl)."""
    from mindspeed_rl.algorithms.distillation import distillation_update_loss
    from mindspeed_rl.algorithms.grpo import aggregate_loss

    mask = mb.loss_mask()
    teacher_topk = mb.extras.get(TEACHER_TOPK_COLUMN)  # [b, R, 1 + 2k]: the log-probs of its top k are 1 .. k
    loss, distill_stats = distillation_update_loss(
        logprobs=logprobs, old_logprobs=old_logprobs, teacher_logprobs=mb.extras[TEACHER_COLUMN],
        response_mask=mask, settings=distill, mini_batch_tokens=tokens, student_topk_logprobs=student_topk_logprobs,
        teacher_topk_logprobs=None if teacher_topk is None else teacher_topk[..., 1:1 + distill.topk],
        aggregate=lambda values: aggregate_loss(values, mask, loss_config.loss_agg_mode, denominator))
    coef = distill.distillation_loss_coef if distill.use_task_rewards else 1.0
    return task_loss + coef * loss, stats | distill_stats


def dpo_mini_batch_step(config: GRPOConfig, engine, packing: Packing | None):
    """DPO's optimizer step on a pair-major mini-batch share (rows 2i, 2i+1: a pair's chosen and rejected, with the
    reference's log-probs in the `ref_logprobs` column): the loss of algorithms/dpo.py, as a mean over the DP ranks'
    pairs. actor_config.micro_batch_size counts pairs, as MindSpeed-LLM's does."""
    from mindspeed_rl.algorithms.dpo import dpo_loss, dpo_loss_config

    loss_config = dpo_loss_config(config.megatron_training)

    def step(mini_batch: RolloutBatch) -> dict[str, float]:
        pairs = engine.over_data_parallel(len(mini_batch) / 2)

        def loss_fn(logprobs: torch.Tensor, entropy: torch.Tensor, mb: MicroBatch,
                student_topk_logprobs: torch.Tensor | None = None):
            return dpo_loss(logprobs, mb.extras["ref_logprobs"], mb.loss_mask(), loss_config, pairs_in_mini_batch=pairs)

        # Temperature 1: DPO scores given responses, nothing was sampled.
        return engine.train_step(mini_batch, micro_batch_size=2 * config.actor_config.micro_batch_size,
                                 temperature=1.0, loss_fn=loss_fn, packing=packing)

    return step


def over_mini_batches(batch: RolloutBatch, rl, shuffler: MiniBatchShuffler, step, *, lr_key: str,
                      data_parallel_size: int) -> tuple[dict[str, float], int]:
    """`rl.epochs` passes over `batch` (this rank's share) in its shares of mini-batches of
    `rl.mini_batch_size_in_samples` in the shuffler's order, step(mini_batch) -> stats, one optimizer step each (the
    actor's update, the critic's). Returns the mean stats, with `lr_key` the rate the last step used (not a mean),
    and the number of steps."""
    size = rl.mini_batch_size_in_samples // data_parallel_size
    steps: list[dict[str, float]] = []
    for _ in range(rl.epochs):
        order = shuffler.order(len(batch))
        for first in range(0, len(batch), size):
            steps.append(step(batch.select(order[first:first + size])))
    metrics = {k: sum(s[k] for s in steps) / len(steps) for k in steps[0]}
    metrics[lr_key] = steps[-1][lr_key]
    return metrics, len(steps)


def loss_config_for(config: GRPOConfig, kl_coef: float) -> GRPOLossConfig:
    """The update's loss from rl_config: clip-higher's eps_high when clip_higher_enable (MindSpeed-RL's
    clip_ratio_low/high, else clip_ratio both ways), the aggregation loss_agg_mode or else token_level_loss's."""
    rl = config.rl_config
    low, high = (rl.clip_ratio_low, rl.clip_ratio_high) if rl.clip_higher_enable else (rl.clip_ratio, None)
    return GRPOLossConfig(clip_ratio=low, clip_ratio_high=high, kl_penalty=rl.kl_penalty, kl_coef=kl_coef,
                          entropy_coeff=rl.entropy_coeff, loss_agg_mode=loss_agg_mode(rl),
                          norm_length=config.response_length_limit, clip_ratio_c=rl.clip_ratio_c)


def loss_agg_mode(rl) -> str:
    """rl_config.loss_agg_mode, else token_level_loss's: the aggregation of the actor's and the critic's losses."""
    return rl.loss_agg_mode or ("token-mean" if rl.token_level_loss else "seq-mean-token-mean")


def packing_for(rl, phase: str) -> Packing | None:
    """How `phase` (config.rl.PACKING_PHASES) cuts its micro-batches: None padded (rl_config.use_remove_padding
    off), packed by sample count, or with use_dynamic_bsz by the phase's token budget."""
    if not rl.use_remove_padding:
        return None
    if not rl.use_dynamic_bsz:
        return Packing()
    max_tokens, max_samples = rl.packing_budgets[phase]
    return Packing(max_tokens=max_tokens, max_samples=max_samples)


def optimizer_steps_per_iteration(cfg: GRPOConfig) -> int:
    """`update` takes one step per mini-batch of the rollout, `epochs` times."""
    rl = cfg.rl_config
    samples = (rl.train_prompts_per_iteration or cfg.megatron_training.global_batch_size) * rl.n_samples_per_prompt
    return -(-samples // rl.mini_batch_size_in_samples) * rl.epochs


def lr_schedule(cfg: GRPOConfig, section=None):
    """The run's LR schedule over all its optimizer steps (train_iters x steps per iteration), by `section`'s
    decay style and warmup (default actor_config; the critic passes critic_config)."""
    from mindspeed_rl.engines.optimizer_settings import LRSchedule

    a = section or cfg.actor_config
    total_steps = cfg.megatron_training.train_iters * optimizer_steps_per_iteration(cfg)
    return LRSchedule(decay_style=a.lr_decay_style, warmup_steps=a.lr_warmup_fraction * total_steps,
                      decay_steps=total_steps)


def optimizer_settings(cfg: GRPOConfig):
    from mindspeed_rl.engines.optimizer_settings import OptimizerSettings

    a = cfg.actor_config
    return OptimizerSettings(lr=a.lr, min_lr=a.min_lr, weight_decay=a.weight_decay, adam_beta1=a.adam_beta1,
                             adam_beta2=a.adam_beta2, adam_eps=a.adam_eps, clip_grad=a.clip_grad,
                             schedule=lr_schedule(cfg),
                             use_distributed_optimizer=cfg.megatron_training.use_distributed_optimizer)
