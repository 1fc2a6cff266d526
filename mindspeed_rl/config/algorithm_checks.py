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
    """Evaluation during training needs held-out prompts: a file, or a generated task's evaluation split."""
    rl, synthetic = config.rl_config, config.synthetic_data
    generated = synthetic is not None and synthetic.enabled
    if (rl.eval_interval or rl.eval_before_train) and config.megatron_training.eval_data_path is None \
            and not generated:
        raise ConfigError("megatron_training.eval_data_path", "must name the held-out prompts when "
                                                              "rl_config.eval_interval or eval_before_train is set "
                                                              "(a generated synthetic_data task has its own)")
    # One-step off-policy starts the next rollout before the update; an evaluation after that update would start a
    # second rollout on the inference ranks, which run one at a time. Before the first update, and after the last
    # (no rollout runs ahead of it), there is none.
    train_iters = config.megatron_training.train_iters
    if config.rollout_staleness and 0 < rl.eval_interval < train_iters:
        raise ConfigError("rl_config.eval_interval", f"is {rl.eval_interval}: an evaluation between updates needs the "
                                                     f"inference ranks, where one-step off-policy "
                                                     f"(async_generation_ratio: 1) runs the next rollout then; set "
                                                     f"0 or >= megatron_training.train_iters={train_iters} "
                                                     f"(eval_before_train evaluates before the first update), or "
                                                     f"async_generation_ratio: 0")


def check_dynamic_sampling(config) -> None:
    """Dynamic sampling refills after scoring: synchronous runs only."""
    if config.rl_config.filter_groups_enable and config.rollout_staleness:
        raise ConfigError("rl_config.filter_groups_enable", "dynamic sampling refills a rollout after scoring it: "
                                                            "it runs synchronously (async_generation_ratio: 0)")


def check_mismatch_ledger(config) -> None:
    """The ledger splits what it can measure (algorithms/mismatch.py): the push bucket is the fingerprint check's
    verdict."""
    if not config.rl_config.mismatch_ledger:
        return
    if not config.generate_config.check_weights_after_switch:
        raise ConfigError("rl_config.mismatch_ledger", "needs generate_config.check_weights_after_switch: true (its "
                                                       "push bucket is the weight fingerprints' verdict)")


def check_routing_replay(config) -> None:
    """vLLM records the routes of the positions it computes (engines/vllm_routing.py): prompt blocks served from its
    prefix cache have none, and a multi-turn rollout's turns are separate requests."""
    if not config.rl_config.routing_replay:
        return
    if config.generate_config.enable_prefix_caching:
        raise ConfigError("rl_config.routing_replay", "needs generate_config.enable_prefix_caching: false (prompt "
                                                      "blocks served from the prefix cache carry no recorded routes)")
    if config.rl_config.multi_turn_enable:
        raise ConfigError("rl_config.routing_replay", "replays single-turn rollouts (a multi-turn rollout's turns are "
                                                      "separate vLLM requests; their routes are not joined yet)")


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
