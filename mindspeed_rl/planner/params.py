"""Per-rank tensors of the training and the inference layouts, and what Megatron's DDP and optimizer make
of them: numbers only, no tensor is allocated.

Every shard comes from the engine's own layouts (`models/layouts.py`: `megatron_layout`, `vllm_layout`,
the functions the switch is planned with; DeepSeek-V3's in `models/deepseek_v3_layouts.py`: Megatron's
local spec splits MLA's down projections over TP as well, vLLM keeps them whole), so the planner and the
engine agree by construction. The routers' `expert_bias` (DeepSeek-V3) is a buffer in Megatron, not a
parameter: no DDP buffer or optimizer state; vLLM's `e_score_correction_bias` is a parameter.

What Megatron builds (megatron-core 0.16, `distributed/param_and_grad_buffer.py`, the engine's
`DistributedDataParallelConfig(grad_reduce_in_fp32=True)`, no overlapped grad reduce, so one bucket
per buffer), checked against the tensors a live engine holds (tests/test_planner.py):
- every parameter in the training dtype (the engine casts the local spec's fp32 torch norms, as Megatron-LM's
  Float16Module does: models/megatron_build.py);
- one grad buffer per kind (expert or not), always fp32;
- with the distributed optimizer, params also live in a param buffer of the same layout, each param's
  start padded to 64 elements and the buffer's end to lcm(DP, 128) elements (expert buffers: the
  expert-DP size); each DP rank's optimizer owns one contiguous 1/DP of every buffer;
- Adam: exp_avg + exp_avg_sq in fp32 for every element a rank optimizes, plus an fp32 master copy of
  each bf16 element (an fp32 model is its own master).
"""
from __future__ import annotations

import bisect
import math
from dataclasses import dataclass
from functools import lru_cache

from mindspeed_rl.planner.arch import Architecture

# Layout tensors that are buffers in Megatron (moved by the push and the export, not trained).
BUFFER_SUFFIXES = (".router.expert_bias",)


@dataclass(frozen=True)
class Param:
    name: str
    numel: int
    expert: bool = False  # in Megatron's expert-parallel grad buffers


# -- training shards ------------------------------------------------------------------------------------
def megatron_params(arch: Architecture, *, tp: int, tp_rank: int, pp: int, pp_rank: int, ep: int = 1,
                    ep_rank: int = 0) -> tuple[Param, ...]:
    """The parameters of one Megatron (tp_rank, pp_rank, ep_rank) shard, in `named_parameters()` order.

    TP and EP split evenly, so every TP and EP rank of a stage has the same shapes (only the ranges of the
    full tensors differ): the shapes are those of TP rank 0, EP rank 0 of the stage."""
    return _stage_params(arch, tp, pp, pp_rank, ep)


@lru_cache(maxsize=4096)
def _stage_params(arch: Architecture, tp: int, pp: int, pp_rank: int, ep: int) -> tuple[Param, ...]:
    from mindspeed_rl.models.layouts import megatron_layout

    layout = megatron_layout(arch.to_spec(), tp=tp, tp_rank=0, pp=pp, pp_rank=pp_rank, ep=ep, ep_rank=0)
    params = [Param(t.name, math.prod(t.shape), ".experts." in t.name) for t in layout
              if not t.name.endswith(BUFFER_SUFFIXES)]
    return tuple(sorted(params, key=_registration_order))


# Megatron registers a layer's modules in this order (TransformerLayer: input_layernorm, self_attention
# (linear_proj before linear_qkv / MLA's projections, then the q/k norms), pre_mlp_layernorm, mlp); DDP's
# buffers follow it, which decides where the distributed optimizer's padding falls.
_LAYER_ORDER = ("input_layernorm", "self_attention.linear_proj", "self_attention.", "pre_mlp_layernorm",
                "mlp.router", "mlp.")


