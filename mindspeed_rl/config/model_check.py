"""A `model.<name>` block against the HF checkpoint's config.json, which is what the engines build.

Pure: the caller reads config.json (a dict) and decides what to do with the ConfigError. A field
left None in the block, or a key the checkpoint's config.json does not have, is not compared.
DeepSeek-V3's fields carry MindSpeed-LLM's (Megatron's) names: qk_head_dim is HF's qk_nope_head_dim,
qk_pos_emb_head_dim its qk_rope_head_dim, moe_router_num_groups / group_topk its n_group / topk_group,
moe_router_topk_scaling_factor its routed_scaling_factor, rope_scaling_* its rope_scaling mapping. Fields
must equal the checkpoint's, except two bounds: max_position_embeddings <= the checkpoint's and
padded_vocab_size >= its vocab_size.
"""

import math
from typing import Any, NamedTuple

from mindspeed_rl.errors import ConfigError
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
        *_deepseek_pairs(arch, hf),
        *_rope_scaling_pairs(arch, hf),
    ]


def _deepseek_pairs(arch: ModelArchConfig, hf: dict) -> list[_Pair]:
    """DeepSeek-V3's fields (MindSpeed-LLM / Megatron names) against its config.json keys."""
    model_type = hf.get("model_type")
    deepseek, qwen_moe = model_type == "deepseek_v3", model_type in ("qwen2_moe", "qwen3_moe")
    return [
        # MLA is what a deepseek_v3 checkpoint has; every other model type the engine builds has none.
        _Pair("multi_latent_attention", arch.multi_latent_attention, deepseek if isinstance(model_type, str) else _MISSING,
              f"model_type={_show(model_type)} ({'with' if deepseek else 'without'} multi-head latent attention)"),
        _direct("q_lora_rank", arch.q_lora_rank, hf, "q_lora_rank"),
        _direct("kv_lora_rank", arch.kv_lora_rank, hf, "kv_lora_rank"),
        _direct("qk_head_dim", arch.qk_head_dim, hf, "qk_nope_head_dim"),
        _direct("qk_pos_emb_head_dim", arch.qk_pos_emb_head_dim, hf, "qk_rope_head_dim"),
        _direct("v_head_dim", arch.v_head_dim, hf, "v_head_dim"),
        _direct("n_shared_experts", arch.n_shared_experts, hf, "n_shared_experts"),
        _direct("first_k_dense_replace", arch.first_k_dense_replace, hf, "first_k_dense_replace"),
        # Qwen-MoE states the same spacing as decoder_sparse_step.
        _direct("moe_layer_freq", arch.moe_layer_freq, hf,
                "decoder_sparse_step" if "moe_layer_freq" not in hf and qwen_moe else "moe_layer_freq"),
        _score_function(arch, hf, deepseek, qwen_moe),
        _direct("moe_router_num_groups", arch.moe_router_num_groups, hf, "n_group"),
        _direct("moe_router_group_topk", arch.moe_router_group_topk, hf, "topk_group"),
        # transformers' DeepseekV3 always has the e_score_correction_bias (topk_method noaux_tc); Qwen-MoE none.
        _Pair("moe_router_enable_expert_bias", arch.moe_router_enable_expert_bias,
              hf.get("topk_method", "noaux_tc") == "noaux_tc" if deepseek else (False if qwen_moe else _MISSING),
              f"model_type={_show(model_type)}, topk_method={_show(hf.get('topk_method'))} "
              f"({'with' if deepseek else 'without'} e_score_correction_bias)"),
        _direct("moe_router_topk_scaling_factor", arch.moe_router_topk_scaling_factor, hf, "routed_scaling_factor"),
    ]


def _score_function(arch: ModelArchConfig, hf: dict, deepseek: bool, qwen_moe: bool) -> _Pair:
    if "scoring_func" in hf:
        return _direct("moe_router_score_function", arch.moe_router_score_function, hf, "scoring_func")
    # transformers' DeepseekV3 scores with a sigmoid, Qwen-MoE with a softmax, neither states it.
    implied = "sigmoid" if deepseek else ("softmax" if qwen_moe else _MISSING)
    return _Pair("moe_router_score_function", arch.moe_router_score_function, implied,
                 f"model_type={_show(hf.get('model_type'))} (scoring {_show(implied)})")


def _rope_scaling_pairs(arch: ModelArchConfig, hf: dict) -> list[_Pair]:
    """The block's RoPE scaling against config.json's `rope_scaling` (transformers 4) or `rope_parameters`
    (transformers 5, which also holds rope_theta). No scaling there: type "default"; the other fields then
    have nothing to be compared with."""
    where = "rope_scaling" if isinstance(hf.get("rope_scaling"), dict) else "rope_parameters"
    rope = hf.get(where)
    if not isinstance(rope, dict):
        if "rope_scaling" not in hf and "rope_parameters" not in hf:
            return [_Pair("rope_scaling_type", arch.rope_scaling_type, _MISSING, "")]
        rope, where = {}, "rope_scaling"  # stated as null: no scaling
    kind = rope.get("rope_type", rope.get("type", "default"))
    pairs = [_Pair("rope_scaling_type", arch.rope_scaling_type, kind,
                   f"{where}.type={_show(kind)}" if rope else f"no {where} (type 'default')")]
    # Block field -> the rope_scaling / rope_parameters key it restates.
    for field_name, block_value, key in (
        ("rope_scaling_factor", arch.rope_scaling_factor, "factor"),
        ("rope_scaling_original_max_position_embeddings", arch.rope_scaling_original_max_position_embeddings,
         "original_max_position_embeddings"),
        ("rope_scaling_mscale", arch.rope_scaling_mscale, "mscale"),
        ("rope_scaling_mscale_all_dim", arch.rope_scaling_mscale_all_dim, "mscale_all_dim"),
        ("beta_fast", arch.beta_fast, "beta_fast"),
        ("beta_slow", arch.beta_slow, "beta_slow"),
    ):
        value = rope.get(key, _MISSING)
        pairs.append(_Pair(field_name, block_value, value, f"{where}.{key}={_show(value)}"))
    return pairs


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
    # Qwen3's per-head q/k norms; DeepSeek-V3's MLA normalises its compressed query and key-value latents
    # (q_a_layernorm, kv_a_layernorm), which is what MindSpeed-LLM's qk_layernorm switches on for MLA.
    has_norms = model_type.startswith("qwen3") or model_type == "deepseek_v3"
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
