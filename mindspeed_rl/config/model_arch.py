"""Entries of the top-level `model` mapping: MindSpeed-RL's per-model architecture blocks.

`configs/model/<name>.yaml` holds a top-level `<name>:` block; the training YAML pulls it in with
`defaults: [model: [<name>]]`, so Hydra places it at `cfg.model.<name>`, and
`actor_config.model: <name>` selects it. The engines build the model from the HF checkpoint; a block
exists so that parallel sizes can be checked against the architecture before any process starts, and
its fields are compared with the checkpoint's config.json at start (`model_check.py`). Fields that
describe the model families this engine builds (Qwen2/Qwen2.5/Qwen3 dense, Qwen3-MoE and DeepSeek-V3)
accept their one value; kernel options are not architecture (`no_effect.py`, `removed.py`).
"""

from dataclasses import dataclass
from typing import Optional

from mindspeed_rl.config.checks import full_key, require_choice, require_non_negative, require_only, require_positive
from mindspeed_rl.errors import ConfigError

MOE_LOAD_BALANCING_TYPES = ("none", "aux_loss", "seq_aux_loss")
FAMILY = "the engine builds the Qwen2/Qwen3 and DeepSeek-V3 families from the HF checkpoint"
ROUTER_SCORE_FUNCTIONS = ("softmax", "sigmoid")
# YaRN is the one RoPE scaling built (DeepSeek-V3, models/deepseek_v3.py); Qwen checkpoints with rope_scaling are refused.
ROPE_SCALING_TYPES = ("yarn",)