def _registration_order(param: Param) -> tuple:
    name = param.name
    if name.startswith("embedding."):
        return (0,)
    if name.startswith("decoder.layers."):
        layer, rest = name[len("decoder.layers."):].split(".", 1)
        section = next(i for i, prefix in enumerate(_LAYER_ORDER) if rest.startswith(prefix))
        return (1, int(layer), section)
    return (2, 0 if name.startswith("decoder.final_layernorm") else 1)


def stage_layers(arch: Architecture, pp_rank: int, pp: int) -> range:
    from mindspeed_rl.models.pipeline_stages import stage_layer_range

    return stage_layer_range(arch.num_layers, pp_rank, pp, arch.pipeline_stage_layers if pp > 1 else None)


# -- Megatron's buffers and optimizer -----------------------------------------------------------------
@dataclass(frozen=True)
class Buffer:
    """One DDP param/grad buffer: its params' [start, end) element ranges and its padded size."""

    expert: bool
    fp32: bool  # the params' dtype is fp32 (an fp32 model)
    ranges: tuple[tuple[int, int], ...]
    numel: int  # padded
    shard_group: int  # the DP size its optimizer shards over (expert buffers: expert DP)

    def shard_numel(self, rank: int) -> int:
        """Elements of real params in DP rank `rank`'s contiguous 1/shard_group of the buffer."""
        size = self.numel // self.shard_group
        lo, hi = rank * size, (rank + 1) * size
        total = 0
        for start, end in self.ranges[max(0, bisect.bisect_right(self.ranges, (lo, lo)) - 1):]:  # sorted by start
            if start >= hi:
                break
            total += max(0, min(hi, end) - max(lo, start))
        return total


