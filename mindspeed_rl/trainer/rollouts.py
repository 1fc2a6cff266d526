"""Each iteration's prompts and samples, by the run's rollout strategy (trainer/rollout_strategy.py): generated when
asked for, or, one-step off-policy (`async_generation_ratio: 1`, disaggregated), started on the inference ranks during
the update before."""
from __future__ import annotations

import copy

from mindspeed_rl.config import GRPOConfig
from mindspeed_rl.data.dataset import PromptDataset, PromptSampler
from mindspeed_rl.protocol import RolloutBatch
from mindspeed_rl.trainer.rollout_strategy import RolloutStrategy
from mindspeed_rl.workers.actor_group import ActorGroup


class Rollouts:
    def __init__(self, actor_group: ActorGroup, dataset: PromptDataset, sampler: PromptSampler, config: GRPOConfig,
                 strategy: RolloutStrategy, *, resumed_ahead: list | None = None):
        # One-step off-policy needs an AheadRollout (config/multi_turn.py refuses tool turns with it).
        assert strategy.runs_ahead or not config.rollout_staleness, "this rollout strategy cannot run ahead"
        self.actor_group, self.dataset, self.sampler, self.config = actor_group, dataset, sampler, config
        self.strategy = strategy
        self._ahead: list | None = None  # the prompts of the rollout started ahead
        self._sampler_before_ahead: PromptSampler | None = None
        self.ahead_result: list | None = None  # that rollout's per-rank results, once finished
        self.stale = False  # whether the last batch handed out was sampled ahead (the mismatch ledger re-scores it)
        if resumed_ahead is not None:  # a checkpoint's: sampled by the weights before its own, as it was then
            self._sampler_before_ahead = copy.deepcopy(self.sampler)
            self._ahead, self.ahead_result = self._draw(), resumed_ahead

    def next(self, iteration: int, *, refill: int = 0) -> tuple[list, RolloutBatch, dict]:
        """(prompts, batch, metrics) of `iteration`; `refill` > 0: dynamic sampling's further rollouts of it."""
        if self._ahead is None:
            prompts, staleness = self._draw(), 0
            # Each refill its own sampling stream; refill 0 is the iteration's own (workers/actor_steps.sampling_seed).
            batch, metrics = self.strategy.generate(self.actor_group, _ids(prompts), iteration=(iteration, refill))
        else:
            results = self.finish_ahead()
            prompts, self._ahead, self.ahead_result = self._ahead, None, None
            batch, metrics = self.strategy.assemble(results, _ids(prompts))
            staleness = self.config.rollout_staleness
        metrics["rollout/staleness"] = staleness
        self.stale = bool(staleness)
        return prompts, batch, metrics

    def start_ahead(self, iteration: int) -> None:
        """Start `iteration`'s rollout now where the run is one-step off-policy (and that iteration runs)."""
        if not self.config.rollout_staleness or iteration > self.config.megatron_training.train_iters:
            return
        self._sampler_before_ahead = copy.deepcopy(self.sampler)  # a checkpoint now resumes at those prompts
        self._ahead = self._draw()
        self.strategy.start(self.actor_group, _ids(self._ahead), iteration)

    def finish_ahead(self) -> list | None:
        """The rollout started ahead, waited for (a checkpoint keeps it: its weights are gone after the update)."""
        if self._ahead is not None and self.ahead_result is None:
            self.ahead_result = self.strategy.finish(self.actor_group)
        return self.ahead_result

    @property
    def resume_sampler(self) -> PromptSampler:
        """The sampler a checkpoint saves: before the prompts of a rollout started ahead."""
        return self.sampler if self._ahead is None else self._sampler_before_ahead

    def _draw(self) -> list:
        return [self.dataset.records[index] for index in self.sampler.next_indices()]


def _ids(prompts: list) -> list[list[int]]:
    return [p.token_ids for p in prompts]
