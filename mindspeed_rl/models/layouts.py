"""Where every HF tensor lives in Megatron's training layout and in vLLM's inference layout.

A rank-local tensor (a Megatron parameter shard, a vLLM parameter shard) is described as a list
of `Segment`s: contiguous ranges of full HF tensors placed along one dimension of the local
tensor. Everything not covered by a segment is padding (vLLM pads the vocabulary to a multiple
of 64). Both layouts are pure functions of the model spec and the parallel sizes, which is what
lets the resharding plan be computed without touching a tensor.

Megatron (checked against live shards by tests/test_megatron_layouts_multiprocess.py): `linear_qkv` interleaves [q_g, k_g, v_g] per query group
and TP takes whole groups; `linear_fc1` is [gate_r; up_r]; embedding/output rows and
`linear_proj`/`linear_fc2` columns are split evenly. vLLM: `qkv_proj` is [q_r; k_r; v_r] with KV
heads replicated when infer TP > KV heads; `gate_up_proj` is [gate_r; up_r]; vocab rows are split
over the padded vocabulary.

DeepSeek-V3 (MLA, dense first layers, shared experts): models/deepseek_v3_layouts.py.

MoE (Qwen3-MoE): each expert is its own 2-D HF tensor (`mlp.experts.{e}.gate_proj.weight`). vLLM
fuses a layer's experts into 3-D parameters (`w13_weight` [E_local, 2F', H], `w2_weight`
[E_local, H, F']), so a LocalTensor may address one expert `param[index]` of such a parameter;
its `key` ("name[index]") is what plans and transfers refer to.
"""
from __future__ import annotations

import os

from mindspeed_rl.models.qwen2 import Qwen2Spec, layers_of_stage
from mindspeed_rl.models.layout_parts import (  # noqa: F401 (LocalTensor, Segment, tensor_view: this module's API)
    LocalTensor, Segment, _even, _expert, _named, _stack, _vllm_moe, _whole, parameter_shapes, tensor_view)

VLLM_VOCAB_PADDING = 64


def hf_shapes(spec: Qwen2Spec) -> dict[str, tuple[int, ...]]:
    h, hd = spec.hidden_size, spec.head_dim
    q_rows, kv_rows = spec.num_attention_heads * hd, spec.num_query_groups * hd
    shapes = {"model.embed_tokens.weight": (spec.vocab_size, h), "model.norm.weight": (h,)}
    if not spec.tie_word_embeddings:
        shapes["lm_head.weight"] = (spec.vocab_size, h)
    for i in range(spec.num_layers):
        p = f"model.layers.{i}."
        if spec.deepseek is not None:
            from mindspeed_rl.models.deepseek_v3_layouts import layer_hf_shapes

            shapes.update(layer_hf_shapes(spec, i))
            continue
        shapes.update({
            p + "input_layernorm.weight": (h,), p + "post_attention_layernorm.weight": (h,),
            p + "self_attn.q_proj.weight": (q_rows, h), p + "self_attn.k_proj.weight": (kv_rows, h),
            p + "self_attn.v_proj.weight": (kv_rows, h), p + "self_attn.o_proj.weight": (h, q_rows),
        })
        if spec.qkv_bias:
            shapes.update({p + "self_attn.q_proj.bias": (q_rows,), p + "self_attn.k_proj.bias": (kv_rows,),
                           p + "self_attn.v_proj.bias": (kv_rows,)})
        if spec.qk_layernorm:
            shapes.update({p + "self_attn.q_norm.weight": (hd,), p + "self_attn.k_norm.weight": (hd,)})
        if spec.is_moe:
            f = spec.moe_ffn_hidden_size
            shapes[p + "mlp.gate.weight"] = (spec.num_experts, h)
            for e in range(spec.num_experts):
                x = f"{p}mlp.experts.{e}."
                shapes.update({x + "gate_proj.weight": (f, h), x + "up_proj.weight": (f, h), x + "down_proj.weight": (h, f)})
        else:
            shapes.update({p + "mlp.gate_proj.weight": (spec.ffn_hidden_size, h),
                           p + "mlp.up_proj.weight": (spec.ffn_hidden_size, h),
                           p + "mlp.down_proj.weight": (h, spec.ffn_hidden_size)})
    return shapes


def _qkv_kinds(spec: Qwen2Spec) -> tuple[tuple[str, tuple[int, ...]], ...]:
    return (("weight", (spec.hidden_size,)), ("bias", ())) if spec.qkv_bias else (("weight", (spec.hidden_size,)),)


def _qk_norms(spec: Qwen2Spec, src: str, dst_q: str, dst_k: str) -> list[LocalTensor]:
    if not spec.qk_layernorm:
        return []
    hd = (spec.head_dim,)
    return [_whole(dst_q, src + "self_attn.q_norm.weight", hd), _whole(dst_k, src + "self_attn.k_norm.weight", hd)]


