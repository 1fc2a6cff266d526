"""DeepSeek-V3's tensors in HF, Megatron (local spec) and vLLM (DeepseekV3ForCausalLM) layouts.

Called by models/layouts.py when the spec has `deepseek` fields; the shard rules are in
models/deepseek_v3.py's docstring. Embedding, head and final norm are Qwen's and stay in layouts.py.
"""
from __future__ import annotations

from mindspeed_rl.models.qwen2 import Qwen2Spec, layers_of_stage
from mindspeed_rl.models.layout_parts import LocalTensor, _even, _expert, _named, _stack, _vllm_moe, _whole


def is_moe_layer(spec: Qwen2Spec, layer: int) -> bool:
    return layer >= spec.deepseek.first_dense_layers


def _attention_shapes(spec: Qwen2Spec) -> dict[str, tuple[int, ...]]:
    ds, h, a = spec.deepseek, spec.hidden_size, spec.num_attention_heads
    shapes = {"kv_a_proj_with_mqa.weight": (ds.kv_lora_rank + ds.qk_rope_head_dim, h),
              "kv_a_layernorm.weight": (ds.kv_lora_rank,),
              "kv_b_proj.weight": (a * (ds.qk_nope_head_dim + ds.v_head_dim), ds.kv_lora_rank),
              "o_proj.weight": (h, a * ds.v_head_dim)}
    if ds.q_lora_rank:
        shapes.update({"q_a_proj.weight": (ds.q_lora_rank, h), "q_a_layernorm.weight": (ds.q_lora_rank,),
                       "q_b_proj.weight": (a * ds.q_head_dim, ds.q_lora_rank)})
    else:
        shapes["q_proj.weight"] = (a * ds.q_head_dim, h)
    return shapes


def _mlp_shapes(spec: Qwen2Spec, layer: int) -> dict[str, tuple[int, ...]]:
    h = spec.hidden_size
    if not is_moe_layer(spec, layer):
        f = spec.ffn_hidden_size
        return {"gate_proj.weight": (f, h), "up_proj.weight": (f, h), "down_proj.weight": (h, f)}
    f, e = spec.moe_ffn_hidden_size, spec.num_experts
    fs = spec.deepseek.num_shared_experts * f
    shapes = {"gate.weight": (e, h), "gate.e_score_correction_bias": (e,)}
    for x in range(e):
        shapes.update({f"experts.{x}.gate_proj.weight": (f, h), f"experts.{x}.up_proj.weight": (f, h),
                       f"experts.{x}.down_proj.weight": (h, f)})
    if fs:
        shapes.update({"shared_experts.gate_proj.weight": (fs, h), "shared_experts.up_proj.weight": (fs, h),
                       "shared_experts.down_proj.weight": (h, fs)})
    return shapes


def layer_hf_shapes(spec: Qwen2Spec, layer: int) -> dict[str, tuple[int, ...]]:
    """HF tensors of decoder layer `layer` (full names)."""
    p, h = f"model.layers.{layer}.", spec.hidden_size
    shapes = {p + "input_layernorm.weight": (h,), p + "post_attention_layernorm.weight": (h,)}
    shapes.update({p + "self_attn." + name: shape for name, shape in _attention_shapes(spec).items()})
    shapes.update({p + "mlp." + name: shape for name, shape in _mlp_shapes(spec, layer).items()})
    return shapes


def _gate_up(name: str, gate: str, up: str, rows: int, part: int, parts: int, h: int) -> LocalTensor:
    n = rows // parts
    return _stack(name, [(gate, part * n, n), (up, part * n, n)], (h,))


