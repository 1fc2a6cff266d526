"""The parallel layout's checks against the world size and the selected model block (GRPOConfig.check_layout);
`config` is the GRPOConfig (not imported here: it imports this module)."""
from __future__ import annotations

import math

from mindspeed_rl.config.checks import require_divides
from mindspeed_rl.errors import ConfigError
from mindspeed_rl.config.model_arch import ModelArchConfig

WORLD_DESC_KEY = "rl_config.actor_resource.num_npus"


# Each size, with the sizes before it in Megatron's rank order, must divide the actor's devices.
_TRAIN_PRODUCTS = (
    ("pipeline_model_parallel_size", ("tensor_model_parallel_size", "pipeline_model_parallel_size")),
    ("context_parallel_size", ("tensor_model_parallel_size", "pipeline_model_parallel_size", "context_parallel_size")),
    ("expert_model_parallel_size", ("tensor_model_parallel_size", "pipeline_model_parallel_size",
                                    "expert_model_parallel_size")),
)


def check_train_layout(config) -> None:
    actor, world = config.actor_config, config.world_size
    world_desc = f"{WORLD_DESC_KEY}={world}"
    require_divides("actor_config.tensor_model_parallel_size", actor.tensor_model_parallel_size, world, world_desc)
    for key, factors in _TRAIN_PRODUCTS:
        sizes = [getattr(actor, name) for name in factors]
        if world % math.prod(sizes) != 0:
            raise ConfigError(
                f"actor_config.{key}",
                f"{' * '.join(factors)} = {' * '.join(map(str, sizes))} = {math.prod(sizes)} "
                f"must divide {world_desc}, got {key}={getattr(actor, key)}",
            )


def check_infer_layout(config) -> None:
    generate, world = config.generate_config, config.infer_world_size
    tp, ep = generate.infer_tensor_parallel_size, generate.infer_expert_parallel_size
    world_desc = (f"the {world} actor_infer devices" if config.disaggregated else f"{WORLD_DESC_KEY}={world}")
    require_divides("generate_config.infer_tensor_parallel_size", tp, world, world_desc)
    check_infer_pipeline(config)
    if world % (tp * ep) != 0:
        raise ConfigError(
            "generate_config.infer_expert_parallel_size",
            f"infer_tensor_parallel_size * infer_expert_parallel_size = {tp} * {ep} = {tp * ep} "
            f"must divide {world_desc}, got infer_expert_parallel_size={ep}",
        )


def check_infer_pipeline(config) -> None:
    """TP x PP dividing the inference devices is checked with the resource plan (actor_infer's workers)."""
    key, pp = "generate_config.infer_pipeline_parallel_size", config.generate_config.infer_pipeline_parallel_size
    if pp == 1:
        return
    if config.disaggregated:
        # The disaggregated switch takes vLLM's parameter dtypes from one inference rank, which would
        # hold one stage's parameters only (workers/disaggregated.py).
        raise ConfigError(key, f"inference pipeline stages run colocated only (actor_infer on the actor's "
                               f"devices), got {pp} with disaggregated actor_infer devices")
    arch = config.selected_model
    if arch is not None and pp > arch.num_layers:
        raise ConfigError(key, f"must not exceed model.{config.actor_config.model}.num_layers={arch.num_layers} "
                               f"(vLLM gives every stage at least one layer), got {pp}")


def check_model_sharding(config) -> None:
    arch = config.selected_model
    if arch is None:
        return
    prefix = f"model.{config.actor_config.model}"
    heads_desc = f"{prefix}.num_attention_heads={arch.num_attention_heads}"
    kv_heads = arch.num_key_value_heads
    kv_desc = f"{prefix}.num_query_groups={kv_heads}"
    train_key, train_tp = "actor_config.tensor_model_parallel_size", config.actor_config.tensor_model_parallel_size
    infer_key = "generate_config.infer_tensor_parallel_size"
    infer_tp = config.generate_config.infer_tensor_parallel_size
    # Megatron shards attention heads and query groups over TP; vLLM shards the heads.
    require_divides(train_key, train_tp, arch.num_attention_heads, heads_desc)
    require_divides(train_key, train_tp, kv_heads, kv_desc)
    require_divides(infer_key, infer_tp, arch.num_attention_heads, heads_desc)
    # vLLM replicates KV heads when there are fewer than TP ranks, which needs an exact multiple.
    if kv_heads % infer_tp != 0 and infer_tp % kv_heads != 0:
        raise ConfigError(infer_key, f"must divide or be a multiple of {kv_desc}, got {infer_tp}")
    if arch.padded_vocab_size is not None:
        vocab_desc = f"{prefix}.padded_vocab_size={arch.padded_vocab_size}"
        require_divides(train_key, train_tp, arch.padded_vocab_size, vocab_desc)
        require_divides(infer_key, infer_tp, arch.padded_vocab_size, vocab_desc)
    if config.actor_config.num_layer_list is None:  # listed stages: check_num_layer_list checks them
        require_divides(
            "actor_config.pipeline_model_parallel_size",
            config.actor_config.pipeline_model_parallel_size,
            arch.num_layers,
            f"{prefix}.num_layers={arch.num_layers} (or list each stage's layers in actor_config.num_layer_list)",
        )
    check_experts(config, arch, prefix)


def check_experts(config, arch: ModelArchConfig, prefix: str) -> None:
    for key, ep in (
        ("actor_config.expert_model_parallel_size", config.actor_config.expert_model_parallel_size),
        ("generate_config.infer_expert_parallel_size", config.generate_config.infer_expert_parallel_size),
    ):
        if ep == 1:
            continue
        if arch.num_experts is None:
            raise ConfigError(key, f"must be 1 for a dense model ({prefix}.num_experts is unset), got {ep}")
        require_divides(key, ep, arch.num_experts, f"{prefix}.num_experts={arch.num_experts}")
