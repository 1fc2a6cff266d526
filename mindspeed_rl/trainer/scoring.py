"""The samples' rewards, one way for training and evaluation alike: the rule verifiers (in this process, or on the CPU
reward workers), the reward model's weighted score on the actor's ranks, the tool-call bonus of multi-turn tool use
and DAPO's overlong shaping; and the exact-answer accuracy."""
from __future__ import annotations

import torch

from mindspeed_rl.config import GRPOConfig
from mindspeed_rl.data.rewards import RuleRewards, compute_rule_rewards, correct_answers
from mindspeed_rl.protocol import RolloutBatch
from mindspeed_rl.trainer.multi_turn import with_tool_call_bonus
from mindspeed_rl.trainer.reward_model import model_score_metrics, with_model_scores
from mindspeed_rl.trainer.rollout import decode_responses, forward_logprobs
from mindspeed_rl.workers.actor_group import ActorGroup


class Scoring:
    """The samples' rewards: the rule verifiers (in this process, or on the CPU reward workers), plus the
    reward model's weighted score on the actor's ranks; and the exact-answer accuracy."""

    def __init__(self, config: GRPOConfig, tokenizer, actor_group: ActorGroup, reward_group=None):
        self.config, self.tokenizer, self.actor_group, self.reward_group = config, tokenizer, actor_group, reward_group

    def score(self, prompts: list, batch: RolloutBatch, *, n: int | None = None) -> tuple[RuleRewards, torch.Tensor, dict]:
        """The rewards, whether each sample's answer is exact (bool [samples]) and the scoring's metrics; `n`
        samples per prompt (default rl_config.n_samples_per_prompt; an evaluation's eval_n_samples)."""
        rl = self.config.rl_config
        responses = decode_responses(self.tokenizer, batch)
        labels = [p.label for p in prompts for _ in range(n or rl.n_samples_per_prompt)]
        metrics: dict[str, float] = {}
        if self.reward_group is None:
            rewards = compute_rule_rewards(responses, labels, rl.verifier_function, rl.verifier_weight,
                                           timeout_seconds=rl.verifier_timeout_seconds)
        else:  # in parallel on the CPU workers; a failed sample scores 0 and is counted
            rewards, metrics["reward_workers/failed_samples"] = self.reward_group.score(responses, labels)
        if self.config.reward_model is not None:  # on the actor's ranks, in the residency table's `reward` phase
            scores, model_metrics = forward_logprobs(self.actor_group, "compute_reward_scores", batch)
            rewards = with_model_scores(rewards, scores, self.config.reward_model[1].model_weight)
            metrics |= model_metrics | model_score_metrics(scores)
        if rl.multi_turn_enable:
            rewards = with_tool_call_bonus(rewards, batch, rl)
        if rl.overlong_buffer_enable:
            rewards = self._with_overlong_penalty(rewards, batch, metrics)
        return rewards, torch.tensor(correct_answers(responses, labels, rl.verifier_function), dtype=torch.bool), metrics

    def _with_overlong_penalty(self, rewards: RuleRewards, batch: RolloutBatch, metrics: dict) -> RuleRewards:
        """DAPO's soft overlong punishment added to the total (algorithms/dapo.py)."""
        from mindspeed_rl.algorithms.dapo import overlong_penalty

        rl = self.config.rl_config
        penalty = overlong_penalty(batch.response_mask.sum(dim=1), max_length=rl.rollout_max_tokens,
                                   buffer=rl.overlong_buffer, factor=rl.overlong_buffer_penalty_factor)
        metrics["reward/overlong_penalty/mean"] = penalty.mean().item()
        metrics["reward/overlong_penalty/share"] = (penalty < 0).float().mean().item()
        return RuleRewards(total=rewards.total + penalty, per_verifier=rewards.per_verifier)
