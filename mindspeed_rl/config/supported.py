"""What the engine runs today of the resource plans config/resources.py builds: the roles on the devices it can start
them on, reward roles of the kinds it has. Anything else was parsed and checked there and is refused here, naming the
key."""
from __future__ import annotations

from collections.abc import Mapping

from mindspeed_rl.config.critic import critic_roles_on_training_devices
from mindspeed_rl.config.distillation import teacher_roles_on_training_devices
from mindspeed_rl.config.device_mapping import format_devices
from mindspeed_rl.config.resources import DISAGGREGATED, INFER_ROLE, ResourcePlan
from mindspeed_rl.config.role_sections import RewardResources
from mindspeed_rl.errors import ConfigError


def check_supported(plan: ResourcePlan, rewards: Mapping[str, RewardResources]) -> None:
    """What the engine runs today: actor_train and reference on devices 0..N-1 (N the actor's world size);
    actor_infer on the same devices (colocated) or on the next ones, N..N+M-1 (disaggregated); rule rewards
    in the driver or on CPU workers. Anything else was parsed and checked by build_resource_plan and is
    refused here, naming the key."""
    train, infer = plan.role("actor_train"), plan.role(INFER_ROLE)
    expected = tuple(range(plan.world_size))
    if train.devices != expected:
        raise ConfigError(train.source,
                          f"must be list(range(0,{plan.world_size})) today, got {format_devices(train.devices)}: the "
                          f"engine starts its {plan.world_size} ranks on the devices Ray gives it; choosing which "
                          "devices is not supported yet")
    if plan.mode == DISAGGREGATED:
        following = tuple(range(plan.world_size, plan.world_size + len(infer.devices)))
        if infer.devices != following:
            raise ConfigError(infer.source,
                              f"must be the devices after actor_train's, list(range({following[0]},{following[-1] + 1})), "
                              f"got {format_devices(infer.devices)}: disaggregated ranks are started training ranks "
                              "first, then inference ranks, on the devices Ray gives them")
    shared_roles = (("reference",) if plan.mode == DISAGGREGATED else ("actor_infer", "reference"))
    shared_roles += critic_roles_on_training_devices(plan) + teacher_roles_on_training_devices(plan)
    for key in shared_roles:
        role = plan.role(key)
        if role.devices != train.devices:
            raise ConfigError(role.source,
                              f"must be actor_train's devices ({format_devices(train.devices)}) today, got "
                              f"{format_devices(role.devices)}: roles that share only some devices are not "
                              f"supported yet (the {key} runs on the training ranks)")
    models = [name for name, section in rewards.items() if section.is_model]
    for name in models:
        # A reward model is colocated: built on the actor's ranks in its TP/PP layout, time-shared.
        key, role = f"rewards.{name}", plan.role(f"rewards.{name}")
        if plan.mode == DISAGGREGATED:
            raise ConfigError(f"{key}.model_path", "a reward model runs colocated with actor_train, actor_infer and "
                                                   "the reference; disaggregated roles with a reward model are not "
                                                   "supported yet")
        if role.devices != train.devices:
            raise ConfigError(f"{key}.device_mapping",
                              f"must be actor_train's devices ({format_devices(train.devices)}) or left out, got "
                              f"{format_devices(role.devices)}: a reward model runs on the actor's ranks in its "
                              "TP/PP layout, taking turns with the other roles")
    if len(models) > 1:
        raise ConfigError(f"rewards.{models[1]}.model_path",
                          f"one reward model is supported: rewards.{models[0]} has one already")
    rules = [name for name in rewards if name not in models]
    for name in rules:
        if rewards[name].device_mapping is not None:
            raise ConfigError(f"rewards.{name}.device_mapping",
                              "rule verifiers run on CPU workers (world_size), not on devices; a reward role on "
                              "devices is a reward model (model_path)")
    if len(rules) > 1:
        raise ConfigError(f"rewards.{rules[1]}",
                          f"one rule-reward role is supported yet: the verifiers of rl_config.verifier_function run "
                          f"in rewards.{rules[0]}; per-role verifiers are not supported")
