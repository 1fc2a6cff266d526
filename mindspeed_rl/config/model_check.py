"""A `model.<name>` block against the HF checkpoint's config.json, which is what the engines build.

Pure: the caller reads config.json (a dict) and decides what to do with the ConfigError. A field
left None in the block, or a key the checkpoint's config.json does not have, is not compared. Fields
must equal the checkpoint's, except two bounds: max_position_embeddings <= the checkpoint's and
padded_vocab_size >= its vocab_size.
"""

import math
from typing import Any, NamedTuple

from mindspeed_rl.config.errors import ConfigError
from mindspeed_rl.config.model_arch import ModelArchConfig

_MISSING = object()


class _Pair(NamedTuple):
    field_name: str
    block_value: Any
    # The checkpoint's value the field is compared with (_MISSING: config.json does not state it).
    hf_value: Any
    # What config.json says, for the message, e.g. "num_hidden_layers=28".
    hf_desc: str
    # How the block's value must relate to the checkpoint's: "==", "<=" or ">=".
    relation: str = "=="


def check_model_block_against_hf(arch: ModelArchConfig, block_key: str, hf_config: dict) -> None:
    """Raise ConfigError (key ``<block_key>.<field>``) on the first set field that disagrees with
    ``hf_config`` (a checkpoint's parsed config.json); the message names the config.json key and
    both values."""
    for pair in _pairs(arch, hf_config):
        if pair.block_value is None or pair.hf_value is _MISSING or pair.hf_value is None:
            continue
        if not _holds(pair):
            must = "" if pair.relation == "==" else f"; it must be {pair.relation} that ({_WHY[pair.field_name]})"
            raise ConfigError(
                f"{block_key}.{pair.field_name}",
                f"is {_show(pair.block_value)} but the checkpoint's config.json has {pair.hf_desc}{must}; "
                "make the block describe the checkpoint (or remove the field)",
            )


_WHY = {
    "max_position_embeddings": "the block may lower the length limit the run checks, not raise it",
    "padded_vocab_size": "the embedding needs a row per token",
}


def _direct(
    field_name: str, block_value: Any, hf: dict, hf_key: str, *, relation: str = "=="
) -> _Pair:
    value = hf.get(hf_key, _MISSING)
    return _Pair(field_name, block_value, value, f"{hf_key}={_show(value)}", relation)


def _pairs(arch: ModelArchConfig, hf: dict) -> list[_Pair]:
    return [
        _direct("num_layers", arch.num_layers, hf, "num_hidden_layers"),
        _direct("hidden_size", arch.hidden_size, hf, "hidden_size"),
        _direct("ffn_hidden_size", arch.ffn_hidden_size, hf, "intermediate_size"),
        _direct("num_attention_heads", arch.num_attention_heads, hf, "num_attention_heads"),
        _kv_heads(arch, hf),
        _rope_theta(arch, hf),
        # MindSpeed-RL's Qwen2.5-7B block says 32768 for a checkpoint trained to 131072: a lower
        # limit is a choice, a higher one a contradiction.
        _direct("max_position_embeddings", arch.max_position_embeddings, hf, "max_position_embeddings",
                relation="<="),
        # Megatron pads the vocabulary for TP; fewer rows than tokens cannot hold the checkpoint.
        _direct("padded_vocab_size", arch.padded_vocab_size, hf, "vocab_size", relation=">="),
        _direct("norm_epsilon", arch.norm_epsilon, hf, "rms_norm_eps"),
        _untied(arch, hf),
        _qkv_bias(arch, hf),
        _direct("attention_bias", arch.attention_bias, hf, "attention_bias"),
        _qk_layernorm(arch, hf),
        _head_dim(arch, hf),
        _experts(arch, hf),
        _direct("moe_router_topk", arch.moe_router_topk, hf, "num_experts_per_tok"),
        _direct("moe_ffn_hidden_size", arch.moe_ffn_hidden_size, hf, "moe_intermediate_size"),
        _direct("norm_topk_prob", arch.norm_topk_prob, hf, "norm_topk_prob"),
    ]


# The expert count's names: the published Qwen3-MoE configs, transformers 5's save_pretrained, DeepSeek-V3.
EXPERT_COUNT_KEYS = ("num_experts", "num_local_experts", "n_routed_experts")


def expert_count_key(hf: dict) -> str | None:
    """The key under which an HF config.json states its routed experts, or None (a dense model)."""
    return next((key for key in EXPERT_COUNT_KEYS if hf.get(key)), None)


