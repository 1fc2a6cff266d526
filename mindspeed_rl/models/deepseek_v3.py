"""DeepSeek-V3 (HF `model_type: deepseek_v3`) on Megatron-core and vLLM: config, layouts, absorbed weights.

What differs from Qwen3-MoE, and where Megatron's local spec puts it (checked against transformers'
DeepseekV3ForCausalLM by tests/test_deepseek_v3.py):
- Multi-head latent attention (MLA). HF `q_a_proj` / `kv_a_proj_with_mqa` are Megatron's
  `linear_q_down_proj` / `linear_kv_down_proj`: ColumnParallelLinear in the local spec, so their rows
  are split evenly over TP and gathered after the GEMM (vLLM keeps them whole, fused as
  `fused_qkv_a_proj` = [q_a; kv_a]). `q_b_proj` / `kv_b_proj` split whole heads over TP in both
  (rows per head [nope; rope] and [nope; v], the same order everywhere); `o_proj` splits columns.
  Megatron's MLA RoPE de-interleaves the rope dims as HF does with `rope_interleave` (vLLM: not neox).
- Dense first layers (`first_k_dense_replace`) -> Megatron's `moe_layer_freq` list.
- Router: sigmoid scores, `e_score_correction_bias` (Megatron's `mlp.router.expert_bias`, a buffer),
  group-limited top-k and `routed_scaling_factor`; shared experts (`mlp.shared_experts.linear_fc1` =
  [gate; up] per TP shard).
- YaRN RoPE scaling (`rope_scaling` type yarn, as the published checkpoints have): Megatron's
  MLATransformerConfig rope_type "yarn" (`yarn_megatron_fields`: the same frequencies, cos/sin factor and
  softmax scale as transformers' and vLLM's; the one case where HF and vLLM disagree is refused).
vLLM derives `W_UK_T` / `W_UV` from `kv_b_proj` once after loading; a push must refresh them
(`refresh_absorbed_mla_weights`).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch


@dataclass(frozen=True, kw_only=True)
class YaRN:
    """HF's YaRN numbers (rope_scaling / rope_parameters), defaults filled in as transformers fills them."""

    factor: float
    original_max_position_embeddings: int
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: Optional[float] = None
    mscale_all_dim: Optional[float] = None


@dataclass(frozen=True, kw_only=True)
class DeepSeekV3Fields:
    """The architecture numbers only DeepSeek-V3 has (the rest live in Qwen2Spec)."""

    q_lora_rank: Optional[int]  # None: one `q_proj`, no query compression
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    first_dense_layers: int
    num_shared_experts: int
    num_groups: int  # n_group; 1: no group limit
    group_topk: int
    routed_scaling_factor: float
    yarn: Optional[YaRN] = None  # None: plain RoPE

    @property
    def q_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim


def spec_fields_from_hf_config(hf_config) -> dict:
    """Qwen2Spec keyword arguments of a DeepSeek-V3 config; ValueError names what the engine cannot build."""
    _refuse_unsupported(hf_config)
    heads = hf_config.num_attention_heads
    fields = DeepSeekV3Fields(
        q_lora_rank=hf_config.q_lora_rank, kv_lora_rank=hf_config.kv_lora_rank,
        qk_nope_head_dim=hf_config.qk_nope_head_dim, qk_rope_head_dim=hf_config.qk_rope_head_dim,
        v_head_dim=hf_config.v_head_dim, first_dense_layers=hf_config.first_k_dense_replace or 0,
        num_shared_experts=hf_config.n_shared_experts or 0, num_groups=hf_config.n_group or 1,
        group_topk=hf_config.topk_group or 1, routed_scaling_factor=float(hf_config.routed_scaling_factor or 1.0),
        yarn=yarn_from_hf_config(hf_config),
    )
    return dict(
        ffn_hidden_size=hf_config.intermediate_size, num_query_groups=heads,
        head_dim=fields.q_head_dim, qkv_bias=False, qk_layernorm=False,
        num_experts=hf_config.n_routed_experts, moe_ffn_hidden_size=hf_config.moe_intermediate_size,
        moe_topk=hf_config.num_experts_per_tok, norm_topk_prob=True, deepseek=fields,
    )


