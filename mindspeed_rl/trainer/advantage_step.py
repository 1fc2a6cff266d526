"""The advantages of an iteration. Critic-free estimators (group_norm, rloo, reinforce_plus_plus and its baseline
form) read the outcome rewards only; PPO's (`adv_estimator: gae`, a critic_config) is trainer/critic_step.py's, with
the critic around it.
"""
from __future__ import annotations

from typing import Callable

from mindspeed_rl.algorithms.advantages import compute_advantages
from mindspeed_rl.algorithms.ppo import kl_controller
from mindspeed_rl.config import GRPOConfig
from mindspeed_rl.data.rewards import RuleRewards
from mindspeed_rl.protocol import RolloutBatch
from mindspeed_rl.workers.actor_group import ActorGroup


class AdvantageStep:
    """`estimate` writes the batch's advantages from the outcome rewards; `start_critic_update` has no critic to train
    (trainer/critic_step.py's CriticAdvantageStep has: PPO). `kl_coef`: a resumed run's KL coefficient (adaptive
    control)."""

    def __init__(self, config: GRPOConfig, actor_group: ActorGroup, *, kl_coef: float | None = None):
        rl = config.rl_config
        self.rl, self.actor_group = rl, actor_group
        self.kl = kl_controller(rl.kl_ctrl_type, init_kl_coef=rl.init_kl_coef if kl_coef is None else kl_coef,
                                kl_target=rl.kl_target, kl_horizon=rl.kl_horizon)

    @property
    def loss_kl_coef(self) -> float:
        """The KL coefficient of the actor's loss: 0 when the KL is in the reward instead."""
        return 0.0 if self.rl.use_kl_in_reward else self.rl.init_kl_coef

    @property
    def kl_coef(self) -> float:
        """The coefficient a checkpoint keeps (the adaptive controller's current one)."""
        return self.kl.value if self.rl.use_kl_in_reward else self.rl.init_kl_coef

    def estimate(self, batch: RolloutBatch, rewards: RuleRewards) -> dict[str, float]:
        batch.columns["advantages"] = compute_advantages(self.rl, rewards.total, batch.loss_mask())
        return {}

    def start_critic_update(self, batch: RolloutBatch) -> Callable[[], dict[str, float]]:
        return dict
