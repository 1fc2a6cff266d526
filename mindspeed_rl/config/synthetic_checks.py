"""The checks between synthetic_data (the generated demo model and data) and the sections it stands in for: the asset
paths it replaces and the model block it must agree with. `config` is the GRPOConfig (not imported here: it imports
this module). Pure: no torch."""
from __future__ import annotations

from mindspeed_rl.config.checks import require_equal
from mindspeed_rl.config.megatron import MegatronTrainingConfig
from mindspeed_rl.errors import ConfigError

# Architecture fields the synthetic generator writes into the demo checkpoint; the model block
# that describes that checkpoint must agree with them.
SYNTHETIC_ARCH_FIELDS = ("num_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads")
# And with synthetic_data.num_experts > 0 (a Qwen3-MoE checkpoint), the expert fields.
SYNTHETIC_MOE_FIELDS = ("num_experts", "moe_router_topk", "moe_ffn_hidden_size")


def check_asset_paths(config) -> None:
    # The generator replaces both paths, so a path given beside it would be silently ignored; without
    # it nothing else can stand in for a missing one.
    synthetic = config.synthetic_data
    generated = synthetic is not None and synthetic.enabled
    mt = config.megatron_training
    for name, what, use in (("tokenizer_name_or_path", "the model and tokenizer", "to train from"),
                            ("data_path", "the data", "to train on")):
        key, value = f"{MegatronTrainingConfig.SECTION_KEY}.{name}", getattr(mt, name)
        if generated and value is not None:
            raise ConfigError(key, f"set to {value}, but synthetic_data.enabled=true generates {what}; "
                                   f"add synthetic_data.enabled=false {use} {value}")
        if not generated and not value:
            why = "synthetic_data.enabled=false" if synthetic is not None else "there is no synthetic_data section"
            shown = "null" if value is None else repr(value)
            raise ConfigError(key, f"must name a path: null is for synthetic_data.enabled=true, which generates "
                                   f"{what}, but {why}; got {shown}")


def check_synthetic_data(config) -> None:
    synthetic, arch = config.synthetic_data, config.selected_model
    if synthetic is None or not synthetic.enabled or arch is None:
        return
    prefix = f"model.{config.actor_config.model}"
    for name in SYNTHETIC_ARCH_FIELDS:
        expected = getattr(synthetic, name)
        require_equal(f"{prefix}.{name}", getattr(arch, name), expected, f"synthetic_data.{name}={expected}")
    require_equal(
        f"{prefix}.num_query_groups",
        arch.num_key_value_heads,
        synthetic.num_query_groups,
        f"synthetic_data.num_query_groups={synthetic.num_query_groups}",
    )
    _check_synthetic_experts(config, prefix)
    # Only the arithmetic task's tokenizer has synthetic_data.vocab_size tokens; math_word's size
    # comes from its word list and is checked against the written checkpoint at start.
    vocab_checked = synthetic.task == "arith" and arch.padded_vocab_size is not None
    if vocab_checked and arch.padded_vocab_size < synthetic.vocab_size:
        raise ConfigError(
            f"{prefix}.padded_vocab_size",
            f"must be >= synthetic_data.vocab_size={synthetic.vocab_size}, got {arch.padded_vocab_size}",
        )


def _check_synthetic_experts(config, prefix: str) -> None:
    synthetic, arch = config.synthetic_data, config.selected_model
    if not synthetic.is_moe:
        if arch.num_experts:
            raise ConfigError(f"{prefix}.num_experts", f"synthetic_data.num_experts=0 generates a dense Qwen2 "
                                                       f"checkpoint: leave it unset, got {arch.num_experts}")
        return
    for name in SYNTHETIC_MOE_FIELDS:
        expected = getattr(synthetic, name)
        require_equal(f"{prefix}.{name}", getattr(arch, name), expected, f"synthetic_data.{name}={expected}")
    # The generated Qwen3-MoE's head size is hidden_size / num_attention_heads (config.json's head_dim).
    head_dim = synthetic.hidden_size // synthetic.num_attention_heads
    if arch.kv_channels is not None:
        require_equal(f"{prefix}.kv_channels", arch.kv_channels, head_dim,
                      f"synthetic_data.hidden_size / num_attention_heads = {synthetic.hidden_size} / "
                      f"{synthetic.num_attention_heads} = {head_dim}")
