"""Parts on devices of their own: PPO's critic (ROLL's `critic.device_mapping`) and on-policy distillation's teacher
(`teacher.device_mapping`), each apart from actor_train's.

Each is a Ray group of its own (the `critic` or `teacher` role of workers/roles.py: that part alone, its states always
resident since nothing else uses its devices), with its own torch.distributed world: the critic in the actor's TP x PP,
the teacher in its own. `ActorWithOwnGroups` puts those groups beside the actor's group (colocated or disaggregated)
behind the one `ActorGroup` protocol: the RPCs a member's parts declare go to that member's ranks, everything else to
the actor's, so the trainer is the same whichever placement runs it; only the critic's update may run during the
actor's (trainer/advantage_step.py).
"""
from __future__ import annotations

import time
from typing import Any

from mindspeed_rl.workers.actor_group import ActorGroup, CompositeGroup


class ActorWithOwnGroups(CompositeGroup):
    """`ActorGroup` over the actor's group and the groups of parts on devices of their own (critic, teacher)."""

    def __init__(self, actor: ActorGroup, *own: Any):
        self.actor, self.own = actor, tuple(own)
        self.addresses = actor.addresses + [address for group in own for address in group.addresses]
        self.member_groups = (actor, *own)

    def initialize(self) -> list[dict[str, float]]:
        """All build their engines at once."""
        started = time.perf_counter()
        pending = [(group, group.call("initialize", blocking=False)) for group in self.own]
        actor_metrics = self.actor.initialize()
        own_metrics = []
        for group, refs in pending:
            own_metrics += group.wait("initialize", refs)
            group.note_ranks()
        actor_metrics[0] = {**actor_metrics[0], "timing/initialize": time.perf_counter() - started}
        return actor_metrics + own_metrics

    def call(self, method: str, *args: Any, blocking: bool = True, **kwargs: Any) -> list[Any]:
        return self.member_for(method).call(method, *args, blocking=blocking, **kwargs)

    def wait(self, method: str, refs: list) -> list[Any]:
        return self.member_for(method).wait(method, refs)

    def shutdown(self) -> None:
        self._each_then_actor("shutdown")

    def kill(self) -> None:
        self._each_then_actor("kill")

    def _each_then_actor(self, method: str) -> None:
        try:
            for group in self.own:
                try:
                    getattr(group, method)()
                except BaseException:
                    if method != "kill":
                        raise
        finally:
            getattr(self.actor, method)()
