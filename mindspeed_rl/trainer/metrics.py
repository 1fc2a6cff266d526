"""Per-iteration metrics under MindSpeed-RL's names, computed from the batch and the phase timings.

Pure functions of the batch, tensors and floats: the loop collects, these name, derive and print.
"""
from __future__ import annotations

import torch

from mindspeed_rl.algorithms.mismatch import ledger_from_gap, mismatch_ledger
from mindspeed_rl.algorithms.rollout_correction import rollout_mismatch
from mindspeed_rl.memory.residency import RECORDED_PHASES
from mindspeed_rl.protocol import TOKEN_VERSIONS, token_ages

# MindSpeed-RL's timing names, each made of the phases our workers time (ROLL's per-RPC timings).
RESHARDING_TO_INFER_PARTS = ("timing/resharding_enter_infer", "timing/resharding_exit_infer")
RESHARDING_TO_TRAIN_PARTS = ("timing/onload_forward", "timing/onload_train")


def length_stats(name: str, lengths: torch.Tensor) -> dict[str, float]:
    """`{name}/mean`, `/min`, `/max` of integer lengths (MindSpeed-RL's response_length/*, prompt_length/*)."""
    values = lengths.to(torch.float64)
    return {f"{name}/mean": values.mean().item(), f"{name}/min": values.min().item(),
            f"{name}/max": values.max().item()}


def throughput(*, prompt_lengths: torch.Tensor, response_lengths: torch.Tensor, world_size: int,
               seconds_all: float, seconds_rollout: float, seconds_update: float,
               use_max_lengths: bool) -> dict[str, float]:
    """Tokens per second per device, MindSpeed-RL's formula (utils.compute_tps):
    `(response_len + prompt_len) * samples / world_size / seconds`, lengths as means, or as maxima with
    `rl_config.log_max_throughput` (which overstates: padding is not work)."""
    reduce = torch.max if use_max_lengths else torch.mean
    tokens_per_sample = (reduce(prompt_lengths.to(torch.float64)) + reduce(response_lengths.to(torch.float64))).item()
    tokens_per_device = tokens_per_sample * len(prompt_lengths) / world_size

    def per_second(seconds: float) -> float:
        return tokens_per_device / seconds if seconds > 0 else 0.0

    return {"e2e_tps": per_second(seconds_all), "vllm_tps": per_second(seconds_rollout),
            "update_tps": per_second(seconds_update)}


def phase_timings(metrics: dict[str, float]) -> dict[str, float]:
    """MindSpeed-RL's `timing/update`, `timing/resharding_to_infer`, `timing/resharding_to_train` from ours."""
    return {
        "timing/update": metrics.get("timing/update/total", 0.0),
        "timing/resharding_to_infer": sum(metrics.get(key, 0.0) for key in RESHARDING_TO_INFER_PARTS),
        "timing/resharding_to_train": sum(metrics.get(key, 0.0) for key in RESHARDING_TO_TRAIN_PARTS),
    }


def reward_metrics(total: torch.Tensor, per_verifier: dict[str, torch.Tensor], accuracy: float) -> dict[str, float]:
    metrics = {"reward/mean": total.mean().item(), "reward/accuracy": accuracy}
    for name, scores in per_verifier.items():
        metrics[f"{name}_rewards/mean"] = scores.mean().item()
    return metrics


def iteration_metrics(config, batch, phase_metrics: dict, rewards, accuracy_value: float) -> dict:
    """Everything derived from the iteration's batch, rewards and phase timings."""
    response_lengths, prompt_lengths = batch.response_mask.sum(1).long(), batch.prompt_lengths
    metrics = reward_metrics(rewards.total, rewards.per_verifier, accuracy_value)
    metrics |= length_stats("response_length", response_lengths) | length_stats("prompt_length", prompt_lengths)
    # Over the sampled tokens: a multi-turn rollout's tool outputs have no vLLM log-prob. Without a separate old
    # log-prob pass the update measured it (workers/actor_steps.train_on_mini_batch).
    if "old_logprobs" in batch.columns:
        metrics |= rollout_mismatch(batch.columns["rollout_logprobs"], batch.columns["old_logprobs"], batch.loss_mask())
    metrics["actor/old_logprobs_from_update"] = float("old_logprobs" not in batch.columns)
    if TOKEN_VERSIONS in batch.columns:  # the iteration's update trains the policy of version iteration - 1
        metrics |= token_age_metrics(batch, policy_version=phase_metrics["iteration"] - 1)
    if config.rl_config.mismatch_ledger:
        metrics |= ledger_metrics(batch, phase_metrics, policy_version=phase_metrics["iteration"] - 1)
    metrics |= phase_timings(phase_metrics)
    metrics |= throughput(prompt_lengths=prompt_lengths, response_lengths=response_lengths,
                          world_size=config.num_rank_processes, seconds_all=phase_metrics["timing/all"],
                          seconds_rollout=phase_metrics.get("timing/rollout", 0.0),
                          seconds_update=metrics["timing/update"],
                          use_max_lengths=config.rl_config.log_max_throughput)
    if "actor/grad_norm" in phase_metrics:
        metrics["grad_norm"] = phase_metrics["actor/grad_norm"]
    return metrics