# -- Megatron ------------------------------------------------------------------------------------
def megatron_layout(spec: Qwen2Spec, *, tp: int, tp_rank: int, pp: int, pp_rank: int, ep: int = 1,
                    ep_rank: int = 0) -> list[LocalTensor]:
    """The parameters of one Megatron (tp_rank, pp_rank, ep_rank) shard, named as `named_parameters()`.
    Experts: EP rank r holds experts [r*E/ep, (r+1)*E/ep), each split over expert TP = TP."""
    shapes = hf_shapes(spec)
    h, hd = spec.hidden_size, spec.head_dim
    q_per_group = spec.num_attention_heads // spec.num_query_groups
    groups_per_rank = spec.num_query_groups // tp
    f_part = spec.ffn_hidden_size // tp
    out: list[LocalTensor] = []
    if pp_rank == 0:
        out.append(_even("embedding.word_embeddings.weight", "model.embed_tokens.weight", shapes["model.embed_tokens.weight"], 0, tp_rank, tp))
    if spec.deepseek is not None:
        from mindspeed_rl.models.deepseek_v3_layouts import megatron_layers

        out += megatron_layers(spec, tp=tp, tp_rank=tp_rank, pp=pp, pp_rank=pp_rank, ep=ep, ep_rank=ep_rank)
    for local, layer in enumerate(layers_of_stage(spec, pp_rank, pp) if spec.deepseek is None else ()):
        src, dst = f"model.layers.{layer}.", f"decoder.layers.{local}."
        out.append(_whole(dst + "input_layernorm.weight", src + "input_layernorm.weight", (h,)))
        out.append(_whole(dst + "pre_mlp_layernorm.weight", src + "post_attention_layernorm.weight", (h,)))
        for kind, rest in _qkv_kinds(spec):
            pieces = []
            for g in range(tp_rank * groups_per_rank, (tp_rank + 1) * groups_per_rank):
                pieces += [(f"{src}self_attn.q_proj.{kind}", g * q_per_group * hd, q_per_group * hd),
                           (f"{src}self_attn.k_proj.{kind}", g * hd, hd),
                           (f"{src}self_attn.v_proj.{kind}", g * hd, hd)]
            out.append(_stack(f"{dst}self_attention.linear_qkv.{kind}", pieces, rest))
        out += _qk_norms(spec, src, dst + "self_attention.q_layernorm.weight", dst + "self_attention.k_layernorm.weight")
        out.append(_even(dst + "self_attention.linear_proj.weight", src + "self_attn.o_proj.weight", shapes[src + "self_attn.o_proj.weight"], 1, tp_rank, tp))
        if spec.is_moe:
            out.append(_whole(dst + "mlp.router.weight", src + "mlp.gate.weight", (spec.num_experts, h)))
            per_rank = spec.num_experts // ep
            for local in range(per_rank):
                fc1, fc2 = _expert(spec, src, ep_rank * per_rank + local, tp_rank, tp)
                m = f"{dst}mlp.experts.local_experts.{local}."
                out += [_named(fc1, m + "linear_fc1.weight"), _named(fc2, m + "linear_fc2.weight")]
            continue
        out.append(_stack(dst + "mlp.linear_fc1.weight", [(src + "mlp.gate_proj.weight", tp_rank * f_part, f_part),
                                                          (src + "mlp.up_proj.weight", tp_rank * f_part, f_part)], (h,)))
        out.append(_even(dst + "mlp.linear_fc2.weight", src + "mlp.down_proj.weight", shapes[src + "mlp.down_proj.weight"], 1, tp_rank, tp))
    if pp_rank == pp - 1:
        out.append(_whole("decoder.final_layernorm.weight", "model.norm.weight", (h,)))
        head = "model.embed_tokens.weight" if spec.tie_word_embeddings else "lm_head.weight"
        if not spec.tie_word_embeddings or pp > 1:
            out.append(_even("output_layer.weight", head, shapes[head], 0, tp_rank, tp))
    return out