def _refuse_unsupported(hf_config) -> None:
    if not getattr(hf_config, "rope_interleave", True):
        raise ValueError("DeepSeek-V3: rope_interleave=false is not supported (Megatron's MLA RoPE is interleaved)")
    if getattr(hf_config, "attention_bias", False):
        raise ValueError("DeepSeek-V3: attention_bias=true is not supported (Megatron's MLA has no projection biases)")
    if not getattr(hf_config, "norm_topk_prob", True):
        raise ValueError("DeepSeek-V3: norm_topk_prob=false is not supported: Megatron's sigmoid router always "
                         "renormalises the top-k scores")
    if getattr(hf_config, "moe_layer_freq", 1) != 1:
        raise ValueError("DeepSeek-V3: moe_layer_freq != 1 is not supported")
    for key, value in (("topk_method", "noaux_tc"), ("scoring_func", "sigmoid")):
        if getattr(hf_config, key, value) != value:
            raise ValueError(f"DeepSeek-V3: {key}={getattr(hf_config, key)!r} is not supported (only {value!r}, "
                             "the scoring transformers' DeepseekV3 implements)")
    groups, topk = hf_config.n_group or 1, hf_config.num_experts_per_tok
    if groups > 1 and topk // (hf_config.topk_group or 1) != 2:
        # HF and vLLM score a group by its top-2 experts, Megatron by its top (topk / group_topk).
        raise ValueError(f"DeepSeek-V3: group-limited routing needs num_experts_per_tok / topk_group = 2 (Megatron "
                         f"scores a group by its top topk/topk_group experts, HF and vLLM by the top 2); got "
                         f"{topk} / {hf_config.topk_group}")


def yarn_from_hf_config(hf_config) -> Optional[YaRN]:
    """The checkpoint's YaRN (None: plain RoPE); ValueError for a scaling the three implementations do not share."""
    rope = getattr(hf_config, "rope_parameters", None) or getattr(hf_config, "rope_scaling", None) or {}
    kind = rope.get("rope_type", rope.get("type", "default"))
    if kind == "default":
        return None
    if kind != "yarn":
        raise ValueError(f"DeepSeek-V3: rope_scaling type {kind!r} is not built (only yarn)")
    for key, plain in (("attention_factor", None), ("truncate", True), ("partial_rotary_factor", 1.0)):
        if rope.get(key, plain) != plain:
            # vLLM reads attention_factor 1.0 as "no softmax mscale" (HF does not); Megatron always truncates
            # the correction range and rotates every rope dim.
            raise ValueError(f"DeepSeek-V3: rope_scaling.{key}={rope[key]!r} is not supported")
    mscale, mscale_all_dim = rope.get("mscale"), rope.get("mscale_all_dim")
    if bool(mscale) != bool(mscale_all_dim) and not (not mscale_all_dim and mscale in (None, 1)):
        # HF then scales cos/sin by get_mscale(factor) alone, vLLM by mscale / mscale_all_dim.
        raise ValueError(f"DeepSeek-V3: rope_scaling mscale={mscale!r} with mscale_all_dim={mscale_all_dim!r}: "
                         "transformers and vLLM compute different YaRN attention factors; give both or neither")
    original = int(rope["original_max_position_embeddings"])
    factor = rope.get("factor") or hf_config.max_position_embeddings / original  # transformers' default
    return YaRN(factor=float(factor), original_max_position_embeddings=original,
                beta_fast=float(rope.get("beta_fast") or 32), beta_slow=float(rope.get("beta_slow") or 1),
                mscale=mscale, mscale_all_dim=mscale_all_dim)


def yarn_megatron_fields(yarn: Optional[YaRN]) -> dict:
    """MLATransformerConfig's RoPE fields. HF scales cos/sin by get_mscale(factor, mscale) / get_mscale(factor,
    mscale_all_dim) when both are set, else by get_mscale(factor), and the softmax by get_mscale(factor,
    mscale_all_dim)^2 when mscale_all_dim is set; Megatron by the same quotient of its mscale / mscale_all_dim
    and the softmax by get_mscale(factor, mscale_all_dim)^2 (1 for 0). Neither set in HF: Megatron's 1 / 0 gives
    get_mscale(factor, 1) / 1 and a plain softmax, the same numbers."""
    if yarn is None:
        return dict(rope_type="rope", rotary_scaling_factor=1.0)
    both = bool(yarn.mscale) and bool(yarn.mscale_all_dim)
    return dict(rope_type="yarn", rotary_scaling_factor=yarn.factor,
                original_max_position_embeddings=yarn.original_max_position_embeddings,
                beta_fast=yarn.beta_fast, beta_slow=yarn.beta_slow,
                mscale=float(yarn.mscale) if both else 1.0,
                mscale_all_dim=float(yarn.mscale_all_dim) if both else 0.0)


# -- Megatron ------------------------------------------------------------------------------------
def megatron_config_fields(spec) -> dict:
    """MLATransformerConfig fields beyond Qwen's (attention, router, shared experts, dense layers)."""
    ds = spec.deepseek
    grouped = ds.num_groups > 1
    return dict(
        multi_latent_attention=True, q_lora_rank=ds.q_lora_rank, kv_lora_rank=ds.kv_lora_rank,
        qk_head_dim=ds.qk_nope_head_dim, qk_pos_emb_head_dim=ds.qk_rope_head_dim, v_head_dim=ds.v_head_dim,
        rotary_base=spec.rope_theta, **yarn_megatron_fields(ds.yarn),
        qk_layernorm=True,  # MLA's q_layernorm / kv_layernorm (HF q_a_layernorm / kv_a_layernorm)
        moe_router_score_function="sigmoid", moe_router_enable_expert_bias=True,
        # The bias is a buffer: the weight push and the export move parameters and it, but Megatron's
        # aux-loss-free update would change it in every step behind vLLM's back; RL keeps it as trained.
        moe_router_bias_update_rate=0.0,
        moe_router_num_groups=ds.num_groups if grouped else None,
        moe_router_group_topk=ds.group_topk if grouped else None,
        moe_router_topk_scaling_factor=ds.routed_scaling_factor,
        moe_shared_expert_intermediate_size=ds.num_shared_experts * spec.moe_ffn_hidden_size or None,
        moe_layer_freq=[0] * ds.first_dense_layers + [1] * (spec.num_layers - ds.first_dense_layers),
        moe_router_pre_softmax=False,
    )


