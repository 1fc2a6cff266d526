"""The mismatch ledger's own measurements (rl_config.mismatch_ledger, docs/mismatch.md), a step beside the advantage
step, built only when the ledger is on; trainer/metrics.ledger_metrics splits the gap from the columns it writes:

- `replayed_logprobs`: the actor's log-probs with vLLM's recorded routes forced (MoE where the update does not replay
  them: the routing share), after the old log-probs;
- `rescored_logprobs`: vLLM's log-probs of a rollout sampled ahead (one-step off-policy), re-scored under the
  weights that train it (the staleness share): started with the next rollout, before the update, and waited for
  after it.
"""
from __future__ import annotations

from mindspeed_rl.config import GRPOConfig
from mindspeed_rl.protocol import ROUTES_COLUMN, RolloutBatch
from mindspeed_rl.trainer.rollout import forward_logprobs, padded_rows, response_ids
from mindspeed_rl.workers.actor_group import ActorGroup, merge_shards


class NoMeasurement:
    """The ledger off: nothing measured beyond what training needs."""

    def replay_routes(self, batch: RolloutBatch) -> dict[str, float]:
        return {}

    def start_rescore(self, batch: RolloutBatch, *, stale: bool) -> None:
        pass

    def finish_rescore(self, batch: RolloutBatch) -> dict[str, float]:
        return {}


class MismatchLedgerStep(NoMeasurement):
    def __init__(self, config: GRPOConfig, actor_group: ActorGroup):
        self.config, self.actor_group = config, actor_group
        self._rescoring = False  # a re-score started (start_rescore), not yet waited for

    def replay_routes(self, batch: RolloutBatch) -> dict[str, float]:
        """The routing share's pass, where vLLM recorded routes that the update does not replay; it needs the separate
        old-log-prob pass too (the update would otherwise give them): that pass's metrics."""
        if ROUTES_COLUMN not in batch.columns or self.config.rl_config.routing_replay:
            return {}
        metrics = {}
        if "old_logprobs" not in batch.columns:
            batch.columns["old_logprobs"], metrics = forward_logprobs(self.actor_group, "compute_log_prob", batch)
        batch.columns["replayed_logprobs"], _ = forward_logprobs(self.actor_group, "compute_replayed_log_prob", batch)
        return metrics

    def start_rescore(self, batch: RolloutBatch, *, stale: bool) -> None:
        """vLLM's re-score of `batch` where it was sampled ahead (`stale`), under the weights that train it: pushed for
        the next rollout (started just before), or for the re-score alone after the last one."""
        if not stale:
            return
        prompts = [row[:length].tolist() for row, length in zip(batch.input_ids, batch.prompt_lengths)]
        self.actor_group.start_score(prompts, response_ids(batch))
        self._rescoring = True

    def finish_rescore(self, batch: RolloutBatch) -> dict[str, float]:
        """The re-score, waited for, as `batch`'s `rescored_logprobs` column."""
        if not self._rescoring:
            return {}
        self._rescoring = False
        results = self.actor_group.finish_score()
        rows = [values for shard in merge_shards([s for s, _ in results]) for values in shard.value]
        batch.columns["rescored_logprobs"] = padded_rows(rows, batch.response_logprobs_shape)
        return {"timing/rescore": results[0][1].get("timing/rescore", 0.0)}


def measurement_step(config: GRPOConfig, actor_group: ActorGroup) -> NoMeasurement:
    return MismatchLedgerStep(config, actor_group) if config.rl_config.mismatch_ledger else NoMeasurement()