# -- vLLM ----------------------------------------------------------------------------------------
def padded_vocab(vocab_size: int) -> int:
    return -(-vocab_size // VLLM_VOCAB_PADDING) * VLLM_VOCAB_PADDING


def vllm_pp_layers(num_layers: int, pp_rank: int, pp: int) -> range:
    """Global layer indices of vLLM pipeline stage `pp_rank`: vLLM's own partition
    (vllm.distributed.utils.get_pp_indices, reproduced so the plan stays free of vLLM imports; a test
    compares the two). Layers that do not divide go one each to the stages before the last, from
    the second-to-last backwards; VLLM_PP_LAYER_PARTITION overrides, as in vLLM."""
    override = os.environ.get("VLLM_PP_LAYER_PARTITION")
    if override is not None:
        partitions = [int(n) for n in override.split(",")]
        if len(partitions) != pp or sum(partitions) != num_layers:
            raise ValueError(f"VLLM_PP_LAYER_PARTITION={override} must list {pp} stages summing to {num_layers} layers")
    else:
        partitions = [num_layers // pp] * pp
        for i in range(2, num_layers % pp + 2):
            partitions[-i] += 1
    start = sum(partitions[:pp_rank])
    return range(start, start + partitions[pp_rank])


def vllm_layout(spec: Qwen2Spec, *, tp: int, tp_rank: int, dp: int = 1, dp_rank: int = 0,
                expert_parallel: bool = False, pp: int = 1, pp_rank: int = 0) -> list[LocalTensor]:
    """The parameters of one vLLM rank (Qwen2ForCausalLM / Qwen3MoeForCausalLM), named as
    `named_parameters()`. Only MoE layers depend on DP: vLLM flattens TP x DP (within a stage) for them.

    Pipeline stage `pp_rank` of `pp` holds its layers (`vllm_pp_layers`), the embedding on the first
    stage and the final norm and head on the last; a tied head is the embedding, which vLLM's Qwen2
    also builds on the last stage (PPMissingLayer elsewhere). vLLM 0.32's Qwen3-MoE allocates the
    embedding, norm and head on every stage but reads them only on the first / last, so the plan
    fills only those (the others keep their dummy values and are never used)."""
    _check_vllm_tp(spec, tp)
    first, last = pp_rank == 0, pp_rank == pp - 1
    if spec.is_moe:
        _check_vllm_moe(spec, tp * dp, expert_parallel)
    h = spec.hidden_size
    vocab_rows = padded_vocab(spec.vocab_size) // tp
    vocab_start = tp_rank * vocab_rows
    real_rows = max(0, min(spec.vocab_size - vocab_start, vocab_rows))

    def vocab_shard(name: str, hf_name: str) -> LocalTensor:
        segments = (Segment(hf_name, vocab_start, real_rows, 0),) if real_rows else ()
        return LocalTensor(name, (vocab_rows, h), 0, segments)

    out = []
    if first or (last and spec.tie_word_embeddings):
        out.append(vocab_shard("model.embed_tokens.weight", "model.embed_tokens.weight"))
    for layer in vllm_pp_layers(spec.num_layers, pp_rank, pp):
        if spec.deepseek is not None:
            from mindspeed_rl.models.deepseek_v3_layouts import vllm_layer

            out += vllm_layer(spec, layer, tp=tp, tp_rank=tp_rank, moe_size=tp * dp, moe_rank=dp_rank * tp + tp_rank,
                              expert_parallel=expert_parallel)
        else:
            out += _vllm_qwen_layer(spec, f"model.layers.{layer}.", tp=tp, tp_rank=tp_rank, dp=dp, dp_rank=dp_rank,
                                    expert_parallel=expert_parallel)
    if last:
        out.append(_whole("model.norm.weight", "model.norm.weight", (h,)))
        if not spec.tie_word_embeddings:
            out.append(vocab_shard("lm_head.weight", "lm_head.weight"))
    return out


def _vllm_qwen_layer(spec: Qwen2Spec, p: str, *, tp: int, tp_rank: int, dp: int, dp_rank: int,
                     expert_parallel: bool) -> list[LocalTensor]:
    """One Qwen2 / Qwen3-MoE decoder layer of a vLLM rank (prefix `p` = "model.layers.<i>.")."""
    h, hd = spec.hidden_size, spec.head_dim
    heads_per_rank = spec.num_attention_heads // tp
    kv_heads = spec.num_query_groups
    # vLLM replicates KV heads when there are fewer than TP ranks: rank r serves KV head r // (tp / kv).
    kv_per_rank = max(kv_heads // tp, 1)
    kv_first = tp_rank * kv_per_rank if kv_heads >= tp else tp_rank // (tp // kv_heads)
    out = []
    for kind, rest in _qkv_kinds(spec):
        out.append(_stack(f"{p}self_attn.qkv_proj.{kind}", [
            (f"{p}self_attn.q_proj.{kind}", tp_rank * heads_per_rank * hd, heads_per_rank * hd),
            (f"{p}self_attn.k_proj.{kind}", kv_first * hd, kv_per_rank * hd),
            (f"{p}self_attn.v_proj.{kind}", kv_first * hd, kv_per_rank * hd),
        ], rest))
    out.append(_even(p + "self_attn.o_proj.weight", p + "self_attn.o_proj.weight", (h, spec.num_attention_heads * hd), 1, tp_rank, tp))
    out += _qk_norms(spec, p, p + "self_attn.q_norm.weight", p + "self_attn.k_norm.weight")
    out.append(_whole(p + "input_layernorm.weight", p + "input_layernorm.weight", (h,)))
    out.append(_whole(p + "post_attention_layernorm.weight", p + "post_attention_layernorm.weight", (h,)))
    if spec.is_moe:
        return out + _vllm_moe(spec, p, tp * dp, dp_rank * tp + tp_rank, expert_parallel)
    f_part = spec.ffn_hidden_size // tp
    out.append(_stack(p + "mlp.gate_up_proj.weight", [(p + "mlp.gate_proj.weight", tp_rank * f_part, f_part),
                                                       (p + "mlp.up_proj.weight", tp_rank * f_part, f_part)], (h,)))
    out.append(_even(p + "mlp.down_proj.weight", p + "mlp.down_proj.weight", (h, spec.ffn_hidden_size), 1, tp_rank, tp))
    return out


def _check_vllm_moe(spec: Qwen2Spec, size: int, expert_parallel: bool) -> None:
    if expert_parallel and spec.num_experts % size:
        raise ValueError(f"infer EP = TP x DP = {size} must divide num_experts={spec.num_experts}")
    if not expert_parallel and spec.moe_ffn_hidden_size % size:
        raise ValueError(f"infer TP x DP = {size} must divide moe_intermediate_size={spec.moe_ffn_hidden_size} "
                         "(vLLM splits MoE layers over all TP x DP ranks without expert parallelism)")


def _check_vllm_tp(spec: Qwen2Spec, tp: int) -> None:
    if spec.deepseek is not None:
        from mindspeed_rl.models.deepseek_v3_layouts import check_vllm_tp

        return check_vllm_tp(spec, tp)
    kv = spec.num_query_groups
    if spec.num_attention_heads % tp:
        raise ValueError(f"infer TP {tp} must divide num_attention_heads={spec.num_attention_heads}")
    if (kv >= tp and kv % tp) or (kv < tp and tp % kv):
        raise ValueError(f"infer TP {tp} must divide num_key_value_heads={kv} or be a multiple of it")
    if not spec.is_moe and spec.ffn_hidden_size % tp:
        raise ValueError(f"infer TP {tp} must divide intermediate_size={spec.ffn_hidden_size}")


def uncovered_ranges(local: LocalTensor) -> list[tuple[int, int]]:
    """(start, length) ranges along `dim` that no segment fills: vLLM's vocabulary padding."""
    covered = sorted((s.local_start, s.local_start + s.length) for s in local.segments)
    gaps, position = [], 0
    for start, stop in covered:
        if start > position:
            gaps.append((position, start - position))
        position = max(position, stop)
    if position < local.shape[local.dim]:
        gaps.append((position, local.shape[local.dim] - position))
    return gaps


# -- HF <-> Megatron through the layout ------------------------------------------------------------
def megatron_shard_from_hf(hf: dict, spec: Qwen2Spec, *, tp: int, tp_rank: int, pp: int = 1, pp_rank: int = 0,
                           ep: int = 1, ep_rank: int = 0) -> dict:
    """One Megatron (tp_rank, pp_rank, ep_rank) shard cut from full HF tensors, by `megatron_layout`:
    the checkpoint load, the switch and the export read the same description of where each range lives."""
    import torch

    out = {}
    for local in megatron_layout(spec, tp=tp, tp_rank=tp_rank, pp=pp, pp_rank=pp_rank, ep=ep, ep_rank=ep_rank):
        dtype = hf[local.segments[0].hf_name].dtype
        tensor = torch.zeros(local.shape, dtype=dtype)
        for seg in local.segments:
            tensor.narrow(local.dim, seg.local_start, seg.length).copy_(
                hf[seg.hf_name].narrow(local.dim, seg.hf_start, seg.length))
        out[local.name] = tensor
    return out


def hf_from_megatron_shards(shards: list[dict], spec: Qwen2Spec, *, pp: int = 1, pp_rank: int = 0, ep: int = 1,
                            ep_rank: int = 0) -> dict:
    """Full HF tensors of one pipeline stage from all of its TP shards (index = tp_rank): the inverse of
    `megatron_shard_from_hf`, through the same layout. Replicated ranges (norms) are written by every
    shard; they are equal."""
    import torch

    shapes = hf_shapes(spec)
    out: dict = {}
    for tp_rank, shard in enumerate(shards):
        layout = megatron_layout(spec, tp=len(shards), tp_rank=tp_rank, pp=pp, pp_rank=pp_rank, ep=ep, ep_rank=ep_rank)
        for local in layout:
            source = shard[local.name]
            for seg in local.segments:
                if seg.hf_name not in out:
                    out[seg.hf_name] = torch.empty(shapes[seg.hf_name], dtype=source.dtype)
                out[seg.hf_name].narrow(local.dim, seg.hf_start, seg.length).copy_(
                    source.narrow(local.dim, seg.local_start, seg.length))
    return out