def decoder_block_spec(config, sequence_parallel_norms: bool, packed: bool = False):
    """This stage's layer specs (dense or MoE per `moe_layer_freq`), local modules only; `packed`: the core
    attention takes packed micro-batches (THD) too."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec

    _mla_without_transformer_engine()
    block = get_gpt_decoder_block_spec(config, use_transformer_engine=False, normalization="RMSNorm")
    from mindspeed_rl.models.context_parallel import core_attention_class

    # Under CP, Megatron's MLA rotates this rank's chunks itself (its cp_group).
    core_attention = core_attention_class(config.context_parallel_size,
                                          otherwise=mla_core_attention_class(packed=packed))
    for layer in block.layer_specs:
        layer.submodules.self_attention.submodules.core_attention = core_attention
    if sequence_parallel_norms:
        from mindspeed_rl.accelerator.megatron_cpu import SequenceParallelRMSNorm, sequence_parallel_layer_spec

        block.layer_specs = [sequence_parallel_layer_spec(layer) for layer in block.layer_specs]
        block.layer_norm = SequenceParallelRMSNorm
    return block


def _mla_without_transformer_engine() -> None:
    """Here TransformerEngine imports as a stub whose classes are mocks, so Megatron's MLA sets HAVE_TE and
    then fails at `isinstance(self.linear_proj, TELinear)` (multi_latent_attention.py:185, "arg 2 must be a
    type"). Without a real TELinear the module is what a TE-less install has: HAVE_TE False."""
    from megatron.core.transformer import multi_latent_attention

    if not isinstance(multi_latent_attention.TELinear, type):
        multi_latent_attention.HAVE_TE = False


def mla_core_attention_class(packed: bool = False):
    """Megatron's local DotProductAttention for MLA: MLA passes `k_channels` / `v_channels` (keys are
    nope + rope wide, values v_head_dim), which only TransformerEngine's attention accepts in
    Megatron-core 0.16; the local one sizes its output by kv_channels. Same math, output sized by v. `packed`:
    on models/packed_attention.py's class (MLA hands it THD q/k/v after rotating each sample from cu_seqlens)."""
    from megatron.core.transformer.dot_product_attention import DotProductAttention

    from mindspeed_rl.models.packed_attention import PackedDotProductAttention

    base = PackedDotProductAttention if packed else DotProductAttention

    class MLADotProductAttention(base):
        # Attention.__init__ builds one without the channels first; MLA then builds its own with them.
        def __init__(self, config, *args, k_channels: int | None = None, v_channels: int | None = None, **kwargs):
            super().__init__(config, *args, **kwargs)
            if v_channels is not None:
                self.hidden_size_per_attention_head = v_channels
                self.hidden_size_per_partition = v_channels * self.num_attention_heads_per_partition

    return MLADotProductAttention


def expert_bias_buffers(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Routers' expert_bias buffers by name: part of the weights the layouts move (not parameters)."""
    return {name: buf for name, buf in module.named_buffers() if name.endswith("mlp.router.expert_bias")}


# -- vLLM ----------------------------------------------------------------------------------------
@torch.no_grad()
def refresh_absorbed_mla_weights(model: torch.nn.Module) -> int:
    """Recompute vLLM's `W_UK_T` [N, P, L] / `W_UV` [N, L, V] from each layer's (pushed) `kv_b_proj`, as
    MLAAttention.process_weights_after_loading does once at load; returns the layers refreshed."""
    count = 0
    for module in model.modules():
        if not (hasattr(module, "W_UK_T") and hasattr(module, "W_UV") and hasattr(module, "kv_b_proj")):
            continue
        weight = module.kv_b_proj.weight  # [N * (P + V), L], plain after engines/vllm_cpu_linears.unpack_cpu_linears
        heads, nope, v = module.W_UK_T.shape[0], module.qk_nope_head_dim, module.v_head_dim
        per_head = weight.t().reshape(weight.shape[1], heads, nope + v)
        w_uk, w_uv = per_head.split([nope, v], dim=-1)
        module.W_UK_T.copy_(w_uk.permute(1, 2, 0))
        module.W_UV.copy_(w_uv.transpose(0, 1))
        count += 1
    return count
