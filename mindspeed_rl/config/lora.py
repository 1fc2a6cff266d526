"""LoRA's keys (MindSpeed-RL's names and meanings; models/lora.py runs them).

MindSpeed-RL's recipes put `lora_r`, `lora_alpha`, `lora_fusion`, `lora_target_modules` and `lora_ckpt_filter` in
`megatron_training`, which its actor reads; here they are actor_config's (`lora_ckpt_filter` is `lora_filter`, the
name its docs use), lifted from megatron_training when given there. `rl_config.share_backbone` (default: true with
LoRA) makes the reference the actor's backbone with the adapters off, instead of a model of its own.
"""
from __future__ import annotations

from typing import Any

from mindspeed_rl.errors import ConfigError
from mindspeed_rl.config.no_effect import lift_value

LORA_TARGETS = ("linear_qkv", "linear_proj", "linear_fc1", "linear_fc2")
# megatron_training's name -> actor_config's
LIFTED_KEYS = {"lora_r": "lora_r", "lora_alpha": "lora_alpha", "lora_fusion": "lora_fusion",
               "lora_target_modules": "lora_target_modules", "lora_ckpt_filter": "lora_filter",
               "lora_filter": "lora_filter"}


def lift_lora_keys(tree: dict[str, Any]) -> list[ConfigError]:
    """Move megatron_training's LoRA keys to actor_config, as MindSpeed-RL reads them: actor_config's own value
    wins only if it agrees (else one error naming both)."""
    training, actor = tree.get("megatron_training"), tree.get("actor_config")
    if not isinstance(training, dict) or not isinstance(actor, dict):
        return []
    errors = [lift_value(training.pop(key), actor, target, source_key=f"megatron_training.{key}",
                         target_name=f"actor_config.{target}") for key, target in LIFTED_KEYS.items() if key in training]
    return [error for error in errors if error]


def check_lora(prefix: str, actor) -> None:
    targets = list(actor.lora_target_modules)
    unknown = [name for name in targets if name not in LORA_TARGETS]
    if unknown:
        raise ConfigError(f"{prefix}.lora_target_modules", f"unknown module(s) {unknown}: LoRA wraps Megatron's "
                                                           f"{', '.join(LORA_TARGETS)}")
    if len(set(targets)) != len(targets):
        raise ConfigError(f"{prefix}.lora_target_modules", f"lists a module twice: {targets}")
    if not targets:
        return
    if actor.lora_r < 1:
        raise ConfigError(f"{prefix}.lora_r", f"must be >= 1 with lora_target_modules set, got {actor.lora_r}")
    if actor.lora_alpha <= 0:
        raise ConfigError(f"{prefix}.lora_alpha", f"must be > 0, got {actor.lora_alpha}")


def check_lora_run(config) -> None:
    """LoRA against the rest of the run: share_backbone, the reference's path, the model, the critic."""
    rl, actor = config.rl_config, config.actor_config
    arch = config.selected_model
    if actor.uses_lora and arch is not None and arch.num_experts:
        raise ConfigError("actor_config.lora_target_modules", "LoRA on a MoE model is not supported (dense Qwen2/"
                                                              "Qwen3 only): the experts' linears have no adapters")
    if rl.share_backbone and not actor.uses_lora:
        raise ConfigError("rl_config.share_backbone", "true needs LoRA (actor_config.lora_target_modules): the "
                                                      "reference shares the actor's frozen backbone")
    if config.reference_is_backbone and rl.integrated_mode_config.ref_model_load_path:
        raise ConfigError("rl_config.integrated_mode_config.ref_model_load_path",
                          "names a reference model, but with LoRA's shared backbone (rl_config.share_backbone, its "
                          "default) the reference is the actor's backbone: remove it, or set share_backbone false")
    if config.critic_config is not None and config.critic_config.uses_lora:
        raise ConfigError("critic_config.lora_target_modules", "a LoRA critic is not supported: the critic trains "
                                                               "every weight; leave it empty")
