"""PPO's critic on devices of its own (ROLL's `critic.device_mapping` apart from actor_train's).

Its ranks are a Ray group of their own (`CriticWorkerBase`: Megatron, the actor's TP x PP, the critic only, its
states always resident since nothing else uses its devices), with their own torch.distributed world.
`ActorWithOwnCritic` puts that group beside the actor's group (colocated or disaggregated) behind the one
`ActorGroup` protocol: the critic's RPCs go to the critic's ranks, everything else to the actor's, so the trainer is
the same whichever placement runs it; only the critic's update may run during the actor's (trainer/advantage_step.py).
"""
from __future__ import annotations

import time
from typing import Any

from mindspeed_rl.workers import critic_steps
from mindspeed_rl.workers.actor_group import ActorGroup, CompositeGroup
from mindspeed_rl.workers.actor_hybrid_worker import ActorHybridWorkerBase

CRITIC_ROLE = "critic"
# What the critic's ranks answer; every other call is the actor's.
CRITIC_METHODS = frozenset({"compute_values", "update_critic", "save_critic_checkpoint", "load_critic_checkpoint"})


class CriticWorkerBase(ActorHybridWorkerBase):
    """A rank of the critic on its own devices: the value model, its gradients and Adam states, nothing else."""

    ROLE, GENERATES = CRITIC_ROLE, False

    def _build_training_side(self, started: float) -> None:
        from mindspeed_rl.engines.critic import register_critic_states
        from mindspeed_rl.workers import engine_builders as build

        options = build.model_options(self.config, self.accelerator, announce=False)
        self.critic = critic_steps.build_critic(self.config, self.accelerator, options, model_dir=self.model_dir,
                                                progress=lambda step: self._progress(f"critic ranks: {step}", started))
        register_critic_states(self.offloader, self.critic)


class ActorWithOwnCritic(CompositeGroup):
    """`ActorGroup` over the actor's group and the critic's group."""

    def __init__(self, actor: ActorGroup, critic):
        self.actor, self.critic = actor, critic
        self.addresses = actor.addresses + critic.addresses
        self.member_groups = (actor, critic)

    def initialize(self) -> list[dict[str, float]]:
        """Both build their engines at once."""
        started = time.perf_counter()
        pending = self.critic.call("initialize", blocking=False)
        actor_metrics = self.actor.initialize()
        critic_metrics = self.critic.wait("initialize", pending)
        self.critic.shm_segments.update(name for names in self.critic.call("shm_segments") for name in names)
        actor_metrics[0] = {**actor_metrics[0], "timing/initialize": time.perf_counter() - started}
        return actor_metrics + critic_metrics

    def call(self, method: str, *args: Any, blocking: bool = True, **kwargs: Any) -> list[Any]:
        return self._group(method).call(method, *args, blocking=blocking, **kwargs)

    def wait(self, method: str, refs: list) -> list[Any]:
        return self._group(method).wait(method, refs)

    def _group(self, method: str):
        return self.critic if method in CRITIC_METHODS else self.actor

    def start_generate(self, prompt_token_ids: list[list[int]], iteration: int | tuple[int, ...] | None = None, *,
                       n: int | None = None, greedy: bool = False, max_tokens: list[int] | None = None) -> None:
        self.actor.start_generate(prompt_token_ids, iteration, n=n, greedy=greedy, max_tokens=max_tokens)

    def finish_generate(self) -> list[Any]:
        return self.actor.finish_generate()

    def shutdown(self) -> None:
        try:
            self.critic.shutdown()
        finally:
            self.actor.shutdown()

    def kill(self) -> None:
        try:
            self.critic.kill()
        finally:
            self.actor.kill()