# -- Megatron ------------------------------------------------------------------------------------
def megatron_layer(spec: Qwen2Spec, layer: int, local: int, *, tp: int, tp_rank: int, ep: int,
                   ep_rank: int) -> list[LocalTensor]:
    """One Megatron decoder layer (global `layer`, stage-local index `local`), named as named_parameters()
    plus the router's `expert_bias` buffer."""
    src, dst = f"model.layers.{layer}.", f"decoder.layers.{local}."
    a, s = src + "self_attn.", dst + "self_attention."
    shapes = _attention_shapes(spec)
    out = [_whole(dst + "input_layernorm.weight", src + "input_layernorm.weight", (spec.hidden_size,)),
           _whole(dst + "pre_mlp_layernorm.weight", src + "post_attention_layernorm.weight", (spec.hidden_size,))]
    if spec.deepseek.q_lora_rank:
        out += [_even(s + "linear_q_down_proj.weight", a + "q_a_proj.weight", shapes["q_a_proj.weight"], 0, tp_rank, tp),
                _whole(s + "q_layernorm.weight", a + "q_a_layernorm.weight", shapes["q_a_layernorm.weight"]),
                _even(s + "linear_q_up_proj.weight", a + "q_b_proj.weight", shapes["q_b_proj.weight"], 0, tp_rank, tp)]
    else:
        out.append(_even(s + "linear_q_proj.weight", a + "q_proj.weight", shapes["q_proj.weight"], 0, tp_rank, tp))
    out += [_even(s + "linear_kv_down_proj.weight", a + "kv_a_proj_with_mqa.weight", shapes["kv_a_proj_with_mqa.weight"], 0, tp_rank, tp),
            _whole(s + "kv_layernorm.weight", a + "kv_a_layernorm.weight", shapes["kv_a_layernorm.weight"]),
            _even(s + "linear_kv_up_proj.weight", a + "kv_b_proj.weight", shapes["kv_b_proj.weight"], 0, tp_rank, tp),
            _even(s + "linear_proj.weight", a + "o_proj.weight", shapes["o_proj.weight"], 1, tp_rank, tp)]
    return out + _megatron_mlp(spec, layer, src + "mlp.", dst + "mlp.", tp, tp_rank, ep, ep_rank)


def _megatron_mlp(spec: Qwen2Spec, layer: int, src: str, dst: str, tp: int, tp_rank: int, ep: int,
                  ep_rank: int) -> list[LocalTensor]:
    h, shapes = spec.hidden_size, _mlp_shapes(spec, layer)
    if not is_moe_layer(spec, layer):
        return [_gate_up(dst + "linear_fc1.weight", src + "gate_proj.weight", src + "up_proj.weight",
                         spec.ffn_hidden_size, tp_rank, tp, h),
                _even(dst + "linear_fc2.weight", src + "down_proj.weight", shapes["down_proj.weight"], 1, tp_rank, tp)]
    out = [_whole(dst + "router.weight", src + "gate.weight", shapes["gate.weight"]),
           _whole(dst + "router.expert_bias", src + "gate.e_score_correction_bias", shapes["gate.e_score_correction_bias"])]
    per_rank = spec.num_experts // ep
    for local in range(per_rank):
        fc1, fc2 = _expert(spec, src[: -len("mlp.")], ep_rank * per_rank + local, tp_rank, tp)
        m = f"{dst}experts.local_experts.{local}."
        out += [_named(fc1, m + "linear_fc1.weight"), _named(fc2, m + "linear_fc2.weight")]
    if spec.deepseek.num_shared_experts:
        fs = shapes["shared_experts.down_proj.weight"][1]
        out += [_gate_up(dst + "shared_experts.linear_fc1.weight", src + "shared_experts.gate_proj.weight",
                         src + "shared_experts.up_proj.weight", fs, tp_rank, tp, h),
                _even(dst + "shared_experts.linear_fc2.weight", src + "shared_experts.down_proj.weight", (h, fs), 1,
                      tp_rank, tp)]
    return out


def megatron_layers(spec: Qwen2Spec, *, tp: int, tp_rank: int, pp: int, pp_rank: int, ep: int,
                    ep_rank: int) -> list[LocalTensor]:
    out: list[LocalTensor] = []
    for local, layer in enumerate(layers_of_stage(spec, pp_rank, pp)):
        out += megatron_layer(spec, layer, local, tp=tp, tp_rank=tp_rank, ep=ep, ep_rank=ep_rank)
    return out


