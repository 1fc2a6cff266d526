"""Megatron-core's GPT model for a spec (Qwen2/Qwen3, Qwen3-MoE, DeepSeek-V3) on this rank's TP/PP/EP shard, and the
HF weights loaded into it; the engines (engines/megatron_engine.py, the critic's, the reward model's) and the
exports build through here.
"""
from __future__ import annotations

import torch

from mindspeed_rl.models.layouts import megatron_shard_from_hf
from mindspeed_rl.models.qwen2 import ModelOptions, Qwen2Spec, layers_of_stage, transformer_config
from mindspeed_rl.parallel.megatron_state import RankGroups


def build_gpt_model(spec: Qwen2Spec, *, params_dtype: torch.dtype, parallel: RankGroups,
                    options: ModelOptions = ModelOptions()):
    """The model on this rank's shard of `parallel` (the caller's: the layout Megatron's state was set from,
    parallel/megatron_state.py)."""
    from megatron.core.models.gpt import GPTModel

    config = transformer_config(spec, params_dtype=params_dtype, tp=parallel.tp, pp=parallel.pp, ep=parallel.ep,
                                cp=parallel.cp, options=options)
    if spec.deepseek is not None:
        layer_spec = _deepseek_block_spec(config, options)
    else:
        layer_spec = qwen_layer_spec(spec, config, options, parallel)
    model = GPTModel(
        config=config,
        transformer_layer_spec=layer_spec,
        vocab_size=spec.vocab_size,
        max_sequence_length=spec.max_position_embeddings,
        pre_process=parallel.first_stage,
        post_process=parallel.last_stage,
        share_embeddings_and_output_weights=spec.tie_word_embeddings,
        # MLA layers build their own rotary embedding (models/deepseek_v3.py); GPTModel's would go unused.
        position_embedding_type="none" if spec.deepseek is not None else "rope",
        rotary_base=int(spec.rope_theta),
    )
    params_to_dtype(model, params_dtype)
    return model


def params_to_dtype(model: torch.nn.Module, params_dtype: torch.dtype) -> None:
    """Every parameter in the training dtype, as Megatron-LM's Float16Module leaves it: the local spec's torch norms
    are built in fp32 whatever params_dtype says, and a bf16 model with fp32 norms breaks the mixed-precision
    optimizer's checkpoint (its sharded state maps the bf16 groups only: 'Optimizer shape does not match'). Buffers
    (DeepSeek-V3's router bias) keep their dtype, as there."""
    with torch.no_grad():
        for param in model.parameters():
            if param.is_floating_point() and param.dtype != params_dtype:
                param.data = param.data.to(params_dtype)


def qwen_layer_spec(spec: Qwen2Spec, config, options: ModelOptions, parallel: RankGroups):
    """The local layer spec of a Qwen-architecture model as `config` builds it: packed attention, CP's core
    attention, SP-capable norms (the actor's, the reference's, the critic's and the reward model's trunks)."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    layer_spec = get_gpt_layer_local_spec(num_experts=spec.num_experts or None, moe_grouped_gemm=False,
                                          qk_layernorm=spec.qk_layernorm, normalization="RMSNorm")
    if options.packed_sequences:
        from mindspeed_rl.models.packed_attention import with_packed_attention

        layer_spec = with_packed_attention(layer_spec)
    from mindspeed_rl.models.context_parallel import with_context_parallel

    layer_spec = with_context_parallel(layer_spec, config.context_parallel_size)  # padded and packed
    if config.sequence_parallel:
        from mindspeed_rl.accelerator.megatron_cpu import with_sequence_parallel_norms

        stage = layers_of_stage(spec, parallel.pp_rank, parallel.pp)
        layer_spec = with_sequence_parallel_norms(layer_spec, len(stage))
    return layer_spec


def _deepseek_block_spec(config, options: ModelOptions):
    from mindspeed_rl.models.deepseek_v3 import decoder_block_spec

    return decoder_block_spec(config, sequence_parallel_norms=config.sequence_parallel,
                              packed=options.packed_sequences)


def load_hf_into_megatron(model: torch.nn.Module, hf_state: dict[str, torch.Tensor], spec: Qwen2Spec, *,
                          parallel: RankGroups) -> None:
    """This rank's shard (at `parallel`, the caller's) of the HF tensors `hf_state` into `model`."""
    p = parallel
    shard = megatron_shard_from_hf(hf_state, spec, tp_rank=p.tp_rank, tp=p.tp, pp_rank=p.pp_rank, pp=p.pp,
                                   ep_rank=p.ep_rank, ep=p.ep)
    params = {**dict(model.named_parameters()), **layout_buffers(model)}
    missing = sorted(set(params) - set(shard))
    unexpected = sorted(set(shard) - set(params))
    if missing or unexpected:
        raise ValueError(f"HF -> Megatron mapping mismatch: missing {missing[:4]}, unexpected {unexpected[:4]}")
    with torch.no_grad():
        for name, tensor in shard.items():
            if params[name].shape != tensor.shape:
                raise ValueError(f"{name}: checkpoint shard {tuple(tensor.shape)} != model {tuple(params[name].shape)}")
            params[name].copy_(tensor)


def layout_buffers(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Buffers the layouts move like parameters: DeepSeek-V3's router expert_bias (HF e_score_correction_bias)."""
    from mindspeed_rl.models.deepseek_v3 import expert_bias_buffers

    return expert_bias_buffers(model)
