"""Context parallelism's config check (models/context_parallel.py computes it)."""
from __future__ import annotations

from mindspeed_rl.errors import ConfigError


def check_context_parallel(config) -> None:
    """Context parallelism covers every model here (actor, reference, critic, reward model; Qwen and DeepSeek-V3's
    MLA), without attention dropout; `config` is the GRPOConfig."""
    cp = config.actor_config.context_parallel_size
    if cp > 1 and config.megatron_training.attention_dropout > 0:
        raise ConfigError("actor_config.context_parallel_size", "> 1 runs without attention dropout: it needs "
                                                               "megatron_training.attention_dropout: 0")
