"""The mismatch ledger (issue 42 item 3): the train-vs-rollout log-prob gap of the sampled tokens, split by cause.

Five scores of the same sampled tokens, each a log-prob per token, make a chain from the rollout to the trainer:

* `L_roll`  vLLM's, returned with the samples (the weights version that sampled them);
* `L_now`   vLLM's re-score under the weights pushed now (the trainer's version): equal to `L_roll` by definition
            when the rollout is on-policy (staleness 0; no re-score is run);
* `L_exact` vLLM's re-score under the trainer's exact weights cast to vLLM's dtype: equal to `L_now` by definition
            when the push's fingerprints agree (resharding/fingerprint.py: every pushed range bit-equal, in vLLM's
            dtype);
* `L_rep`   Megatron's with every MoE router forced to the experts vLLM chose (routing replay's forward); equal to
            `L_old` by definition when the update replays them (rl_config.routing_replay) or the model has no MoE;
* `L_old`   Megatron's old log-probs (the separate pass, or the update's own first forward).

The buckets are the mean |difference| per sampled token of each link of the chain:

    staleness = mean |L_now - L_roll|      (sampled by an older policy version)
    push      = mean |L_exact - L_now|     (the pushed weights differ from the trained ones)
    numerics  = mean |L_rep - L_exact|     (the same weights and routes, another engine or dtype)
    routing   = mean |L_old - L_rep|       (MoE tokens sent to other experts than in the rollout)
    total     = staleness + push + numerics + routing

With a policy version per token (partial rollout's resumed tokens, `ages`: versions behind the trained policy), `L_now`
is the re-score where a token is older and `L_roll` where it is not (its sampler's weights are the trained ones), and
the staleness bucket is also split by age: `mismatch/staleness_age<k>`, the share of tokens k versions old (the shares
sum to the bucket).
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

CAUSES = ("staleness", "push", "numerics", "routing")


def _mean_abs(a: Tensor, b: Tensor, mask: Tensor, tokens: float) -> float:
    return ((a.double() - b.double()).abs() * mask).sum().item() / tokens


def mismatch_ledger(rollout_logprobs: Tensor, old_logprobs: Tensor, mask: Tensor, *,
                    rescored: Optional[Tensor] = None, exact: Optional[Tensor] = None, replayed: Optional[Tensor] = None,
                    stale: bool = False, weights_exact: bool = True, ages: Optional[Tensor] = None) -> dict[str, float]:
    """`mismatch/<cause>` and `mismatch/total` (mean |Δ log-prob| per sampled token, `mask`'s) of one batch.

    `rescored` is `L_now` (needed when `stale`; ignored when not: on-policy `L_now` is `L_roll`); `exact` is `L_exact`
    (optional); `replayed` is `L_rep` (None: `L_old`, no routing share); `weights_exact` whether the push's
    fingerprints agreed; `ages` each token's policy versions behind the trained one (None: all of them `stale`)."""
    if stale and rescored is None:
        raise ValueError("a stale rollout needs vLLM's re-score under the weights now pushed to split its mismatch")
    mask = mask.double()
    tokens = max(mask.sum().item(), 1.0)
    now = rescored if stale else rollout_logprobs
    if stale and ages is not None:  # a token sampled by the trained policy itself has L_now = L_roll by definition
        now = torch.where(ages > 0, rescored, rollout_logprobs)
    routing = 0.0 if replayed is None else _mean_abs(old_logprobs, replayed, mask, tokens)
    old_logprobs = old_logprobs if replayed is None else replayed  # the engine links end at the replayed forward
    staleness = _mean_abs(now, rollout_logprobs, mask, tokens) if stale else 0.0
    if exact is not None:
        push = 0.0 if weights_exact else _mean_abs(exact, now, mask, tokens)
        numerics = _mean_abs(old_logprobs, now if weights_exact else exact, mask, tokens)
    else:
        engine_gap = _mean_abs(old_logprobs, now, mask, tokens)
        push, numerics = (0.0, engine_gap) if weights_exact else (engine_gap, 0.0)
    buckets = {"staleness": staleness, "push": push, "numerics": numerics, "routing": routing}
    metrics = {f"mismatch/{cause}": value for cause, value in buckets.items()}
    metrics["mismatch/total"] = sum(buckets.values())
    if stale and ages is not None:
        metrics |= _staleness_by_age(now, rollout_logprobs, mask, ages, tokens)
    return metrics


def _staleness_by_age(now: Tensor, rollout_logprobs: Tensor, mask: Tensor, ages: Tensor,
                      tokens: float) -> dict[str, float]:
    """`mismatch/staleness_age<k>`: the staleness bucket's share of the tokens k >= 1 versions old."""
    # torch.unique, not a Python set: a batch at reasoning shapes holds millions of tokens
    present = [int(age) for age in torch.unique(ages[mask > 0]).tolist() if age > 0]
    return {f"mismatch/staleness_age{age}": _mean_abs(now, rollout_logprobs, mask * (ages == age), tokens)
            for age in present}


def ledger_from_gap(engine_gap: float, *, weights_exact: bool) -> dict[str, float]:
    """The ledger of an on-policy iteration whose engine gap (mean |L_old - L_roll|) was measured elsewhere (the
    update's own first forward gives the old log-probs: workers/actor_steps.train_on_mini_batch)."""
    push, numerics = (0.0, engine_gap) if weights_exact else (engine_gap, 0.0)
    return {"mismatch/staleness": 0.0, "mismatch/push": push, "mismatch/numerics": numerics, "mismatch/routing": 0.0,
            "mismatch/total": push + numerics}
