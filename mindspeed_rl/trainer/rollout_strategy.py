"""One rollout strategy per run (slime's one rollout function per kind), chosen once from the config and used by
everything that rolls out: training's rollouts (trainer/rollouts.py: the sampler, the rollout started ahead, dynamic
sampling's refills) and the evaluation alike.

- `PlainRollout` (trainer/rollout.py): one generate over the inference ranks; it can run ahead (one-step off-policy).
- `ToolTurns` (trainer/multi_turn.py): turn by turn with the tools of rl_config.multi_turn_enable; never ahead.
- `PartialRollout` (trainer/partial_rollout.py): rl_config.partial_rollout_max_split > 1, each iteration's generation
  cut at max_tokens // N, unfinished samples carried and resumed first; it draws its own prompts (`carries_samples`),
  keeps the carried samples as its state, and evaluates with whole samples.

A new kind is a new strategy here, not a branch in the loop or the evaluation.
"""
from __future__ import annotations

from typing import Protocol

from mindspeed_rl.config import GRPOConfig
from mindspeed_rl.protocol import RolloutBatch
from mindspeed_rl.trainer.multi_turn import ToolTurns
from mindspeed_rl.trainer.partial_rollout import PartialRollout
from mindspeed_rl.trainer.rollout import PlainRollout
from mindspeed_rl.workers.actor_group import ActorGroup


class RolloutStrategy(Protocol):
    # Whether a rollout can be started now and finished later: then the strategy is also an AheadRollout.
    runs_ahead: bool

    def generate(self, actor_group: ActorGroup, prompt_ids: list[list[int]], *, iteration=None, n: int | None = None,
                 greedy: bool = False) -> tuple[RolloutBatch, dict]:
        """`n` samples of each prompt (default rl_config.n_samples_per_prompt), greedily for `greedy`; `iteration`
        keys the sampling seed (workers/actor_steps.sampling_seed). One prompt-major batch and the metrics."""


class AheadRollout(RolloutStrategy, Protocol):
    """A rollout in three steps, so that one-step off-policy can start it during the update before (and a
    checkpoint keep its ranks' results, finished, between the last two)."""

    def start(self, actor_group: ActorGroup, prompt_ids: list[list[int]], iteration=None) -> None:
        """The rollout started on the inference ranks, not waited for."""

    def finish(self, actor_group: ActorGroup) -> list:
        """The started rollout's per-rank results, waited for."""

    def assemble(self, results: list, prompt_ids: list[list[int]]) -> tuple[RolloutBatch, dict]:
        """Those results as one prompt-major batch and the metrics."""


def rollout_strategy(config: GRPOConfig, tokenizer) -> RolloutStrategy:
    """The run's strategy; the tokenizer turns tool outputs into tokens."""
    if config.rl_config.multi_turn_enable:
        return ToolTurns(config, tokenizer)
    if config.rl_config.partial_rollout_max_split > 1:  # config/partial_rollout.py refuses it with tool turns
        return PartialRollout(config)
    return PlainRollout(config)


def strategy_carries(strategy: RolloutStrategy) -> bool:
    """Whether `strategy` carries samples between iterations (partial rollout): it draws its own prompts, and a
    checkpoint keeps its state. A run without it drops what a partial-rollout checkpoint carried."""
    return getattr(strategy, "carries_samples", False)