def ddp_buffers(params: tuple[Param, ...], *, bf16: bool, distributed_optimizer: bool, dp_cp: int,
                expert_dp: int) -> list[Buffer]:
    """Megatron DDP's buffers for one rank's params (reverse order, as DDP fills them), the distributed optimizer's
    sharded over `dp_cp` ranks (DP x CP) and the experts' over `expert_dp` (Megatron's expert data-parallel group)."""
    groups: dict[tuple[bool, bool], list[Param]] = {}
    for param in params:
        groups.setdefault((param.expert, not bf16), []).append(param)
    buffers = []
    for (expert, fp32), members in groups.items():
        group = expert_dp if expert else dp_cp
        position, ranges = 0, []
        for param in reversed(members):
            if distributed_optimizer:
                position = -(-position // 64) * 64
            ranges.append((position, position + param.numel))
            position += param.numel
        if distributed_optimizer:
            divisor = math.lcm(group, 128)
            position = -(-position // divisor) * divisor
        buffers.append(Buffer(expert, fp32, tuple(ranges), position, group if distributed_optimizer else 1))
    return buffers


@dataclass(frozen=True)
class TrainStateBytes:
    params: int
    grads: int
    optimizer: int
    reference: int  # the reference model: the same shard, no DDP buffer
    adapter_params: int = 0  # LoRA's adapters, a state group of their own (then `params` is the frozen backbone)
    largest_optimizer: int = 0  # the optimizer bytes of the rank's largest param (a swap bucket's overshoot)


def train_state_bytes(params: tuple[Param, ...], *, bf16: bool, distributed_optimizer: bool, dp_cp: int,
                      expert_dp: int, dp_cp_rank: int, expert_dp_rank: int,
                      buffers: list[Buffer] | None = None) -> TrainStateBytes:
    """One rank's params, grads and Adam states: `dp_cp` the ranks holding the same weights (DP x CP: the grads
    reduce and the distributed optimizer shards over them) and `dp_cp_rank` this rank's index among them."""
    element_bytes = 2 if bf16 else 4
    unpadded = sum(p.numel for p in params) * element_bytes
    if buffers is None:
        buffers = ddp_buffers(params, bf16=bf16, distributed_optimizer=distributed_optimizer, dp_cp=dp_cp,
                              expert_dp=expert_dp)
    grads = sum(b.numel for b in buffers) * 4  # grad_reduce_in_fp32
    if distributed_optimizer:
        train = sum(b.numel for b in buffers) * element_bytes
        optimizer = 0
        for b in buffers:
            elements = b.shard_numel(expert_dp_rank if b.expert else dp_cp_rank)
            optimizer += elements * (8 if b.fp32 else 12)
    else:
        train = unpadded
        optimizer = sum(p.numel for p in params) * (12 if bf16 else 8)
    largest = max((p.numel for p in params), default=0)
    largest = -(-largest // dp_cp) if distributed_optimizer else largest  # its shard, about
    return TrainStateBytes(params=train, grads=grads, optimizer=optimizer, reference=unpadded,
                           largest_optimizer=largest * (12 if bf16 else 8))


@lru_cache(maxsize=4096)
def stage_train_bytes(arch: Architecture, *, tp: int, pp: int, pp_rank: int, ep: int, dp_cp: int, bf16: bool,
                      distributed_optimizer: bool, dp_cp_rank: int) -> TrainStateBytes:
    """`train_state_bytes` of a rank of pipeline stage `pp_rank` and index `dp_cp_rank` among the `dp_cp` ranks
    holding its weights (EP ranks are carved out of DP x CP: expert-DP rank = dp_cp_rank // ep)."""
    params = _stage_params(arch, tp, pp, pp_rank, ep)
    buffers = _stage_buffers(arch, tp, pp, pp_rank, ep, dp_cp, bf16, distributed_optimizer)
    return train_state_bytes(params, bf16=bf16, distributed_optimizer=distributed_optimizer, dp_cp=dp_cp,
                             expert_dp=dp_cp // ep, dp_cp_rank=dp_cp_rank, expert_dp_rank=dp_cp_rank // ep,
                             buffers=buffers)


@lru_cache(maxsize=1024)
def _stage_buffers(arch: Architecture, tp: int, pp: int, pp_rank: int, ep: int, dp_cp: int, bf16: bool,
                   distributed_optimizer: bool) -> list[Buffer]:
    return ddp_buffers(_stage_params(arch, tp, pp, pp_rank, ep), bf16=bf16,
                       distributed_optimizer=distributed_optimizer, dp_cp=dp_cp, expert_dp=dp_cp // ep)


def reward_model_bytes(arch: Architecture, *, tp: int, pp: int, pp_rank: int, bf16: bool) -> int:
    """One rank's reward-model params (engines/reward_model.py): the trunk's shard of stage `pp_rank` in the
    actor's layout, without a language-model head, and on the last stage the replicated hidden -> 1 score
    row."""
    e = 2 if bf16 else 4
    trunk = sum(p.numel for p in _stage_params(arch, tp, pp, pp_rank, 1) if p.name != "output_layer.weight") * e
    return trunk + (arch.hidden_size * e if pp_rank == pp - 1 else 0)


def teacher_bytes(arch: Architecture, *, tp: int, pp: int, pp_rank: int, ep: int, bf16: bool) -> int:
    """One rank's teacher params (workers/parts/teacher.py): a forward-only model in the actor's layout, its stage
    `pp_rank`'s shard with the language-model head, as the reference's (no DDP buffer)."""
    return sum(p.numel for p in _stage_params(arch, tp, pp, pp_rank, ep)) * (2 if bf16 else 4)


@lru_cache(maxsize=1024)
def stage_critic_bytes(arch: Architecture, *, tp: int, pp: int, pp_rank: int, dp_cp: int, bf16: bool,
                       distributed_optimizer: bool, dp_cp_rank: int) -> TrainStateBytes:
    """The critic's (engines/critic.py) params, DDP grads and Adam states on a rank of stage `pp_rank`: the trunk's
    shard as the actor's without the language-model head, and on the last stage the replicated hidden -> 1 value
    head, trained like the actor."""
    params = [p for p in _stage_params(arch, tp, pp, pp_rank, 1) if p.name != "output_layer.weight"]
    if pp_rank == pp - 1:
        params.append(Param("output_layer.weight", arch.hidden_size))
    return train_state_bytes(tuple(params), bf16=bf16, distributed_optimizer=distributed_optimizer, dp_cp=dp_cp,
                             expert_dp=dp_cp, dp_cp_rank=dp_cp_rank, expert_dp_rank=dp_cp_rank)


# -- inference shards -----------------------------------------------------------------------------------


def vllm_stage_layers(arch: Architecture, pp_rank: int, pp: int) -> range:
    """Global layers of vLLM pipeline stage `pp_rank`: vLLM's own partition (uneven where PP does not divide)."""
    from mindspeed_rl.models.layouts import vllm_pp_layers

    return vllm_pp_layers(arch.num_layers, pp_rank, pp)


def vllm_numel(arch: Architecture, *, tp: int, tp_rank: int, dp: int, dp_rank: int, expert_parallel: bool,
               pp: int = 1, pp_rank: int = 0) -> int:
    """Elements of one vLLM rank's parameters (`named_parameters()`, the vocabulary padded to a multiple of 64):
    its pipeline stage's (`vllm_layout` with `pp`, `pp_rank`). Every TP/DP rank of a stage has the same shapes
    (even splits; KV heads replicated by whole heads; padding rows count)."""
    shapes = _vllm_shapes(arch, tp, dp, expert_parallel, pp, pp_rank, vllm_stage_layers(arch, pp_rank, pp))
    return sum(math.prod(shape) for shape in shapes.values())


def vllm_packed_linear_numel(arch: Architecture, *, tp: int, dp: int, expert_parallel: bool, pp: int = 1,
                             pp_rank: int = 0) -> int:
    """Elements of the oneDNN-packed copies a vLLM rank on CPU keeps (engines/vllm_cpu_linears.PackedLinears): every
    2-D weight but the input embedding's, which is looked up (unless the head is tied to it); the experts' stacked
    weights are 3-D and run through their own kernel."""
    shapes = _vllm_shapes(arch, tp, dp, expert_parallel, pp, pp_rank, vllm_stage_layers(arch, pp_rank, pp))
    head_is_embedding = arch.tie_word_embeddings and "lm_head.weight" not in shapes
    return sum(math.prod(shape) for name, shape in shapes.items()
               if len(shape) == 2 and (head_is_embedding or not name.endswith("embed_tokens.weight")))


@lru_cache(maxsize=1024)
def _vllm_shapes(arch: Architecture, tp: int, dp: int, expert_parallel: bool, pp: int, pp_rank: int,
                 layers: range) -> dict[str, tuple[int, ...]]:
    # The stage's layers are part of the cache key: VLLM_PP_LAYER_PARTITION may change between calls.
    tp_rank = dp_rank = 0
    spec = arch.to_spec()
    from mindspeed_rl.models.layouts import parameter_shapes, vllm_layout

    shapes = parameter_shapes(vllm_layout(spec, tp=tp, tp_rank=tp_rank, dp=dp, dp_rank=dp_rank,
                                          expert_parallel=expert_parallel, pp=pp, pp_rank=pp_rank))
    if spec.is_moe and spec.deepseek is None and pp > 1:
        # vLLM 0.32's Qwen3-MoE allocates the embedding, final norm and head on every stage (it reads them on the
        # first / last only, so the layout leaves them out elsewhere); they take memory all the same.
        whole = parameter_shapes(vllm_layout(spec, tp=tp, tp_rank=tp_rank, dp=dp, dp_rank=dp_rank,
                                             expert_parallel=expert_parallel))
        shapes.update({name: shape for name, shape in whole.items() if not name.startswith("model.layers.")})
    return shapes