def _experts(arch: ModelArchConfig, hf: dict) -> _Pair:
    key = expert_count_key(hf)
    if key:
        return _direct("num_experts", arch.num_experts, hf, key)
    # A dense checkpoint states no experts: a MoE block for it disagrees.
    return _Pair("num_experts", arch.num_experts, 0, "no num_experts (a dense model)")


def _kv_heads(arch: ModelArchConfig, hf: dict) -> _Pair:
    heads = hf.get("num_attention_heads", _MISSING)
    kv = hf.get("num_key_value_heads", heads)
    if arch.group_query_attention:
        return _Pair("num_query_groups", arch.num_key_value_heads, kv, f"num_key_value_heads={_show(kv)}")
    # Megatron reads num_query_groups only under group_query_attention. Without it (false) the block
    # says "one KV head per query head"; None states nothing and is not compared.
    grouped = _MISSING if kv is _MISSING or heads is _MISSING else kv != heads
    desc = f"num_key_value_heads={_show(kv)} and num_attention_heads={_show(heads)}"
    return _Pair("group_query_attention", arch.group_query_attention, grouped, desc)


def _rope_theta(arch: ModelArchConfig, hf: dict) -> _Pair:
    if "rope_theta" in hf:
        return _direct("rotary_base", arch.rotary_base, hf, "rope_theta")
    # transformers 5 writes the RoPE settings as a nested mapping.
    rope = hf.get("rope_parameters")
    theta = rope.get("rope_theta", _MISSING) if isinstance(rope, dict) else _MISSING
    return _Pair("rotary_base", arch.rotary_base, theta, f"rope_parameters.rope_theta={_show(theta)}")


def _untied(arch: ModelArchConfig, hf: dict) -> _Pair:
    tie = hf.get("tie_word_embeddings", _MISSING)
    untied = _MISSING if tie is _MISSING or tie is None else not tie
    return _Pair("untie_embeddings_and_output_weights", arch.untie_embeddings_and_output_weights, untied,
                 f"tie_word_embeddings={_show(tie)}")


def _qkv_bias(arch: ModelArchConfig, hf: dict) -> _Pair:
    if "attention_bias" in hf:
        return _direct("add_qkv_bias", arch.add_qkv_bias, hf, "attention_bias")
    model_type = hf.get("model_type")
    # Qwen2's config.json has no bias key: that architecture always has a QKV bias.
    if model_type in ("qwen2", "qwen2_moe"):
        return _Pair("add_qkv_bias", arch.add_qkv_bias, True, f"model_type={model_type!r} (always a QKV bias)")
    return _Pair("add_qkv_bias", arch.add_qkv_bias, _MISSING, "")


def _qk_layernorm(arch: ModelArchConfig, hf: dict) -> _Pair:
    model_type = hf.get("model_type")
    if not isinstance(model_type, str):
        return _Pair("qk_layernorm", arch.qk_layernorm, _MISSING, "")
    has_norms = model_type.startswith("qwen3")
    desc = f"model_type={model_type!r} ({'with' if has_norms else 'without'} q/k norms)"
    return _Pair("qk_layernorm", arch.qk_layernorm, has_norms, desc)


def _head_dim(arch: ModelArchConfig, hf: dict) -> _Pair:
    if hf.get("head_dim") is not None:
        return _direct("kv_channels", arch.kv_channels, hf, "head_dim")
    hidden, heads = hf.get("hidden_size"), hf.get("num_attention_heads")
    if not hidden or not heads:
        return _Pair("kv_channels", arch.kv_channels, _MISSING, "")
    return _Pair("kv_channels", arch.kv_channels, hidden // heads,
                 f"no head_dim, so hidden_size / num_attention_heads = {hidden} / {heads} = {hidden // heads}")


def _holds(pair: _Pair) -> bool:
    block_value, hf_value = pair.block_value, pair.hf_value
    if pair.relation == "<=":
        return block_value <= hf_value
    if pair.relation == ">=":
        return block_value >= hf_value
    if isinstance(block_value, bool) or isinstance(hf_value, bool):
        return bool(block_value) == bool(hf_value)
    if isinstance(block_value, float) or isinstance(hf_value, float):
        return math.isclose(float(block_value), float(hf_value), rel_tol=1e-9)
    return block_value == hf_value


def _show(value: Any) -> str:
    """JSON spelling, as config.json writes it."""
    if isinstance(value, bool):
        return "true" if value else "false"
    return "null" if value is None else repr(value)