@dataclass(kw_only=True)
class ModelArchConfig:
    """One architecture block. Optional fields left None are not checked."""

    # Validated only (true): the engine builds Megatron-core models.
    use_mcore_models: Optional[bool] = None
    num_layers: int
    hidden_size: int
    ffn_hidden_size: int
    num_attention_heads: int
    rotary_base: Optional[float] = None
    max_position_embeddings: Optional[int] = None
    # Validated only (1): the embedding has exactly the checkpoint's vocab_size rows, no padding.
    make_vocab_size_divisible_by: Optional[int] = None
    # Rows of the embedding/output matrices (tokenizer vocab rounded up); sharded over TP.
    padded_vocab_size: Optional[int] = None
    untie_embeddings_and_output_weights: Optional[bool] = None
    add_qkv_bias: Optional[bool] = None
    # Validated only (true): Qwen linear layers have no bias; the QKV bias is add_qkv_bias.
    disable_bias_linear: Optional[bool] = None
    group_query_attention: Optional[bool] = None
    num_query_groups: Optional[int] = None
    # Validated only (rope, RMSNorm, true): the Qwen family's one choice each.
    position_embedding_type: Optional[str] = None
    normalization: Optional[str] = None
    norm_epsilon: Optional[float] = None
    swiglu: Optional[bool] = None
    attention_bias: Optional[bool] = None
    qk_layernorm: Optional[bool] = None
    kv_channels: Optional[int] = None
    # Mixture of experts (Qwen3-MoE blocks).
    num_experts: Optional[int] = None
    moe_router_topk: Optional[int] = None
    moe_ffn_hidden_size: Optional[int] = None
    # Megatron's router load balancing in the update: "none" (null), or "aux_loss" (Switch Transformer) and
    # "seq_aux_loss" (per sequence) adding moe_aux_loss_coeff x the balance loss to the objective.
    moe_router_load_balancing_type: Optional[str] = None
    moe_aux_loss_coeff: Optional[float] = None
    norm_topk_prob: Optional[bool] = None
    # DeepSeek-V3 (MindSpeed-LLM / Megatron names; each compared with its config.json key in model_check.py).
    # Multi-head latent attention: q_lora_rank, kv_lora_rank, qk_head_dim (HF qk_nope_head_dim: the part of
    # a query/key head without RoPE), qk_pos_emb_head_dim (HF qk_rope_head_dim), v_head_dim.
    multi_latent_attention: Optional[bool] = None
    q_lora_rank: Optional[int] = None
    kv_lora_rank: Optional[int] = None
    qk_head_dim: Optional[int] = None
    qk_pos_emb_head_dim: Optional[int] = None
    v_head_dim: Optional[int] = None
    n_shared_experts: Optional[int] = None
    # The first k layers are dense; from there on every moe_layer_freq-th layer is MoE (MindSpeed-LLM's int).
    first_k_dense_replace: Optional[int] = None
    moe_layer_freq: Optional[int] = None
    moe_router_score_function: Optional[str] = None
    moe_router_num_groups: Optional[int] = None  # HF n_group
    moe_router_group_topk: Optional[int] = None  # HF topk_group
    moe_router_enable_expert_bias: Optional[bool] = None  # HF e_score_correction_bias (topk_method noaux_tc)
    moe_router_topk_scaling_factor: Optional[float] = None  # HF routed_scaling_factor
    # RoPE scaling (HF rope_scaling / rope_parameters: type, factor, original_max_position_embeddings, mscale,
    # mscale_all_dim, beta_fast, beta_slow).
    rope_scaling_type: Optional[str] = None
    rope_scaling_factor: Optional[float] = None
    rope_scaling_original_max_position_embeddings: Optional[int] = None
    rope_scaling_mscale: Optional[float] = None
    rope_scaling_mscale_all_dim: Optional[float] = None
    beta_fast: Optional[float] = None
    beta_slow: Optional[float] = None

    @property
    def num_key_value_heads(self) -> int:
        """KV heads: Megatron reads num_query_groups only under group_query_attention."""
        if self.group_query_attention and self.num_query_groups is not None:
            return self.num_query_groups
        return self.num_attention_heads

    def check(self, prefix: str) -> None:
        """Validate under ``prefix`` (``model.<name>``). Not a ``__post_init__``: a block does not
        know its own name, which the error must carry, so GRPOConfig calls this for each block."""
        require_positive(
            prefix,
            self,
            "num_layers",
            "hidden_size",
            "ffn_hidden_size",
            "num_attention_heads",
            "max_position_embeddings",
            "padded_vocab_size",
            "num_query_groups",
            "kv_channels",
            "norm_epsilon",
            "num_experts",
            "moe_router_topk",
            "moe_ffn_hidden_size",
            "q_lora_rank",
            "kv_lora_rank",
            "qk_head_dim",
            "qk_pos_emb_head_dim",
            "v_head_dim",
            "moe_router_num_groups",
            "moe_router_group_topk",
            "moe_router_topk_scaling_factor",
            "rope_scaling_factor",
            "rope_scaling_original_max_position_embeddings",
            "beta_fast",
            "beta_slow",
        )
        require_non_negative(prefix, self, "n_shared_experts", "first_k_dense_replace", "rope_scaling_mscale",
                             "rope_scaling_mscale_all_dim")
        self._check_family(prefix)
        if self.group_query_attention and self.num_query_groups is None:
            raise ConfigError(full_key(prefix, "num_query_groups"), "must be set when group_query_attention is true")
        if self.num_attention_heads % self.num_key_value_heads != 0:
            raise ConfigError(
                full_key(prefix, "num_query_groups"),
                f"must divide {prefix}.num_attention_heads={self.num_attention_heads}, got {self.num_query_groups}",
            )
        # Without kv_channels Megatron derives the head size as hidden_size / num_attention_heads.
        if self.kv_channels is None and self.hidden_size % self.num_attention_heads != 0:
            raise ConfigError(
                full_key(prefix, "num_attention_heads"),
                f"must divide {prefix}.hidden_size={self.hidden_size} (or set kv_channels), "
                f"got {self.num_attention_heads}",
            )
        experts, top_k = self.num_experts, self.moe_router_topk
        if experts is not None and top_k is not None and top_k > experts:
            raise ConfigError(
                full_key(prefix, "moe_router_topk"),
                f"must be <= {prefix}.num_experts={experts}, got {top_k}",
            )
        self._check_routing_groups(prefix)
        dense = self.first_k_dense_replace
        if dense is not None and dense > self.num_layers:
            raise ConfigError(full_key(prefix, "first_k_dense_replace"),
                              f"must be <= {prefix}.num_layers={self.num_layers}, got {dense}")

    def _check_routing_groups(self, prefix: str) -> None:
        groups, group_topk = self.moe_router_num_groups, self.moe_router_group_topk
        if groups is not None and self.num_experts is not None and self.num_experts % groups != 0:
            raise ConfigError(full_key(prefix, "moe_router_num_groups"),
                              f"must divide {prefix}.num_experts={self.num_experts}, got {groups}")
        if groups is not None and group_topk is not None and group_topk > groups:
            raise ConfigError(full_key(prefix, "moe_router_group_topk"),
                              f"must be <= {prefix}.moe_router_num_groups={groups}, got {group_topk}")

    def _check_family(self, prefix: str) -> None:
        """Keys that MindSpeed-RL model files carry and that have one value for what we build."""
        require_only(prefix, self, "use_mcore_models", True, "the engine builds Megatron-core (mcore) models only")
        require_only(prefix, self, "make_vocab_size_divisible_by", 1,
                     "the embedding has exactly the checkpoint's vocab_size rows (no padding to a multiple)")
        require_only(prefix, self, "disable_bias_linear", True,
                     f"{FAMILY}, whose linear layers have no bias (the QKV bias is add_qkv_bias)")
        require_only(prefix, self, "position_embedding_type", "rope", f"{FAMILY}, which uses rotary embeddings")
        require_only(prefix, self, "normalization", "RMSNorm", f"{FAMILY}, which uses RMSNorm")
        require_only(prefix, self, "swiglu", True, f"{FAMILY}, whose MLP is SwiGLU")
        if self.moe_router_load_balancing_type is not None:
            require_choice(prefix, self, "moe_router_load_balancing_type", MOE_LOAD_BALANCING_TYPES)
        require_non_negative(prefix, self, "moe_aux_loss_coeff")
        # The engine builds MoE on every layer from first_k_dense_replace on (HF DeepSeek-V3's moe_layer_freq 1).
        require_only(prefix, self, "moe_layer_freq", 1,
                     "every layer from first_k_dense_replace on is a MoE layer (the one layout the engine builds)")
        if self.moe_router_score_function is not None:
            require_choice(prefix, self, "moe_router_score_function", ROUTER_SCORE_FUNCTIONS)
        if self.rope_scaling_type is not None:
            require_choice(prefix, self, "rope_scaling_type", ROPE_SCALING_TYPES)