# -- vLLM ----------------------------------------------------------------------------------------
def vllm_layer(spec: Qwen2Spec, layer: int, *, tp: int, tp_rank: int, moe_size: int, moe_rank: int,
               expert_parallel: bool) -> list[LocalTensor]:
    """One vLLM DeepseekV2DecoderLayer on attention TP rank `tp_rank` and MoE rank `moe_rank` of `moe_size`."""
    p, h = f"model.layers.{layer}.", spec.hidden_size
    a = p + "self_attn."
    shapes = _attention_shapes(spec)
    out = [_whole(p + "input_layernorm.weight", p + "input_layernorm.weight", (h,)),
           _whole(p + "post_attention_layernorm.weight", p + "post_attention_layernorm.weight", (h,))]
    kv_a = (a + "kv_a_proj_with_mqa.weight", 0, shapes["kv_a_proj_with_mqa.weight"][0])
    if spec.deepseek.q_lora_rank:  # fused_qkv_a_proj = [q_a_proj; kv_a_proj_with_mqa], replicated
        out += [_stack(a + "fused_qkv_a_proj.weight", [(a + "q_a_proj.weight", 0, spec.deepseek.q_lora_rank), kv_a], (h,)),
                _whole(a + "q_a_layernorm.weight", a + "q_a_layernorm.weight", shapes["q_a_layernorm.weight"]),
                _even(a + "q_b_proj.weight", a + "q_b_proj.weight", shapes["q_b_proj.weight"], 0, tp_rank, tp)]
    else:
        out += [_even(a + "q_proj.weight", a + "q_proj.weight", shapes["q_proj.weight"], 0, tp_rank, tp),
                _stack(a + "kv_a_proj_with_mqa.weight", [kv_a], (h,))]
    out += [_whole(a + "kv_a_layernorm.weight", a + "kv_a_layernorm.weight", shapes["kv_a_layernorm.weight"]),
            _even(a + "kv_b_proj.weight", a + "kv_b_proj.weight", shapes["kv_b_proj.weight"], 0, tp_rank, tp),
            _even(a + "o_proj.weight", a + "o_proj.weight", shapes["o_proj.weight"], 1, tp_rank, tp)]
    m = p + "mlp."
    if not is_moe_layer(spec, layer):
        return out + [_gate_up(m + "gate_up_proj.weight", m + "gate_proj.weight", m + "up_proj.weight",
                               spec.ffn_hidden_size, tp_rank, tp, h),
                      _even(m + "down_proj.weight", m + "down_proj.weight", (h, spec.ffn_hidden_size), 1, tp_rank, tp)]
    out += _vllm_moe(spec, p, moe_size, moe_rank, expert_parallel)
    out.append(_whole(m + "gate.e_score_correction_bias", m + "gate.e_score_correction_bias", (spec.num_experts,)))
    if spec.deepseek.num_shared_experts:
        fs = spec.deepseek.num_shared_experts * spec.moe_ffn_hidden_size
        out += [_gate_up(m + "shared_experts.gate_up_proj.weight", m + "shared_experts.gate_proj.weight",
                         m + "shared_experts.up_proj.weight", fs, tp_rank, tp, h),
                _even(m + "shared_experts.down_proj.weight", m + "shared_experts.down_proj.weight", (h, fs), 1, tp_rank, tp)]
    return out


def check_vllm_tp(spec: Qwen2Spec, tp: int) -> None:
    ds = spec.deepseek
    if spec.num_attention_heads % tp:
        raise ValueError(f"infer TP {tp} must divide num_attention_heads={spec.num_attention_heads}")
    for name, size in (("intermediate_size", spec.ffn_hidden_size),
                       ("n_shared_experts * moe_intermediate_size", ds.num_shared_experts * spec.moe_ffn_hidden_size)):
        if size % tp:
            raise ValueError(f"infer TP {tp} must divide {name}={size}")


def check_train_tp(spec: Qwen2Spec, tp: int) -> None:
    """Megatron's local spec splits the down projections' rows over TP too."""
    ds = spec.deepseek
    for name, size in (("q_lora_rank", ds.q_lora_rank or 0), ("kv_lora_rank + qk_rope_head_dim",
                       ds.kv_lora_rank + ds.qk_rope_head_dim), ("num_attention_heads", spec.num_attention_heads),
                       ("intermediate_size", spec.ffn_hidden_size),
                       ("n_shared_experts * moe_intermediate_size", ds.num_shared_experts * spec.moe_ffn_hidden_size)):
        if size % tp:
            raise ValueError(f"train TP={tp} must divide {name}={size}")
