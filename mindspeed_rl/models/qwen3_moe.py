"""Qwen3-MoE's sparse MLP on Megatron: config fields and HF -> Megatron expert weights.

HF (checkpoint format): `mlp.gate.weight` [E, H] (router) and per expert
`mlp.experts.{e}.{gate,up}_proj.weight` [F, H], `down_proj.weight` [H, F].
Megatron local spec with `SequentialMLP` (moe_grouped_gemm=False): `mlp.router.weight` [E, H]
(replicated) and on EP rank r the experts [r*E/ep, (r+1)*E/ep) as
`mlp.experts.local_experts.{j}.linear_fc1.weight` = [gate_t; up_t] per expert-TP shard t, and
`linear_fc2.weight` = down_proj columns of shard t.

Routing: HF takes softmax over all experts, then top-k, then renormalises when
`norm_topk_prob`; Megatron's default (top-k on logits, then softmax over the k) is the same
function, and `moe_router_pre_softmax=True` is HF's non-renormalised variant.
"""
from __future__ import annotations

import torch


def moe_config_fields(spec, *, ep: int, tp: int, load_balancing_type: str = "none", aux_loss_coeff: float = 0.0) -> dict:
    """TransformerConfig keyword arguments of the MoE part. With a load-balancing type other than "none",
    Megatron's router adds aux_loss_coeff x its balance loss to the gradient in the update (only there: the
    router adds it in training mode with autograd on, so log-probs and generation are unchanged)."""
    if spec.num_experts % ep:
        raise ValueError(f"train EP={ep} must divide num_experts={spec.num_experts}")
    if spec.moe_ffn_hidden_size % tp:
        raise ValueError(f"train TP={tp} (= expert TP) must divide moe_intermediate_size={spec.moe_ffn_hidden_size}")
    return dict(
        num_moe_experts=spec.num_experts,
        moe_router_topk=spec.moe_topk,
        moe_ffn_hidden_size=spec.moe_ffn_hidden_size,
        moe_router_pre_softmax=not spec.norm_topk_prob,
        moe_grouped_gemm=False,  # SequentialMLP: plain per-expert linears, no grouped-GEMM kernel on CPU
        # Padded batches: the allgather dispatcher (even gathers). Packed under PP needs alltoall
        # (qwen2._packed_pipeline_fields), whose uneven gathers at ETP > 1 gloo runs through CPU patch P8.
        moe_token_dispatcher_type="allgather",
        moe_router_load_balancing_type=load_balancing_type,
        moe_aux_loss_coeff=aux_loss_coeff if load_balancing_type != "none" else 0.0,
        moe_permute_fusion=False,
        expert_model_parallel_size=ep,
        expert_tensor_parallel_size=tp,
    )


def local_experts(spec, ep_rank: int, ep: int) -> range:
    """Global expert ids held by EP rank `ep_rank` (contiguous blocks, as Megatron assigns them)."""
    per_rank = spec.num_experts // ep
    return range(ep_rank * per_rank, (ep_rank + 1) * per_rank)
