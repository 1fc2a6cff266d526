"""The adapters of Megatron's fused linears as PEFT's per-module LoRA tensors on the HF model.

A fused linear's adapter is one A and one B, W's layout (models/lora.py); HF's modules are the pieces of W, each
with its own lora_A and lora_B in PEFT. Since the delta is B A and the pieces of W are row ranges (q/k/v of
`linear_qkv`, gate/up of `linear_fc1`) or column ranges (a TP shard of `linear_proj`/`linear_fc2`), each HF module's
adapter is exact: a row piece keeps A whole and takes its rows of B; a column piece keeps B whole and takes its
columns of A. Which piece of which HF tensor a Megatron shard holds is the engine's one layout table
(`resharding/layouts.megatron_layout`), the same the weight push and the HF export read.
"""
from __future__ import annotations

import torch

from mindspeed_rl.models.qwen2 import Qwen2Spec

# PEFT's target_modules for each of our targets.
HF_MODULES = {"linear_qkv": ("q_proj", "k_proj", "v_proj"), "linear_proj": ("o_proj",),
              "linear_fc1": ("gate_proj", "up_proj"), "linear_fc2": ("down_proj",)}


def peft_lora_tensors(shards: list[dict[str, torch.Tensor]], spec: Qwen2Spec, *, pp: int = 1,
                      pp_rank: int = 0) -> dict[str, torch.Tensor]:
    """PEFT's adapter tensors (`base_model.model.<module>.lora_A.weight` / `lora_B.weight`) of one pipeline stage
    from each TP rank's adapter params (index = TP rank; `named_parameters()` names, `...linear_qkv.lora_A`)."""
    from mindspeed_rl.models.layouts import hf_shapes, megatron_layout

    shapes = hf_shapes(spec)
    out: dict[str, torch.Tensor] = {}
    for tp_rank, shard in enumerate(shards):
        for local in megatron_layout(spec, tp=len(shards), tp_rank=tp_rank, pp=pp, pp_rank=pp_rank):
            base = local.name.removesuffix(".weight")
            if f"{base}.lora_A" not in shard:
                continue
            a, b = shard[f"{base}.lora_A"], shard[f"{base}.lora_B"]
            for seg in local.segments:
                module = "base_model.model." + seg.hf_name.removesuffix(".weight")
                rows, columns = shapes[seg.hf_name]
                lora_a = out.setdefault(f"{module}.lora_A.weight", torch.zeros(a.shape[0], columns, dtype=a.dtype))
                lora_b = out.setdefault(f"{module}.lora_B.weight", torch.zeros(rows, b.shape[1], dtype=b.dtype))
                if local.dim == 0:  # a row piece: its rows of B, A whole
                    lora_b[seg.hf_start:seg.hf_start + seg.length] = b[seg.local_start:seg.local_start + seg.length]
                    lora_a.copy_(a)
                else:  # a column piece: its columns of A, B whole
                    lora_a[:, seg.hf_start:seg.hf_start + seg.length] = a[:, seg.local_start:seg.local_start + seg.length]
                    lora_b.copy_(b)
    return out


def peft_target_modules(target_modules) -> list[str]:
    return [name for target in target_modules for name in HF_MODULES[target]]
