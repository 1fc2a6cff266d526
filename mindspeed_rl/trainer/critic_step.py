"""PPO's advantages (adv_estimator gae, a critic_config): the critic's values of the rollout, the outcome score on the
last response token and, with `use_kl_in_reward`, the KL to the reference on every token (its coefficient fixed or
adaptive), GAE; the critic then trains toward the returns after the actor's update, or during it where it has devices
of its own."""
from __future__ import annotations

from typing import Callable

from mindspeed_rl.algorithms.grpo import masked_mean
from mindspeed_rl.algorithms.ppo import (apply_kl_penalty, explained_variance, gae_advantages_and_returns,
                                         token_level_rewards)
from mindspeed_rl.config import GRPOConfig
from mindspeed_rl.data.rewards import RuleRewards
from mindspeed_rl.protocol import RolloutBatch
from mindspeed_rl.trainer.advantage_step import AdvantageStep
from mindspeed_rl.trainer.rollout import forward_logprobs
from mindspeed_rl.workers.actor_group import ActorGroup, merge_metrics


class CriticAdvantageStep(AdvantageStep):
    def __init__(self, config: GRPOConfig, actor_group: ActorGroup, *, kl_coef: float | None = None):
        super().__init__(config, actor_group, kl_coef=kl_coef)
        self.critic_has_own_devices = config.critic_has_own_devices

    def estimate(self, batch: RolloutBatch, rewards: RuleRewards) -> dict[str, float]:
        values, metrics = forward_logprobs(self.actor_group, "compute_values", batch)
        token_rewards = token_level_rewards(rewards.total, batch.response_mask)
        if self.rl.use_kl_in_reward:
            token_rewards, current_kl = apply_kl_penalty(
                token_rewards, batch.columns["old_logprobs"], batch.columns["ref_logprobs"], batch.response_mask,
                kl_coef=self.kl.value, kind=self.rl.kl_penalty)
            metrics |= {"critic/reward_kl": current_kl, "critic/kl_coef": self.kl.value}
            self.kl.update(current_kl, n_steps=len(batch))
        # The sampled tokens less those the rollout correction rejected (verl overwrites response_mask before
        # compute_advantage): GAE passes over them, the whitening and the critic's loss skip them; a reward on a
        # rejected last token is lost, as there.
        mask = batch.loss_mask()
        advantages, returns = gae_advantages_and_returns(token_rewards, values, mask, gamma=self.rl.gamma,
                                                         lam=self.rl.lam)
        batch.columns.update(advantages=advantages, returns=returns, values=values)
        return metrics | {"critic/values/mean": masked_mean(values, mask).item(),
                          "critic/returns/mean": masked_mean(returns, mask).item(),
                          "critic/explained_variance": explained_variance(values, returns, mask)}

    def start_critic_update(self, batch: RolloutBatch) -> Callable[[], dict[str, float]]:
        """The critic's update toward the batch's returns; the returned call finishes it and gives its metrics. On
        devices of its own the critic trains while the actor's update runs (both read only the batch); sharing the
        training ranks, it trains when finished, after the actor's update."""
        if self.critic_has_own_devices:
            pending = self.actor_group.call("update_critic", batch, blocking=False)
            return lambda: merge_metrics(self.actor_group.wait("update_critic", pending))
        return lambda: merge_metrics(self.actor_group.call("update_critic", batch))

