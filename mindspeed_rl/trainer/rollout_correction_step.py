"""Rollout correction on an iteration's batch (rl_config.rollout_correction; algorithms/rollout_correction.py): after
the old log-probs, before the advantages, as verl's trainer places it."""
from __future__ import annotations

from mindspeed_rl.algorithms.rollout_correction import rollout_correction
from mindspeed_rl.protocol import LOSS_MASK, RolloutBatch


def correct_rollout(batch: RolloutBatch, rl) -> dict[str, float]:
    """The rejected tokens leave the batch's loss mask (so the advantages, the loss and its denominators skip them);
    the truncated IS weights become the `rollout_is_weights` column the update's loss reads. Returns the
    `rollout_corr/` metrics; nothing when the correction is off."""
    config = rl.rollout_correction
    if not config.enabled:
        return {}
    weights, kept, metrics = rollout_correction(batch.columns["old_logprobs"], batch.columns["rollout_logprobs"],
                                                batch.loss_mask(), config)
    batch.columns[LOSS_MASK] = kept
    if weights is not None:
        batch.columns["rollout_is_weights"] = weights
    return metrics
