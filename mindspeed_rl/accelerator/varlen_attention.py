"""Causal attention over packed sequences (THD: tokens x heads x head_dim, boundaries in `cu_seqlens`): each
sample attends to itself only, from its own first token.

One function per device, the same contract:
- cpu, and cuda without flash-attn: torch's scaled_dot_product_attention per sample (its fused CPU / CUDA
  kernels keep the output and a logsumexp, never a [t, t] mask or score matrix);
- cuda with flash-attn: `flash_attn_varlen_func` over the whole pack (the kernel Megatron's TE path runs);
- npu: `torch_npu.npu_fusion_attention` in the TND layout with `actual_seq_qlen/kvlen` (MindSpeed's
  remove-padding path). Written from torch_npu's documented signature; not run here (no NPU).
"""
from __future__ import annotations

import importlib.util

import torch


def varlen_causal_attention(device_name: str, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, *,
                            cu_seqlens: torch.Tensor, max_seqlen: int, scale: float) -> torch.Tensor:
    """query [t, heads, d], key/value [t, kv_heads, d] (kv_heads divides heads) -> [t, heads, d]."""
    if device_name == "npu":
        return _npu_fusion_attention(query, key, value, cu_seqlens=cu_seqlens, scale=scale)
    if device_name == "cuda" and importlib.util.find_spec("flash_attn") is not None:
        from flash_attn import flash_attn_varlen_func

        return flash_attn_varlen_func(query, key, value, cu_seqlens, cu_seqlens, max_seqlen, max_seqlen,
                                      softmax_scale=scale, causal=True)
    return per_sample_attention(query, key, value, cu_seqlens=cu_seqlens, scale=scale)


def per_sample_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, *, cu_seqlens: torch.Tensor,
                         scale: float) -> torch.Tensor:
    pieces = []
    bounds = cu_seqlens.tolist()
    for start, stop in zip(bounds[:-1], bounds[1:]):
        if stop == start:
            continue
        # [L, heads, d] -> [1, heads, L, d]
        q, k, v = (x[start:stop].transpose(0, 1).unsqueeze(0) for x in (query, key, value))
        attended = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale,
                                                                    enable_gqa=k.shape[1] != q.shape[1])
        pieces.append(attended.squeeze(0).transpose(0, 1))
    return torch.cat(pieces)


def _npu_fusion_attention(query, key, value, *, cu_seqlens, scale):
    import torch_npu

    # sparse_mode 3: the causal (lower-right) mask given as a 2048 x 2048 upper triangle, per the torch_npu docs.
    mask = torch.triu(torch.ones(2048, 2048, dtype=torch.bool, device=query.device), diagonal=1)
    boundaries = cu_seqlens[1:].tolist()
    return torch_npu.npu_fusion_attention(
        query, key, value, query.shape[1], input_layout="TND", scale=scale, atten_mask=mask, sparse_mode=3,
        actual_seq_qlen=boundaries, actual_seq_kvlen=boundaries)[0]
