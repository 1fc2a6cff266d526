"""Checks and derived figures of partial rollout (rl_config.partial_rollout_max_split, require_max_age_all_finished,
async_engine: MindSpeed-RL's keys and defaults; the strategy is trainer/partial_rollout.py), across sections; `config`
is the GRPOConfig (not imported here: it imports the modules that import this one).

What it is not implemented with yet is refused at start in one line naming why, never found out mid-run.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from mindspeed_rl.errors import ConfigError, raise_together

SPLIT_KEY = "rl_config.partial_rollout_max_split"
POOL_BATCHES = 2  # global batches of prompt groups in flight (MindSpeed-RL: td_max_len = 2 x global_batch_size)
# The driver keeps a carried sample's response as three packed arrays (trainer/partial_rollout.CarriedSample): per
# token an int32 id, an fp32 log-prob and an int32 version, 12 B, and an array's over-allocation of at most 1/16.
CARRIED_BYTES_PER_TOKEN = 13


def partial_rollout_on(config) -> bool:
    return config.rl_config.partial_rollout_max_split > 1


def runs_ahead(config) -> bool:
    """Run-ahead (async_engine with partial rollout): the generate stops once a global batch of groups is complete,
    not at chunk boundaries."""
    return partial_rollout_on(config) and config.rl_config.async_engine is True


def chunk_tokens(config) -> int:
    """The response tokens one iteration generates for a sample (MindSpeed-RL's max_tokens // N); run-ahead: what its
    budget has left (the stop cuts it)."""
    max_tokens = config.generate_config.sampling_config.max_tokens
    return max_tokens if runs_ahead(config) else max_tokens // config.rl_config.partial_rollout_max_split


def max_token_age(config) -> int:
    """The declared bound: versions a trained token may lag the policy being updated. One-step off-policy: 1. Partial
    rollout: N - 1 where a sample at that age is generated to its end (require_max_age_all_finished); without that,
    the age at which its chunks alone reach max_tokens (N - 1 where N divides max_tokens); run-ahead: N - 1 either
    way (its generate does not stop while a group at that age is unfinished). Otherwise 0."""
    if not partial_rollout_on(config):
        return config.rollout_staleness
    rl = config.rl_config
    if rl.require_max_age_all_finished or runs_ahead(config):
        return rl.partial_rollout_max_split - 1
    return math.ceil(config.generate_config.sampling_config.max_tokens / chunk_tokens(config)) - 1


@dataclass(frozen=True, kw_only=True)
class CarriedBound:
    """The most partial rollout carries from one iteration into the next: a pool of POOL_BATCHES global batches of
    groups trains one, so at most one global batch of groups is carried, each unfinished sample holding at most
    max_tokens - max_tokens // N response tokens (its next chunk would reach max_tokens)."""
    samples: int
    response_tokens: int
    host_bytes: int  # in the driver (carried_samples.json holds the same lists as JSON)
    reprefill_tokens: int  # prompt + response prefix the next iteration's vLLM prefills again, at most

    def line(self) -> str:
        from mindspeed_rl.sizes import format_bytes

        return (f"[plan] partial rollout: at most {self.samples} samples carried into the next iteration "
                f"({self.response_tokens} response tokens, {format_bytes(self.host_bytes)} of the driver's host "
                f"memory); their resume re-prefills at most {self.reprefill_tokens} prompt + prefix tokens")


def carried_bound(config) -> CarriedBound | None:
    """The planner's figure for the carried samples (None: partial rollout off)."""
    if not partial_rollout_on(config):
        return None
    samples = (POOL_BATCHES - 1) * config.megatron_training.global_batch_size * config.rl_config.n_samples_per_prompt
    max_tokens = config.generate_config.sampling_config.max_tokens
    prefix = max_tokens - 1 if runs_ahead(config) else max_tokens - chunk_tokens(config)
    return CarriedBound(samples=samples, response_tokens=samples * prefix,
                        host_bytes=samples * prefix * CARRIED_BYTES_PER_TOKEN,
                        reprefill_tokens=samples * (config.rl_config.max_prompt_length + prefix))


def check_partial_rollout(config) -> None:
    rl = config.rl_config
    if not isinstance(rl.partial_rollout_max_split, int) or rl.partial_rollout_max_split < 1:
        raise ConfigError(SPLIT_KEY, f"must be an integer >= 1 (1: off), got {rl.partial_rollout_max_split!r}")
    for key in ("require_max_age_all_finished", "async_engine"):
        if not isinstance(getattr(rl, key), bool):
            raise ConfigError(f"rl_config.{key}", f"must be true or false, got {getattr(rl, key)!r}")
    if not partial_rollout_on(config):
        return
    max_tokens = config.generate_config.sampling_config.max_tokens
    if rl.partial_rollout_max_split > max_tokens:
        raise ConfigError(SPLIT_KEY, f"is {rl.partial_rollout_max_split}: each cut generates max_tokens // N tokens, "
                                     f"at least one (generate_config.sampling_config.max_tokens={max_tokens})")
    raise_together([ConfigError(key, f"is not implemented with {SPLIT_KEY} > 1 yet: {why}")
                    for key, why in _refused(config)])


def _refused(config) -> list[tuple[str, str]]:
    """(key, why) of every combination partial rollout does not support yet."""
    rl, refused = config.rl_config, []
    if config.rollout_staleness:
        refused.append(("async_generation_ratio", "a rollout started during the update before cannot hold the samples "
                                                  "that update's batch leaves behind (one-step off-policy keeps no "
                                                  "carried samples)"))
    if rl.multi_turn_enable:
        refused.append(("rl_config.multi_turn_enable", "a sample cut inside a tool turn has no resume point"))
    if rl.routing_replay:
        refused.append(("rl_config.routing_replay", "a resumed sample's prefix is re-prefilled under newer weights, "
                                                    "so vLLM records the new routes, not those it sampled with"))
    return refused
