"""Each iteration's prompts and samples, by the run's rollout strategy (trainer/rollout_strategy.py): generated when
asked for, or, one-step off-policy (`async_generation_ratio: 1`, disaggregated), started on the inference ranks during
the update before; or, by a strategy that carries samples between iterations (partial rollout), from its carried
groups and the prompts it draws itself.

Every batch handed out has the TOKEN_VERSIONS column (protocol.py): the policy version that sampled each response
token, where version v is the weights after v updates (iteration i's update trains version i - 1)."""
from __future__ import annotations

import copy

from mindspeed_rl.config import GRPOConfig
from mindspeed_rl.data.dataset import PromptDataset, PromptSampler
from mindspeed_rl.protocol import TOKEN_VERSIONS, RolloutBatch, versions_column
from mindspeed_rl.trainer.rollout_strategy import RolloutStrategy, strategy_carries
from mindspeed_rl.workers.actor_group import ActorGroup


class Rollouts:
    def __init__(self, actor_group: ActorGroup, dataset: PromptDataset, sampler: PromptSampler, config: GRPOConfig,
                 strategy: RolloutStrategy, *, resumed_ahead: list | None = None, resumed_carried: dict | None = None):
        # One-step off-policy needs an AheadRollout (config/multi_turn.py refuses tool turns with it).
        assert strategy.runs_ahead or not config.rollout_staleness, "this rollout strategy cannot run ahead"
        self.actor_group, self.dataset, self.sampler, self.config = actor_group, dataset, sampler, config
        self.strategy = strategy
        self._ahead: list | None = None  # the prompts of the rollout started ahead
        self._sampler_before_ahead: PromptSampler | None = None
        self.ahead_result: list | None = None  # that rollout's per-rank results, once finished
        self.stale = False  # whether the last batch handed out was sampled ahead (the mismatch ledger re-scores it)
        if resumed_carried is not None:  # a checkpoint's carried samples (partial rollout), as they were then
            self.strategy.load_state_dict(resumed_carried)
        if resumed_ahead is not None:  # a checkpoint's: sampled by the weights before its own, as it was then
            self._sampler_before_ahead = copy.deepcopy(self.sampler)
            self._ahead, self.ahead_result = self._draw(), resumed_ahead

    def next(self, iteration: int, *, refill: int = 0) -> tuple[list, RolloutBatch, dict]:
        """(prompts, batch, metrics) of `iteration`; `refill` > 0: dynamic sampling's further rollouts of it."""
        if strategy_carries(self.strategy):  # it draws its own prompts, carried groups first
            prompts, batch, metrics = self.strategy.rollout(self.actor_group, self.sampler, self.dataset.records,
                                                            iteration, refill=refill)
            staleness = 0
        elif self._ahead is None:
            prompts, staleness = self._draw(), 0
            # Each refill its own sampling stream; refill 0 is the iteration's own (workers/actor_steps.sampling_seed).
            batch, metrics = self.strategy.generate(self.actor_group, _ids(prompts), iteration=(iteration, refill))
        else:
            results = self.finish_ahead()
            prompts, self._ahead, self.ahead_result = self._ahead, None, None
            batch, metrics = self.strategy.assemble(results, _ids(prompts))
            staleness = self.config.rollout_staleness
        metrics["rollout/staleness"] = staleness
        metrics.setdefault("rollout/resumed_samples", 0)
        # Sampled by the weights before this iteration's update, or, started ahead, by those `staleness` updates older.
        batch.columns.setdefault(TOKEN_VERSIONS, versions_column(batch, iteration - 1 - staleness))
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
    def carried_state(self) -> dict | None:
        """What a checkpoint keeps of the samples carried into the next iteration (partial rollout), or None."""
        return self.strategy.state_dict() if strategy_carries(self.strategy) else None

    @property
    def resume_sampler(self) -> PromptSampler:
        """The sampler a checkpoint saves: before the prompts of a rollout started ahead."""
        return self.sampler if self._ahead is None else self._sampler_before_ahead

    def _draw(self) -> list:
        return [self.dataset.records[index] for index in self.sampler.next_indices()]


def _ids(prompts: list) -> list[list[int]]:
    return [p.token_ids for p in prompts]
