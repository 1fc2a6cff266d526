"""PPO's critic on devices of its own (ROLL's `critic.device_mapping` apart from actor_train's).

Its ranks are a Ray group of their own (the `critic` role of workers/roles.py: the critic part alone, the actor's
TP x PP, its states always resident since nothing else uses its devices), with their own torch.distributed world.
`ActorWithOwnCritic` puts that group beside the actor's group (colocated or disaggregated) behind the one
`ActorGroup` protocol: the RPCs the critic part declares go to the critic's ranks, everything else to the actor's, so
the trainer is the same whichever placement runs it; only the critic's update may run during the actor's
(trainer/advantage_step.py).
"""
from __future__ import annotations

import time
from typing import Any

from mindspeed_rl.workers.actor_group import ActorGroup, CompositeGroup


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
        self.critic.note_ranks()
        actor_metrics[0] = {**actor_metrics[0], "timing/initialize": time.perf_counter() - started}
        return actor_metrics + critic_metrics

    def call(self, method: str, *args: Any, blocking: bool = True, **kwargs: Any) -> list[Any]:
        return self._group(method).call(method, *args, blocking=blocking, **kwargs)

    def wait(self, method: str, refs: list) -> list[Any]:
        return self._group(method).wait(method, refs)

    def _group(self, method: str):
        return self.member_for(method)

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
