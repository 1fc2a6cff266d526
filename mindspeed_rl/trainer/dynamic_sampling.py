"""Each iteration's scored batch: one rollout scored, or with DAPO's dynamic sampling (`rl_config.filter_groups_*`)
rollouts until enough prompt groups teach something.

A group whose samples all score the same `filter_groups_metric` has zero advantage under group normalisation: it only
dilutes the batch (a group of one sample is kept, as verl and MindSpeed-RL keep it). Dynamic sampling drops such
groups and generates further rollouts of `global_batch_size` prompts (drawn from the same sampler, so a checkpoint
resumes after every prompt drawn, refills included) until `filter_groups_train_batch_size` prompts are kept; the
surplus of the last rollout is dropped, as in DAPO's reference (verl's dapo_ray_trainer). Past
`filter_groups_max_batches` rollouts the run stops with a message naming the keys, as the reference does.
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass, field

import torch

from mindspeed_rl.config import ConfigError, GRPOConfig
from mindspeed_rl.data.rewards import RuleRewards
from mindspeed_rl.protocol import RolloutBatch


@dataclass
class ScoredBatch:
    prompts: list
    batch: RolloutBatch
    rewards: RuleRewards
    correct: torch.Tensor  # bool [samples]: the exact answer
    metrics: dict = field(default_factory=dict)

    @property
    def accuracy(self) -> float:
        return self.correct.float().mean().item() if self.correct.numel() else 0.0

    def groups(self, keep: list[int], n: int) -> "ScoredBatch":
        """The samples of the prompt groups `keep` (prompt indices), in order."""
        rows = torch.tensor([g * n + j for g in keep for j in range(n)], dtype=torch.long)
        return ScoredBatch([self.prompts[g] for g in keep], self.batch.select(rows), self.rewards.select(rows),
                           self.correct[rows], self.metrics)


def concat(parts: list[ScoredBatch]) -> ScoredBatch:
    return ScoredBatch([q for p in parts for q in p.prompts], RolloutBatch.concat([p.batch for p in parts]),
                       RuleRewards.concat([p.rewards for p in parts]), torch.cat([p.correct for p in parts]),
                       parts[0].metrics)


def groups_with_spread(values: torch.Tensor, n: int) -> list[int]:
    """Indices of the prompt groups (n consecutive samples each) kept: those whose values are not all equal, and every
    group of one sample (verl's DAPO and MindSpeed-RL keep a group when its std > 0 or it has one sample: a lone
    sample's advantage does not come from its group's spread)."""
    grouped = values.reshape(-1, n)
    if n == 1:
        return list(range(len(grouped)))
    return (grouped != grouped[:, :1]).any(dim=1).nonzero().flatten().tolist()


class ScoredRollouts:
    def __init__(self, rollouts, scoring, config: GRPOConfig):
        self.rollouts, self.scoring, self.config = rollouts, scoring, config

    def next(self, iteration: int) -> ScoredBatch:
        if not self.config.rl_config.filter_groups_enable:
            return self._one(iteration, refill=0)
        return self._filled(iteration)

    def _one(self, iteration: int, *, refill: int) -> ScoredBatch:
        prompts, batch, metrics = self.rollouts.next(iteration, refill=refill)
        rewards, correct, score_metrics = self.scoring.score(prompts, batch)
        return ScoredBatch(prompts, batch, rewards, correct, metrics | score_metrics)

    def _filled(self, iteration: int) -> ScoredBatch:
        rl = self.config.rl_config
        n, wanted = rl.n_samples_per_prompt, rl.filter_groups_train_batch_size
        kept: list[ScoredBatch] = []
        metrics: dict[str, float] = {}
        kept_prompts = generated = uniform = 0
        for refill in itertools.count():
            scored = self._one(iteration, refill=refill)
            generated += len(scored.prompts)
            # The first rollout's figures, with every rollout's time added up.
            metrics |= {k: metrics.get(k, 0.0) + v if k.startswith("timing/") else metrics.get(k, v)
                        for k, v in scored.metrics.items()}
            spread = groups_with_spread(self._metric(scored), n)
            uniform += len(scored.prompts) - len(spread)
            keep = spread[: wanted - kept_prompts]
            if keep:
                kept.append(scored.groups(keep, n))
                kept_prompts += len(keep)
            if kept_prompts >= wanted:
                break
            if 0 < rl.filter_groups_max_batches <= refill + 1:
                raise DynamicSamplingExhausted(iteration, refill + 1, kept_prompts, wanted)
        out = concat(kept)
        out.metrics = metrics | {"dynamic_sampling/generated_prompts": generated,
                                 "dynamic_sampling/kept_prompts": kept_prompts,
                                 "dynamic_sampling/dropped_prompts": generated - kept_prompts,
                                 "dynamic_sampling/uniform_prompts": uniform,
                                 "dynamic_sampling/rollouts": refill + 1}
        return out

    def _metric(self, scored: ScoredBatch) -> torch.Tensor:
        metric = self.config.rl_config.filter_groups_metric
        if metric == "acc":
            return scored.correct.float()
        if metric == "reward":
            return scored.rewards.total
        return scored.rewards.per_verifier[metric]


class DynamicSamplingExhausted(ConfigError):
    """Too few prompt groups with any spread within filter_groups_max_batches rollouts: the data is too easy or
    too hard for the policy (DAPO's reference stops here too)."""

    def __init__(self, iteration: int, rollouts: int, kept: int, wanted: int):
        super().__init__("rl_config.filter_groups_max_batches",
                         f"iteration {iteration}: {rollouts} rollout(s) kept {kept} of the "
                         f"filter_groups_train_batch_size={wanted} prompts whose samples differ in "
                         f"filter_groups_metric; raise filter_groups_max_batches (<= 0: no limit) or check that the "
                         f"data is neither too easy nor too hard for the model")
