"""Start the actor's ranks: the one factory of the three rank groups (workers/actor_group.py).

One rank process and nothing that needs Ray: the rank runs in this process (`LocalActorGroup`,
`runtime.local_single_rank`). Otherwise Ray places the ranks: one group switching between roles
(colocated, `RayActorGroup`) or a training and an inference group (`DisaggregatedActor`); PPO's critic and
distillation's teacher on devices of their own are one more group each beside either (`ActorWithOwnGroups`,
workers/own_groups.py). Faults asked for
by the failure tests (`MINDSPEED_RL_INJECT_FAULT`, workers/fault_injection.py) are applied here, once, to
whichever worker classes the group runs.
"""
from __future__ import annotations

import os
from typing import Callable

from mindspeed_rl.workers import roles
from mindspeed_rl.workers.actor_group import ActorGroup
from mindspeed_rl.workers.fault_injection import FAULT_ENV_VAR, FAULT_LOG_ENV_VAR, worker_class_with_faults
from mindspeed_rl.workers.processes import rank_env_vars


def start_actor_group(config, *, device: str, model_dir: str, ref_model_dir: str, threads: int, in_process: bool,
                      on_hang: Callable[[str], None] | None = None) -> ActorGroup:
    """The actor's ranks, started (their engines are built by `initialize`)."""
    fault = os.environ.get(FAULT_ENV_VAR)
    env_vars = rank_env_vars(threads) | {name: os.environ[name] for name in (FAULT_ENV_VAR, FAULT_LOG_ENV_VAR)
                                         if os.environ.get(name)}
    common = dict(config=config, env_vars=env_vars, model_dir=model_dir, ref_model_dir=ref_model_dir)
    if in_process:
        from mindspeed_rl.workers.local_group import LocalActorGroup

        return LocalActorGroup(worker_class=worker_class_with_faults(fault, roles.actor_worker(config)),
                               threads=threads, on_hang=on_hang, **common)
    actor = _start_ray_actor(fault=fault, device=device, **common)
    own_roles = roles.own_device_workers(config)  # (rank class, world size) of each part on devices of its own
    if not own_roles:
        return actor
    from mindspeed_rl.workers.group import RayActorGroup
    from mindspeed_rl.workers.own_groups import ActorWithOwnGroups

    own = []
    try:
        for worker_class, world_size in own_roles:
            own.append(RayActorGroup(worker_class=worker_class_with_faults(fault, worker_class), device=device,
                                     world_size=world_size, **common))
    except BaseException:
        for group in [*own, actor]:
            group.kill()
        raise
    return ActorWithOwnGroups(actor, *own)


def _start_ray_actor(*, fault: str | None, device: str, **common) -> ActorGroup:
    """The actor's ranks under Ray: one group switching between roles, or a training and an inference group."""
    config = common["config"]
    if config.disaggregated:
        from mindspeed_rl.workers.disaggregated import DisaggregatedActor

        train, infer = roles.disaggregated_workers(config)
        return DisaggregatedActor(train_worker_class=worker_class_with_faults(fault, train),
                                  infer_worker_class=worker_class_with_faults(fault, infer), device=device, **common)
    from mindspeed_rl.workers.group import RayActorGroup

    return RayActorGroup(worker_class=worker_class_with_faults(fault, roles.actor_worker(config)), device=device,
                         **common)