def token_age_metrics(batch, *, policy_version: int) -> dict[str, float]:
    """`rollout/token_age_mean`, `/max`: policy versions each trained response token lags the policy being updated
    (0 on-policy; one-step off-policy 1; partial rollout's resumed tokens up to its bound)."""
    trained = batch.loss_mask() > 0
    ages = token_ages(batch, policy_version)[trained].to(torch.float64)
    if not ages.numel():
        return {"rollout/token_age_mean": 0.0, "rollout/token_age_max": 0.0}
    return {"rollout/token_age_mean": ages.mean().item(), "rollout/token_age_max": ages.max().item()}


def ledger_metrics(batch, phase_metrics: dict, *, policy_version: int) -> dict[str, float]:
    """The mismatch ledger of an iteration (config/algorithm_checks.check_mismatch_ledger): staleness from vLLM's re-score
    of a rollout sampled ahead or of a partial rollout's older tokens (none on-policy), by each token's age; the
    fingerprint check passed (the push raises otherwise), so no push; routing from Megatron's forward on vLLM's routes
    (MoE without replay); the rest is the engines' numerics. Where the update gave the old log-probs, its own measure of
    the gap (workers/actor_steps.train_on_mini_batch)."""
    if "old_logprobs" in batch.columns:
        rescored = batch.columns.get("rescored_logprobs")  # under the trained weights, where a token is older
        ages = token_ages(batch, policy_version) if TOKEN_VERSIONS in batch.columns else None
        return mismatch_ledger(batch.columns["rollout_logprobs"], batch.columns["old_logprobs"], batch.loss_mask(),
                               rescored=rescored, stale=rescored is not None, ages=ages,
                               replayed=batch.columns.get("replayed_logprobs"), weights_exact=True)
    return ledger_from_gap(phase_metrics["rollout/logprob_mean_abs_diff"], weights_exact=True)


def format_line(m: dict) -> str:
    phases = ("rollout", "resharding_to_infer", "update")
    seconds = " ".join(f"{p}={m.get('timing/' + p, 0.0):.2f}s" for p in phases)
    # ROLL's automatic mode moves states around every call; its cost summed over the phases.
    for stage in ("onload", "offload"):
        spent = sum(m.get(f"timing/{p}/{stage}", 0.0) for p in RECORDED_PHASES)
        seconds += f" {stage}={spent:.2f}s"
    if "timing/resharding_fingerprint" in m:  # what the exact-weights check costs, inside resharding_to_infer
        seconds += f" fingerprint={m['timing/resharding_fingerprint']:.3f}s"
    if m.get("rollout/staleness"):
        seconds += f" stale={m['rollout/staleness']}"
    memory = " ".join(f"{p}={m[f'memory/{p}/total_bytes'] / 2**20:.0f}MiB"
                      for p in RECORDED_PHASES if f"memory/{p}/total_bytes" in m)
    # on-policy distillation: the student's per-token KL to its teacher (algorithms/distillation.py)
    distill = f"distill_kl={m['distill/kl_mean']:.4f} " if "distill/kl_mean" in m else ""
    return (f"[iter {m['iteration']:>4}] reward={m['reward/mean']:.3f} acc={m['reward/accuracy']:.3f} "
            f"kl={m.get('actor/kl_loss', 0.0):.4f} {distill}lp_diff={m['rollout/logprob_max_abs_diff']:.1e} "
            f"resp_len={m['response_length/mean']:.1f} e2e_tps={m['e2e_tps']:.0f} "
            f"total={m['timing/all']:.2f}s {seconds} | device {memory}")
