"""MindSpeed-RL's DPO recipe (configs/dpo_qwen3_30b_a3b_A3.yaml) as this schema reads it, before the schema is built
(config/loader.py): MindSpeed-LLM's DPO reads every argument from one namespace, so their file sets everything under
megatron_training. Apart from config/dpo.py's checks because it reads the schema's own field lists."""
from __future__ import annotations

from dataclasses import fields
from typing import Any

from mindspeed_rl.config.dpo import DPO_STAGE, ROWS_PER_PAIR
from mindspeed_rl.config.megatron import ActorConfig, MegatronTrainingConfig
from mindspeed_rl.config.model_arch import ModelArchConfig
from mindspeed_rl.config.no_effect import NO_EFFECT_KEYS, lift_value
from mindspeed_rl.errors import ConfigError

# -- their recipe's shape ------------------------------------------------------------------------------------------
# MindSpeed-LLM's DPO reads every argument from one namespace, so MindSpeed-RL's DPO recipe sets the actor's layout,
# optimizer and checkpoint keys under megatron_training (MindSpeed-RL itself merges {**megatron_training,
# **actor_config}): those move to actor_config, where this schema reads them. Their spellings with a hyphen too.
HYPHENATED = {"min-lr": "min_lr"}
# Their DPO recipe's keys with no counterpart here, dropped and listed at start with the reason.
DPO_RECIPE_NO_EFFECT = {
    "tokenizer_not_use_fast": "MindSpeed-LLM's slow-tokenizer switch: the checkpoint's HF fast tokenizer gives the "
                              "same token ids",
    "eval_interval": "MindSpeed-LLM's evaluation on a validation split (their split 100,0,0 has none); held-out pairs "
                     "here: rl_config.eval_interval with megatron_training.eval_data_path",
    "eval_iters": "MindSpeed-LLM's evaluation length on a validation split; see eval_interval",
    "log_interval": "MindSpeed-LLM's console cadence; here runtime.log_interval",
    "no_pad_to_seq_lengths": "MindSpeed-LLM's padding of each batch to seq_length: here batches are as wide as their "
                             "longest pair, which changes no log-prob (causal attention, masked padding)",
    "attention_mask_type": "MindSpeed-LLM's mask construction choice (general): causal with padding masked here",
}


def lift_dpo_recipe(tree: dict[str, Any], notices: list[str]) -> list[ConfigError]:
    """A stage-dpo tree in MindSpeed-RL's DPO shape (everything under megatron_training) as this schema reads it:
    the actor's keys moved to actor_config, their DPO-only keys without a counterpart dropped into `notices`, and the
    sections their recipe has no need to write (rl_config: a pair is 2 samples, one optimizer step per iteration;
    the world size of one replica of the layout; generate_config's defaults) filled in where absent."""
    training = tree.get("megatron_training")
    if not isinstance(training, dict) or training.get("stage") != DPO_STAGE:
        return []
    own, actor_fields = {f.name for f in fields(MegatronTrainingConfig)}, {f.name for f in fields(ActorConfig)}
    block_fields = {f.name for f in fields(ModelArchConfig)}
    actor = tree.setdefault("actor_config", {})
    blocks = tree.get("model") if isinstance(tree.get("model"), dict) else {}
    block = blocks.get(training.get("model"))
    errors = []
    for key in [key for key in training if key not in own]:
        target = HYPHENATED.get(key, key)
        if isinstance(block, dict) and f"model.*.{key}" in NO_EFFECT_KEYS:
            block[key] = training.pop(key)  # their arguments win over the block's; listed as having no effect
        elif isinstance(block, dict) and key in block_fields:
            # The model block's keys (MindSpeed-RL merges them into the same arguments): one value.
            error = lift_value(training.pop(key), block, key, source_key=f"megatron_training.{key}",
                               target_name=f"model.{training['model']}.{key}")
            errors += [error] if error else []
        elif key in DPO_RECIPE_NO_EFFECT:
            training.pop(key)
            notices.append(f"megatron_training.{key} ({DPO_RECIPE_NO_EFFECT[key]})")
        elif f"megatron_training.{key}" not in NO_EFFECT_KEYS and (
                target in actor_fields or f"actor_config.{target}" in NO_EFFECT_KEYS):
            # An actor_config value wins, as in MindSpeed-RL's merge (an override of the recipe's value).
            actor.setdefault(target, training.pop(key))
    if "model" in training:
        actor.setdefault("model", training["model"])
    _fill_dpo_sections(tree, training, actor)
    return errors


def _fill_dpo_sections(tree: dict[str, Any], training: dict[str, Any], actor: dict[str, Any]) -> None:
    rl = tree.setdefault("rl_config", {})
    if not isinstance(rl, dict):
        return
    rl.setdefault("n_samples_per_prompt", ROWS_PER_PAIR)
    # Never called (DPO scores nothing), but the schema's rule rewards need a name.
    rl.setdefault("verifier_function", ["acc"])
    rl.setdefault("verifier_weight", [1.0])
    # Their seq_length bounds a pair (prompt + the longer response); here max_prompt_length + max_tokens does.
    length = training.get("seq_length") if isinstance(training.get("seq_length"), int) else 4096
    rl.setdefault("max_prompt_length", length)
    if isinstance(training.get("global_batch_size"), int):
        rl.setdefault("mini_batch_size", training["global_batch_size"])  # MindSpeed-LLM: one step per batch
    replica = 1
    for key in ("tensor_model_parallel_size", "pipeline_model_parallel_size", "context_parallel_size"):
        replica *= actor.get(key, 1) if isinstance(actor.get(key, 1), int) else 1
    # torchrun decides their world size; one data-parallel replica of their layout unless the user says more.
    rl.setdefault("actor_resource", {}).setdefault("num_npus", replica)
    generate = tree.setdefault("generate_config", {})
    if isinstance(generate, dict):  # no vLLM is built; the schema's lengths still have to be given
        generate.setdefault("max_model_len", 2 * length)
