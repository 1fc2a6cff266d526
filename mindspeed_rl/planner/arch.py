"""An architecture description from an HF `config.json` dict: what the planner needs to size every tensor.

Three families: Qwen2 / Qwen2.5 dense (`qwen2`, and Qwen3 dense `qwen3`), Qwen3-MoE (`qwen3_moe`), and
DeepSeek-V3 (`deepseek_v3`: multi-head latent attention, dense first layers, routed + shared experts).
The engine trains Qwen2 dense, Qwen3-MoE and DeepSeek-V3 (`Architecture.trainable`); the planner sizes
Qwen3 dense too and says so. DeepSeek-V3's multi-token-prediction module (`num_nextn_predict_layers`) is
left out of every count, as in its published 671B (the engine does not build it either).
"""
from __future__ import annotations

from dataclasses import dataclass

from mindspeed_rl.config.model_check import expert_count_key

TRAINABLE_TYPES = ("qwen2", "qwen3_moe", "deepseek_v3")
PLANNED_TYPES = ("qwen2", "qwen3", "qwen3_moe", "deepseek_v3")


class ArchitectureError(ValueError):
    """A config.json the planner cannot describe; the message names the field."""


@dataclass(frozen=True, kw_only=True)
class Architecture:
    model_type: str
    name: str  # config.json's architectures[0], or the model_type
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_attention_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int  # the dense MLP (DeepSeek-V3: its first dense layers)
    tie_word_embeddings: bool
    qkv_bias: bool = False
    qk_norm: bool = False  # Qwen3's per-head q_norm / k_norm
    num_experts: int = 0
    moe_intermediate_size: int = 0
    moe_topk: int = 0
    norm_topk_prob: bool = True
    num_shared_experts: int = 0  # each moe_intermediate_size wide (DeepSeek-V3)
    first_dense_layers: int = 0  # DeepSeek-V3's first_k_dense_replace
    router_bias: bool = False  # DeepSeek-V3's e_score_correction_bias (a buffer in Megatron)
    q_lora_rank: int | None = None  # multi-head latent attention (MLA) when kv_lora_rank > 0
    kv_lora_rank: int = 0
    qk_nope_head_dim: int = 0
    qk_rope_head_dim: int = 0
    v_head_dim: int = 0
    mtp_layers: int = 0  # excluded from every count
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    max_position_embeddings: int = 4096
    # Layers of each training pipeline stage (actor_config.num_layer_list); None: the even split.
    pipeline_stage_layers: tuple[int, ...] | None = None

    # -- what it is ------------------------------------------------------------------------------------
    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    @property
    def is_mla(self) -> bool:
        return self.kv_lora_rank > 0

    @property
    def trainable(self) -> bool:
        return self.model_type in TRAINABLE_TYPES

    @property
    def support(self) -> str:
        """One line: what the engine can do with this architecture."""
        if self.trainable:
            return "the engine can train it (Megatron + vLLM layouts and the resharding plan cover it)"
        return "planner only: the engine cannot train it yet (Qwen3 dense is not covered by the engine's tests)"

    def is_moe_layer(self, layer: int) -> bool:
        return self.is_moe and layer >= self.first_dense_layers

    @property
    def q_width(self) -> int:
        """Rows of the query projection (all heads)."""
        per_head = self.qk_nope_head_dim + self.qk_rope_head_dim if self.is_mla else self.head_dim
        return self.num_attention_heads * per_head

    @property
    def kv_width(self) -> int:
        """Rows of the key (or value) projection: the KV heads; with MLA the per-head keys the latent expands to."""
        if self.is_mla:
            return self.num_attention_heads * (self.qk_nope_head_dim + self.qk_rope_head_dim)
        return self.num_kv_heads * self.head_dim

    @property
    def shared_expert_size(self) -> int:
        return self.num_shared_experts * self.moe_intermediate_size

    def kv_bytes_per_token(self, infer_tp: int, dtype_bytes: int, layers: int | None = None) -> int:
        """KV-cache bytes one token takes on one vLLM rank: K and V of the rank's KV heads (replicated
        when infer TP exceeds them) in each of `layers` layers (default all; a pipeline stage caches only
        its own); with MLA the compressed latent and the rope key, which every TP rank holds whole."""
        layers = self.num_layers if layers is None else layers
        if self.is_mla:
            return layers * (self.kv_lora_rank + self.qk_rope_head_dim) * dtype_bytes
        kv_heads = max(self.num_kv_heads // infer_tp, 1)
        return 2 * layers * kv_heads * self.head_dim * dtype_bytes

    # -- counts ----------------------------------------------------------------------------------------
    def attention_parameters(self) -> int:
        h = self.hidden_size
        if self.is_mla:
            a = self.num_attention_heads
            q_head = self.qk_nope_head_dim + self.qk_rope_head_dim
            if self.q_lora_rank:
                q = self.q_lora_rank * h + self.q_lora_rank + a * q_head * self.q_lora_rank
            else:
                q = a * q_head * h
            kv = (self.kv_lora_rank + self.qk_rope_head_dim) * h + self.kv_lora_rank \
                + a * (self.qk_nope_head_dim + self.v_head_dim) * self.kv_lora_rank
            return q + kv + h * a * self.v_head_dim
        q, kv = self.num_attention_heads * self.head_dim, self.num_kv_heads * self.head_dim
        total = q * h + 2 * kv * h + h * q
        if self.qkv_bias:
            total += q + 2 * kv
        if self.qk_norm:
            total += 2 * self.head_dim
        return total

    def mlp_parameters(self, layer: int) -> int:
        h = self.hidden_size
        if not self.is_moe_layer(layer):
            return 3 * h * self.intermediate_size
        experts = self.num_experts * 3 * h * self.moe_intermediate_size
        shared = 3 * h * self.shared_expert_size
        router = self.num_experts * h + (self.num_experts if self.router_bias else 0)
        return experts + shared + router

    def layer_parameters(self, layer: int) -> int:
        return 2 * self.hidden_size + self.attention_parameters() + self.mlp_parameters(layer)

    def parameter_count(self) -> int:
        """Every parameter of the HF checkpoint (DeepSeek-V3's MTP module excluded)."""
        embeddings = self.vocab_size * self.hidden_size * (1 if self.tie_word_embeddings else 2)
        return embeddings + self.hidden_size + sum(self.layer_parameters(i) for i in range(self.num_layers))

    def active_parameter_count(self) -> int:
        """Parameters one token passes through (MoE: top-k routed experts + shared ones)."""
        if not self.is_moe:
            return self.parameter_count()
        idle = (self.num_experts - self.moe_topk) * 3 * self.hidden_size * self.moe_intermediate_size
        return self.parameter_count() - idle * sum(self.is_moe_layer(i) for i in range(self.num_layers))

    # -- the engine's own spec -------------------------------------------------------------------------
    def to_spec(self):
        """The engine's `Qwen2Spec` (what its layouts and the resharding plan take)."""
        from mindspeed_rl.models.qwen2 import Qwen2Spec

        if self.is_mla:
            return self._deepseek_spec()
        return Qwen2Spec(
            vocab_size=self.vocab_size, hidden_size=self.hidden_size, ffn_hidden_size=self.intermediate_size,
            num_layers=self.num_layers, num_attention_heads=self.num_attention_heads,
            num_query_groups=self.num_kv_heads, head_dim=self.head_dim, rms_norm_eps=self.rms_norm_eps,
            rope_theta=self.rope_theta, max_position_embeddings=self.max_position_embeddings,
            tie_word_embeddings=self.tie_word_embeddings, qkv_bias=self.qkv_bias, qk_layernorm=self.qk_norm,
            num_experts=self.num_experts, moe_ffn_hidden_size=self.moe_intermediate_size, moe_topk=self.moe_topk,
            norm_topk_prob=self.norm_topk_prob, pipeline_stage_layers=self.pipeline_stage_layers,
        )

    def _deepseek_spec(self):
        """As models/deepseek_v3.spec_fields_from_hf_config builds it; the routing numbers (groups, scaling)
        and the RoPE scaling shape no tensor, so the planner leaves them at their defaults."""
        from mindspeed_rl.models.deepseek_v3 import DeepSeekV3Fields
        from mindspeed_rl.models.qwen2 import Qwen2Spec

        fields = DeepSeekV3Fields(
            q_lora_rank=self.q_lora_rank, kv_lora_rank=self.kv_lora_rank, qk_nope_head_dim=self.qk_nope_head_dim,
            qk_rope_head_dim=self.qk_rope_head_dim, v_head_dim=self.v_head_dim,
            first_dense_layers=self.first_dense_layers, num_shared_experts=self.num_shared_experts, num_groups=1,
            group_topk=1, routed_scaling_factor=1.0)
        return Qwen2Spec(
            vocab_size=self.vocab_size, hidden_size=self.hidden_size, ffn_hidden_size=self.intermediate_size,
            num_layers=self.num_layers, num_attention_heads=self.num_attention_heads,
            num_query_groups=self.num_attention_heads, head_dim=fields.q_head_dim, rms_norm_eps=self.rms_norm_eps,
            rope_theta=self.rope_theta, max_position_embeddings=self.max_position_embeddings,
            tie_word_embeddings=self.tie_word_embeddings, qkv_bias=False, qk_layernorm=False,
            num_experts=self.num_experts, moe_ffn_hidden_size=self.moe_intermediate_size, moe_topk=self.moe_topk,
            norm_topk_prob=self.norm_topk_prob, pipeline_stage_layers=self.pipeline_stage_layers, deepseek=fields,
        )


def _required(config: dict, key: str, where: str):
    value = config.get(key)
    if value is None:
        raise ArchitectureError(f"{where}: config.json has no {key!r}")
    return value


def from_hf_config(config: dict, *, where: str = "config.json") -> Architecture:
    """An Architecture from a parsed HF config.json. Raises ArchitectureError naming the missing field."""
    model_type = config.get("model_type")
    if model_type not in PLANNED_TYPES:
        raise ArchitectureError(f"{where}: model_type {model_type!r} is not one the planner knows "
                                f"({', '.join(PLANNED_TYPES)})")
    get = lambda key: _required(config, key, where)  # noqa: E731
    hidden, heads = int(get("hidden_size")), int(get("num_attention_heads"))
    rope_theta = config.get("rope_theta")
    if rope_theta is None:
        rope_theta = (config.get("rope_parameters") or {}).get("rope_theta", 10000.0)
    common = dict(
        model_type=model_type, name=(config.get("architectures") or [model_type])[0],
        vocab_size=int(get("vocab_size")), hidden_size=hidden, num_layers=int(get("num_hidden_layers")),
        num_attention_heads=heads, num_kv_heads=int(config.get("num_key_value_heads") or heads),
        head_dim=int(config.get("head_dim") or hidden // heads),
        intermediate_size=int(get("intermediate_size")),
        tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
        rms_norm_eps=float(config.get("rms_norm_eps", 1e-6)), rope_theta=float(rope_theta),
        max_position_embeddings=int(config.get("max_position_embeddings") or 4096),
    )
    if model_type == "qwen2":
        return Architecture(**common, qkv_bias=bool(config.get("attention_bias", True)))
    if model_type == "qwen3":
        return Architecture(**common, qkv_bias=bool(config.get("attention_bias", False)), qk_norm=True)
    if model_type == "qwen3_moe":
        if config.get("mlp_only_layers") or config.get("decoder_sparse_step", 1) != 1:
            raise ArchitectureError(f"{where}: Qwen3-MoE with dense layers (mlp_only_layers / decoder_sparse_step) "
                                    "is not supported")
        return Architecture(**common, qkv_bias=bool(config.get("attention_bias", False)), qk_norm=True,
                            num_experts=int(get(expert_count_key(config) or "num_experts")),
                            moe_intermediate_size=int(get("moe_intermediate_size")),
                            moe_topk=int(get("num_experts_per_tok")),
                            norm_topk_prob=bool(config.get("norm_topk_prob", True)))
    # deepseek_v3
    if config.get("moe_layer_freq", 1) != 1:
        raise ArchitectureError(f"{where}: moe_layer_freq != 1 is not supported")
    return Architecture(
        **common, num_experts=int(get("n_routed_experts")), moe_intermediate_size=int(get("moe_intermediate_size")),
        moe_topk=int(get("num_experts_per_tok")), norm_topk_prob=bool(config.get("norm_topk_prob", True)),
        num_shared_experts=int(config.get("n_shared_experts") or 0),
        first_dense_layers=int(config.get("first_k_dense_replace") or 0),
        router_bias=config.get("topk_method") == "noaux_tc",
        q_lora_rank=config.get("q_lora_rank"), kv_lora_rank=int(get("kv_lora_rank")),
        qk_nope_head_dim=int(get("qk_nope_head_dim")), qk_rope_head_dim=int(get("qk_rope_head_dim")),
        v_head_dim=int(get("v_head_dim")), mtp_layers=int(config.get("num_nextn_predict_layers") or 0),
    )


def hf_config_from_model_block(block, name: str) -> dict:
    """A config.json-like dict from a `model.<name>` block (config/model_arch.py), for configs whose
    checkpoint is not on this machine and that ship no configs/model/hf/<name>.json."""
    if block.padded_vocab_size is None:
        raise ArchitectureError(f"model.{name}.padded_vocab_size: needed to size the embedding (no config.json "
                                "found for this model)")
    config = {
        "model_type": "qwen3_moe" if block.num_experts else "qwen2",
        "vocab_size": block.padded_vocab_size, "hidden_size": block.hidden_size,
        "intermediate_size": block.ffn_hidden_size, "num_hidden_layers": block.num_layers,
        "num_attention_heads": block.num_attention_heads, "num_key_value_heads": block.num_key_value_heads,
        "head_dim": block.kv_channels or block.hidden_size // block.num_attention_heads,
        "tie_word_embeddings": block.untie_embeddings_and_output_weights is False,
        "max_position_embeddings": block.max_position_embeddings or 4096,
    }
    if block.multi_latent_attention:
        return {**config, **_deepseek_config_from_block(block, name)}
    if block.num_experts:
        config.update(num_experts=block.num_experts, moe_intermediate_size=block.moe_ffn_hidden_size,
                      num_experts_per_tok=block.moe_router_topk,
                      norm_topk_prob=True if block.norm_topk_prob is None else block.norm_topk_prob,
                      attention_bias=bool(block.add_qkv_bias))
    else:
        config["attention_bias"] = True if block.add_qkv_bias is None else block.add_qkv_bias
    return config


def _deepseek_config_from_block(block, name: str) -> dict:
    """DeepSeek-V3's config.json keys from a block with multi_latent_attention (MindSpeed-LLM's names)."""
    for field in ("kv_lora_rank", "qk_head_dim", "qk_pos_emb_head_dim", "v_head_dim", "num_experts"):
        if getattr(block, field) is None:
            raise ArchitectureError(f"model.{name}.{field}: needed to size multi-head latent attention and the "
                                    "experts (no config.json found for this model)")
    return {
        "model_type": "deepseek_v3", "num_key_value_heads": block.num_attention_heads,
        "q_lora_rank": block.q_lora_rank, "kv_lora_rank": block.kv_lora_rank,
        "qk_nope_head_dim": block.qk_head_dim, "qk_rope_head_dim": block.qk_pos_emb_head_dim,
        "v_head_dim": block.v_head_dim, "n_routed_experts": block.num_experts,
        "moe_intermediate_size": block.moe_ffn_hidden_size, "num_experts_per_tok": block.moe_router_topk,
        "norm_topk_prob": True if block.norm_topk_prob is None else block.norm_topk_prob,
        "n_shared_experts": block.n_shared_experts or 0, "first_k_dense_replace": block.first_k_dense_replace or 0,
        "moe_layer_freq": block.moe_layer_freq or 1,
        "topk_method": "noaux_tc" if block.moe_router_enable_expert_bias else "greedy",
        "attention_bias": False,
    }
