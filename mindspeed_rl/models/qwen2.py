"""Qwen2 / Qwen2.5 dense (and the attention/embedding part of Qwen3-MoE): HF config -> Megatron
TransformerConfig, and HF <-> Megatron weights. The MoE MLP lives in `models/qwen3_moe.py`.

Megatron's layouts (checked against live shards by tests/test_megatron_layouts_multiprocess.py):
- `linear_qkv` interleaves per query group: [q_g0, k_g0, v_g0, q_g1, ...]; TP takes whole groups.
- `linear_fc1` is [gate_r; up_r] per TP shard, so the TP=1 tensor [gate; up] cannot be chunked naively.
- embedding and output layer are vocab-parallel (rows); `linear_proj`/`linear_fc2` split columns.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Optional

import torch
import torch.nn.functional as F

from mindspeed_rl.models.pipeline_stages import megatron_layout as megatron_pipeline_layout
from mindspeed_rl.models.pipeline_stages import stage_layer_range

if TYPE_CHECKING:
    from mindspeed_rl.models.deepseek_v3 import DeepSeekV3Fields


@dataclass(frozen=True, kw_only=True)
class Qwen2Spec:
    """The architecture numbers every layout computation needs (num_experts > 0: a Qwen3-MoE)."""

    vocab_size: int
    hidden_size: int
    ffn_hidden_size: int
    num_layers: int
    num_attention_heads: int
    num_query_groups: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool = True  # Qwen2 has q/k/v biases, Qwen3 does not
    qk_layernorm: bool = False  # Qwen3's per-head q_norm / k_norm
    num_experts: int = 0  # 0: dense MLP
    moe_ffn_hidden_size: int = 0
    moe_topk: int = 0
    norm_topk_prob: bool = True
    # Layers of each training pipeline stage (actor_config.num_layer_list); None: Megatron's even split.
    # Part of the spec because every layout computation (HF <-> Megatron, the weight push) needs it.
    pipeline_stage_layers: Optional[tuple[int, ...]] = None
    # DeepSeek-V3's own numbers (models/deepseek_v3.py); None: a Qwen model.
    deepseek: Optional["DeepSeekV3Fields"] = None

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    @classmethod
    def from_hf_config(cls, hf_config) -> "Qwen2Spec":
        rope_theta = getattr(hf_config, "rope_theta", None)
        rope_parameters = getattr(hf_config, "rope_parameters", None) or {}
        if rope_theta is None:
            rope_theta = rope_parameters.get("rope_theta", 10000.0)
        heads = hf_config.num_attention_heads
        if hf_config.model_type == "deepseek_v3":
            from mindspeed_rl.models.deepseek_v3 import spec_fields_from_hf_config

            moe = spec_fields_from_hf_config(hf_config)
        else:
            moe = _moe_fields(hf_config)
        return cls(
            vocab_size=hf_config.vocab_size,
            hidden_size=hf_config.hidden_size,
            num_layers=hf_config.num_hidden_layers,
            num_attention_heads=heads,
            rms_norm_eps=hf_config.rms_norm_eps,
            rope_theta=float(rope_theta),
            max_position_embeddings=hf_config.max_position_embeddings,
            tie_word_embeddings=bool(hf_config.tie_word_embeddings),
            **{"ffn_hidden_size": hf_config.intermediate_size, "num_query_groups": hf_config.num_key_value_heads,
               "head_dim": getattr(hf_config, "head_dim", None) or hf_config.hidden_size // heads,
               "qkv_bias": bool(getattr(hf_config, "attention_bias", True)),
               "qk_layernorm": hf_config.model_type.startswith("qwen3"), **moe},
        )


def _moe_fields(hf_config) -> dict:
    experts = getattr(hf_config, "num_experts", None) or getattr(hf_config, "num_local_experts", None) or 0
    if not experts:
        return {}
    if getattr(hf_config, "mlp_only_layers", None) or getattr(hf_config, "decoder_sparse_step", 1) != 1:
        raise ValueError("MoE: only models whose every layer is sparse (decoder_sparse_step=1, no mlp_only_layers)")
    if getattr(hf_config, "shared_expert_intermediate_size", 0):
        raise ValueError("MoE: shared experts (Qwen2-MoE) are not supported; Qwen3-MoE style only")
    return dict(num_experts=experts, moe_ffn_hidden_size=hf_config.moe_intermediate_size,
                moe_topk=hf_config.num_experts_per_tok, norm_topk_prob=bool(hf_config.norm_topk_prob))


@dataclass(frozen=True, kw_only=True)
class ModelOptions:
    """Config knobs that shape the Megatron model's computation but not its weights or their layout.

    `kernel_fields` are TransformerConfig fusion fields already resolved for the device
    (`Accelerator.resolve_kernels`); unset ones stay off.
    """

    sequence_parallel: bool = False
    # Dropout is active in train mode only: `compute_logprobs` runs in eval mode, so with dropout
    # > 0 the old log-probs and the update's log-probs of the same weights differ (the first
    # step's ratio is not 1 and ppo_kl is not 0 even on-policy).
    attention_dropout: float = 0.0
    hidden_dropout: float = 0.0
    attention_softmax_in_fp32: bool = True
    kernel_fields: dict[str, bool] = field(default_factory=dict)
    # Rows of logits turned into log-probs and entropy at a time (engines/vocab_parallel.py).
    logprob_chunk_tokens: int = 1024
    # Megatron's activation recompute (actor_config.recompute_*), passed to TransformerConfig as they are.
    recompute_granularity: Optional[str] = None
    recompute_method: Optional[str] = None
    recompute_num_layers: Optional[int] = None
    # MoE: Megatron's router load-balancing loss in the update (model.<name>.moe_router_load_balancing_type,
    # moe_aux_loss_coeff); "none" adds nothing to the objective.
    moe_router_load_balancing_type: str = "none"
    moe_aux_loss_coeff: float = 0.0
    # Packed micro-batches (rl_config.use_remove_padding): the layers' core attention takes THD packs
    # (models/packed_attention.py) and pipeline stages exchange each micro-batch's shape first.
    packed_sequences: bool = False

    def __post_init__(self) -> None:
        if self.logprob_chunk_tokens < 1:
            raise ValueError(f"logprob_chunk_tokens must be >= 1, got {self.logprob_chunk_tokens}")
        for name in ("attention_dropout", "hidden_dropout"):
            if not 0.0 <= getattr(self, name) < 1.0:
                raise ValueError(f"{name} must be in [0, 1), got {getattr(self, name)}")
        unknown = set(self.kernel_fields) - set(_FUSION_FIELDS)
        if unknown:
            raise ValueError(f"kernel_fields: unknown TransformerConfig fusion fields {sorted(unknown)}")


# The fusions off by default: they need apex / TransformerEngine / CUDA; the device turns them on.
_FUSION_FIELDS = ("bias_activation_fusion", "masked_softmax_fusion", "apply_rope_fusion",
                  "gradient_accumulation_fusion")


def transformer_config(spec: Qwen2Spec, *, params_dtype: torch.dtype, tp: int, pp: int, ep: int = 1, cp: int = 1,
                       options: ModelOptions = ModelOptions()):
    from megatron.core.transformer import TransformerConfig

    bf16 = params_dtype == torch.bfloat16
    seq_parallel = options.sequence_parallel
    if seq_parallel and tp == 1:
        raise ValueError("sequence_parallel needs tensor parallelism: tensor_model_parallel_size is 1")
    moe = {}
    if spec.is_moe:
        from mindspeed_rl.models.qwen3_moe import moe_config_fields

        moe = moe_config_fields(spec, ep=ep, tp=tp, load_balancing_type=options.moe_router_load_balancing_type,
                                aux_loss_coeff=options.moe_aux_loss_coeff)
        seq_parallel = seq_parallel or tp > 1  # megatron: MoE with TP needs sequence parallel
    fusions = {name: options.kernel_fields.get(name, False) for name in _FUSION_FIELDS}
    config_class, mla = TransformerConfig, {}
    if spec.deepseek is not None:
        from megatron.core.transformer.transformer_config import MLATransformerConfig

        from mindspeed_rl.models.deepseek_v3 import megatron_config_fields

        config_class, mla = MLATransformerConfig, megatron_config_fields(spec)
    fields = dict(
        num_layers=spec.num_layers,
        hidden_size=spec.hidden_size,
        ffn_hidden_size=spec.ffn_hidden_size,
        num_attention_heads=spec.num_attention_heads,
        num_query_groups=spec.num_query_groups,
        kv_channels=spec.head_dim,
        gated_linear_unit=True,
        activation_func=F.silu,
        add_bias_linear=False,
        add_qkv_bias=spec.qkv_bias,
        qk_layernorm=spec.qk_layernorm,
        normalization="RMSNorm",
        layernorm_epsilon=spec.rms_norm_eps,
        tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp, context_parallel_size=cp,
        sequence_parallel=seq_parallel,
        use_cpu_initialization=True,
        params_dtype=params_dtype,
        bf16=bf16,
        pipeline_dtype=params_dtype,
        # Apex's persistent LayerNorm and the bias-dropout fusion have no effect here: the model
        # has RMSNorm and no linear biases.
        persist_layer_norm=False,
        bias_dropout_fusion=False,
        hidden_dropout=options.hidden_dropout,
        attention_dropout=options.attention_dropout,
        attention_softmax_in_fp32=options.attention_softmax_in_fp32,
        recompute_granularity=options.recompute_granularity,
        recompute_method=options.recompute_method,
        recompute_num_layers=options.recompute_num_layers,
        **_pipeline_layout_fields(spec, pp),
        **fusions,
        # After `moe`: packed pipeline stages may choose the dispatcher.
        **{**moe, **_packed_pipeline_fields(options, pp=pp)},
    )
    return config_class(**{**fields, **mla})


def _packed_pipeline_fields(options: ModelOptions, *, pp: int) -> dict:
    """Packed micro-batches differ in length: pipeline stages then exchange each one's shape first. Megatron
    allows that with its alltoall MoE dispatcher only (a dense model has no dispatcher: it is named to pass the
    check). With expert TP > 1 that dispatcher all-gathers uneven parts over the TP ranks: on gloo through CPU
    patch P8 (accelerator/megatron_cpu.py)."""
    if not (options.packed_sequences and pp > 1):
        return {}
    return {"variable_seq_lengths": True, "moe_token_dispatcher_type": "alltoall"}


def layers_of_stage(spec: Qwen2Spec, pp_rank: int, pp: int) -> range:
    """Global layer indices owned by training pipeline stage `pp_rank` (models/pipeline_stages.py)."""
    stages = spec.pipeline_stage_layers if pp > 1 else None
    return stage_layer_range(spec.num_layers, pp_rank, pp, stages)


def _pipeline_layout_fields(spec: Qwen2Spec, pp: int) -> dict:
    """Uneven stages reach Megatron as its layout; even ones keep Megatron's own split (no layout)."""
    stages = spec.pipeline_stage_layers
    if pp == 1 or stages is None or len(set(stages)) == 1:
        return {}
    stage_layer_range(spec.num_layers, 0, pp, stages)  # the same check as every other reader
    return {"pipeline_model_parallel_layout": megatron_pipeline_layout(stages)}
