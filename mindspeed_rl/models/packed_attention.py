"""Megatron's local attention with packed sequences (`packed_seq_params`, THD), which its DotProductAttention
refuses: Megatron's Attention applies RoPE per sample from `cu_seqlens` and hands the packed q/k/v here; the
causal attention within each sample is the accelerator's (accelerator/varlen_attention.py). Unpacked calls go
to Megatron's own path unchanged, so the module's parameters (none) and the layer's names are the local spec's."""
from __future__ import annotations

from megatron.core.transformer.dot_product_attention import DotProductAttention

from mindspeed_rl.accelerator import get_accelerator


class PackedDotProductAttention(DotProductAttention):
    def __init__(self, config, *args, **kwargs):
        super().__init__(config, *args, **kwargs)
        if config.apply_query_key_layer_scaling:
            raise ValueError("packed attention assumes apply_query_key_layer_scaling off (its scale is 1/sqrt(d))")

    def forward(self, query, key, value, attention_mask, attn_mask_type=None, attention_bias=None,
                packed_seq_params=None):
        if packed_seq_params is None:
            return super().forward(query, key, value, attention_mask, attn_mask_type=attn_mask_type,
                                   attention_bias=attention_bias)
        if packed_seq_params.qkv_format != "thd":
            raise ValueError(f"packed attention takes the thd format, got {packed_seq_params.qkv_format!r}")
        accelerator = get_accelerator(query.device.type)
        out = accelerator.varlen_causal_attention(query, key, value, cu_seqlens=packed_seq_params.cu_seqlens_q,
                                                  max_seqlen=packed_seq_params.max_seqlen_q,
                                                  scale=self.softmax_scale)
        return out.reshape(out.shape[0], -1)  # [t, heads x d], as Megatron's Attention expects for thd


def with_packed_attention(layer_spec):
    """The layer spec with PackedDotProductAttention as every layer's core attention."""
    attention = layer_spec.submodules.self_attention.submodules
    attention.core_attention = PackedDotProductAttention
    return layer_spec
