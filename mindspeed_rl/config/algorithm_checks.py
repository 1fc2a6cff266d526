"""Checks of the algorithm options that span sections (rl_config against the lengths, the model, the data and
the rollout mode), run by GRPOConfig after its layout checks; `config` is the GRPOConfig (not imported here: it
imports this module)."""
from __future__ import annotations

from mindspeed_rl.errors import ConfigError
from mindspeed_rl.config.tolerated import longest_sample_tokens


def check_packing(config) -> None:
    """rl_config.use_remove_padding against the lengths, the dropout and the model."""
    rl = config.rl_config
    if not rl.use_remove_padding:
        return
    longest = longest_sample_tokens(config)
    for phase, (budget, _) in rl.packing_budgets.items() if rl.use_dynamic_bsz else ():
        # Without a reference (init_kl_coef 0: DAPO) nothing reads the reference's budget, there either.
        if budget < longest and (phase != "ref" or config.uses_reference):
            own = f"{phase}_max_packing_token_size"
            key = own if getattr(rl, own) is not None else "max_packing_token_size"
            raise ConfigError(f"rl_config.{key}", f"must be >= the longest sample, min(rl_config.max_prompt_length "
                                                  f"+ {config.response_length_key}, generate_config.max_model_len) = "
                                                  f"{longest} (a sample is never split), got {budget}")
    if config.megatron_training.attention_dropout > 0:
        raise ConfigError("megatron_training.attention_dropout", "must be 0 with rl_config.use_remove_padding: "
                                                                 "packed attention runs without dropout")


def check_evaluation(config) -> None:
    """Evaluation during training needs held-out prompts."""
    rl, synthetic = config.rl_config, config.synthetic_data
    generated = synthetic is not None and synthetic.enabled and synthetic.task == "math_word"
    if (rl.eval_interval or rl.eval_before_train) and config.megatron_training.eval_data_path is None \
            and not generated:
        raise ConfigError("megatron_training.eval_data_path", "must name the held-out prompts when "
                                                              "rl_config.eval_interval or eval_before_train is set "
                                                              "(the generated math_word task has its own)")


def check_dynamic_sampling(config) -> None:
    """Dynamic sampling refills after scoring: synchronous runs only."""
    if config.rl_config.filter_groups_enable and config.rollout_staleness:
        raise ConfigError("rl_config.filter_groups_enable", "dynamic sampling refills a rollout after scoring it: "
                                                            "it runs synchronously (async_generation_ratio: 0)")


def check_recompute_layers(config) -> None:
    """Megatron's uniform recompute runs chunks of recompute_num_layers layers of each pipeline stage: the
    chunk must tile every stage (Megatron itself fails with an IndexError otherwise)."""
    actor, arch = config.actor_config, config.selected_model
    if actor.recompute_method != "uniform" or arch is None:
        return
    try:
        stages = _stage_layer_counts(actor, arch.num_layers)
    except ValueError:
        return  # check_num_layer_list reports it
    if any(count % actor.recompute_num_layers for count in stages):
        shown = stages[0] if len(set(stages)) == 1 else "/".join(map(str, stages))
        raise ConfigError("actor_config.recompute_num_layers", f"must divide the {shown} layers of each pipeline "
                                                               f"stage with recompute_method uniform, got "
                                                               f"{actor.recompute_num_layers}")


def _stage_layer_counts(actor, num_layers: int) -> tuple[int, ...]:
    from mindspeed_rl.models.pipeline_stages import stage_layer_range

    pp = actor.pipeline_model_parallel_size
    stages = actor.pipeline_stage_layers
    return tuple(len(stage_layer_range(num_layers, rank, pp, stages)) for rank in range(pp))


def check_num_layer_list(config) -> None:
    """actor_config.num_layer_list: one positive count per pipeline stage, adding up to the model's layers."""
    actor, arch = config.actor_config, config.selected_model
    if actor.num_layer_list is None or arch is None:
        return
    from mindspeed_rl.models.pipeline_stages import parse_num_layer_list

    key, pp = "actor_config.num_layer_list", actor.pipeline_model_parallel_size
    try:
        counts = parse_num_layer_list(actor.num_layer_list)
    except ValueError:
        raise ConfigError(key, f"must be comma-separated layer counts, one per pipeline stage, got "
                               f"{actor.num_layer_list!r}") from None
    if len(counts) != pp or sum(counts) != arch.num_layers or min(counts) < 1:
        raise ConfigError(key, f"must list {pp} stages (pipeline_model_parallel_size) of at least one layer, "
                               f"adding up to the model's {arch.num_layers} layers, got {list(counts)}")


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
