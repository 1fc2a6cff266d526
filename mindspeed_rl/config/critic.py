"""PPO's critic in the config (critic_config, rl_config.critic_resource, ROLL's `critic` role): where its ranks are and
the checks that it agrees with the actor. `config` is the GRPOConfig (not imported here: it imports this module)."""
from __future__ import annotations

from mindspeed_rl.config.device_mapping import own_devices_follow
from mindspeed_rl.errors import ConfigError


def critic_has_own_devices(config) -> bool:
    """PPO's critic on devices of its own (ROLL's `critic.device_mapping` apart from actor_train's): its ranks
    are a group of their own, training while the actor does; otherwise it takes turns on the training ranks."""
    if config.critic_config is None:
        return False
    plan = config.resource_plan
    return not set(plan.role("critic").devices) & set(plan.role("actor_train").devices)


def critic_world_size(config) -> int:
    """The critic's ranks: its own devices', or the training ranks it shares."""
    return len(config.resource_plan.role("critic").devices) if critic_has_own_devices(config) else config.world_size


def own_critic_ranks(config) -> int:
    """The rank processes the critic adds: its own devices', 0 where it shares the training ranks (or is absent)."""
    return critic_world_size(config) if critic_has_own_devices(config) else 0


def check_critic(config) -> None:
    """PPO: adv_estimator gae and critic_config come together; the critic shares the actor's ranks and layout."""
    rl, critic, actor = config.rl_config, config.critic_config, config.actor_config
    if (rl.adv_estimator == "gae") != (critic is not None):
        raise ConfigError("critic_config" if critic is None else "rl_config.adv_estimator",
                          "adv_estimator gae (PPO) needs a critic_config section, and a critic_config needs "
                          f"adv_estimator gae; got adv_estimator {rl.adv_estimator!r}"
                          f"{' and no' if critic is None else ' and a'} critic_config")
    if critic is None:
        if config.critic is not None:
            raise ConfigError("critic", "a critic role needs a critic_config section (PPO, adv_estimator gae)")
        return
    for name in ("tensor_model_parallel_size", "pipeline_model_parallel_size", "expert_model_parallel_size",
                 "num_layer_list"):
        if getattr(critic, name) != getattr(actor, name):
            raise ConfigError(f"critic_config.{name}", f"must equal actor_config.{name}={getattr(actor, name)!r}: "
                                                       f"the critic is colocated with the actor and shares its "
                                                       f"parallel groups, got {getattr(critic, name)!r}")
    if critic.model not in config.model and config.model:
        raise ConfigError("critic_config.model", f"must name a block under `model` ({', '.join(config.model)}), "
                                                 f"got {critic.model!r}")
    # The critic shares the training ranks (disaggregated: actor_train's, beside the reference), or has its own.
    resource, world = rl.critic_resource, config.critic_world_size
    if resource is not None and resource.num_npus != world:
        where = "its own devices (critic.device_mapping)" if config.critic_has_own_devices else \
            "the actor's devices (colocated; a critic of its own is given by critic.device_mapping, ROLL's role)"
        raise ConfigError("rl_config.critic_resource.num_npus", f"must equal the critic's {world} devices, "
                                                                f"{where}, got {resource.num_npus}")
    if config.critic_has_own_devices:
        _check_critic_ranks(config)
    arch = config.model.get(critic.model)
    if arch is not None and arch.num_experts:
        raise ConfigError("critic_config.model", "a MoE critic is not supported (dense Qwen2/Qwen3 only)")


def _check_critic_ranks(config) -> None:
    """A critic on devices of its own: the actor's TP x PP over its ranks, its data-parallel share of a mini-batch."""
    actor, critic, world = config.actor_config, config.critic_config, config.critic_world_size
    model_parallel = actor.tensor_model_parallel_size * actor.pipeline_model_parallel_size
    if world % model_parallel:
        raise ConfigError("critic.device_mapping", f"gives the critic {world} devices, which the actor's tensor x "
                                                   f"pipeline parallel size {model_parallel} must divide")
    dp, mini_samples = world // model_parallel, config.rl_config.mini_batch_size_in_samples
    if mini_samples % (dp * critic.micro_batch_size):
        raise ConfigError("critic_config.micro_batch_size",
                          f"the critic's data-parallel size * micro_batch_size = {dp} * {critic.micro_batch_size} must "
                          f"divide the mini-batch of {mini_samples} samples")


def critic_roles_on_training_devices(plan) -> tuple[str, ...]:
    """("critic",) where a critic shares the training devices (it must have all of them), else (); a critic on
    devices of its own must take those after every other role's."""
    if not any(role.key == "critic" for role in plan.roles):
        return ()
    # Its own devices come before a teacher's of its own.
    return () if own_devices_follow(plan, "critic", later=("teacher",)) else ("critic",)


def critic_role_sections(config) -> dict:
    """The critic's resource section for the plan (None: the actor's devices), present with a critic_config or a
    `critic` section."""
    return {"critic": config.critic} if config.critic_config is not None or config.critic is not None else {}
