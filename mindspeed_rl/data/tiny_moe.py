"""A randomly initialised tiny Qwen3-MoE checkpoint (HF format, safetensors) for MoE tests.

transformers 5 keeps the experts fused in memory ([E, 2F, H]) but `save_pretrained` writes the
Hub's per-expert names (`mlp.experts.{e}.gate_proj.weight`), which is what vLLM loads and what
the resharding layouts call the full HF tensors. Every parameter is random (norms around 1).
"""
from __future__ import annotations

import os
from pathlib import Path

from mindspeed_rl.data.tiny_model import RMS_NORM_EPS, ROPE_THETA, randomize_parameters, save_tiny_checkpoint
from mindspeed_rl.data.tokenizer import EOS_TOKEN_ID, train_arith_tokenizer


def create_tiny_qwen3_moe_checkpoint(out_dir: str | os.PathLike[str], *, vocab_size: int = 64, hidden_size: int = 128,
                                     num_layers: int = 2, num_attention_heads: int = 4, num_query_groups: int = 2,
                                     head_dim: int = 32, num_experts: int = 4, moe_topk: int = 2,
                                     moe_ffn_hidden_size: int = 64, norm_topk_prob: bool = True, seed: int = 0,
                                     init_std: float = 0.05, max_position_embeddings: int = 256,
                                     tokenizer=None, intermediate_size: int | None = None) -> Path:
    """Write config.json + model.safetensors + tokenizer to `out_dir` (`tokenizer` None: the arithmetic demo's of
    `vocab_size`). vLLM's CPU attention needs head_dim 32 or more; its MoE kernel wants hidden and per-rank
    intermediate sizes divisible by 32. `intermediate_size` is config.json's dense MLP width (None: 2 x
    moe_ffn_hidden_size); every layer is MoE, so no weight has it."""
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    config = Qwen3MoeConfig(
        vocab_size=vocab_size, hidden_size=hidden_size,
        intermediate_size=2 * moe_ffn_hidden_size if intermediate_size is None else intermediate_size,
        moe_intermediate_size=moe_ffn_hidden_size, num_hidden_layers=num_layers,
        num_attention_heads=num_attention_heads, num_key_value_heads=num_query_groups, head_dim=head_dim,
        num_experts=num_experts, num_experts_per_tok=moe_topk, norm_topk_prob=norm_topk_prob,
        max_position_embeddings=max_position_embeddings, rms_norm_eps=RMS_NORM_EPS, initializer_range=init_std,
        rope_parameters={"rope_type": "default", "rope_theta": ROPE_THETA}, tie_word_embeddings=False,
        router_aux_loss_coef=0.0, dtype="float32",
        bos_token_id=EOS_TOKEN_ID, eos_token_id=EOS_TOKEN_ID, pad_token_id=EOS_TOKEN_ID,
    )
    model = Qwen3MoeForCausalLM(config).float()
    randomize_parameters(model, seed, init_std)
    return save_tiny_checkpoint(model, tokenizer or train_arith_tokenizer(vocab_size, seed), out_dir)
