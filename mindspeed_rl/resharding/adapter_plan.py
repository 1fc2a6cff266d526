"""LoRA's switch plan: the slices of A and B each inference rank needs, from the training ranks that hold them.

vLLM's shard of an adapted weight is `base + (alpha/r) B A` over its own rows (column-parallel: `qkv_proj`,
`gate_up_proj`) or its own columns (row-parallel: `o_proj`, `down_proj`). So an inference rank needs, per adapted
weight, B's rows of its row segments and A whole (column), or A's columns of its column segments and B whole (row):
the weight's own layout, with A or B in place of W. The same holds of each Megatron shard, so both sides' adapter
layouts are derived from the weight layouts (`models/layouts.py`) and the one planner (`plan.plan_between`)
finds the copies: local where a rank already holds a slice, the least-loaded holder otherwise.

HF names of the adapter "tensors": B of a row piece `<module>.lora_B` [rows, r] (q/k/v_proj, gate/up_proj keep
their own rows of the fused B); A of a row piece is the fused linear's one A, `model.layers.<i>.<target>.lora_A`
[r, in] (the same for q, k and v); A of a column piece `<module>.lora_A` [r, in] by columns, its B
`<module>.lora_B` [out, r] whole.
"""
from __future__ import annotations

from mindspeed_rl.models.checkpoint import hf_layer_index
from mindspeed_rl.models.lora_peft import HF_MODULES
from mindspeed_rl.models.qwen2 import Qwen2Spec
from mindspeed_rl.models.layouts import LocalTensor, Segment, hf_shapes
from mindspeed_rl.resharding.plan import (InferLayout, Plan, TrainLayout, infer_layouts, plan_between, plan_ranks,
                                          train_layouts)

_TARGET_OF = {module: target for target, modules in HF_MODULES.items() for module in modules}


def build_adapter_plan(spec: Qwen2Spec, train: TrainLayout, infer: InferLayout, world_size: int, *, rank: int,
                       target_modules: tuple[str, ...], infer_world_size: int | None = None) -> Plan:
    """The plan of the adapters of rank `rank` on `target_modules`: between the same ranks (colocated), or, with
    `infer_world_size` (disaggregated), from the `world_size` training ranks to that many inference ranks numbered
    after them (as plan.build_plan numbers them)."""
    train_ranks, infer_ranks = plan_ranks(world_size, infer_world_size)
    train_side, shapes = adapter_layouts(train_layouts(spec, train, world_size), spec, rank=rank,
                                         target_modules=target_modules)
    infer_side, infer_shapes = adapter_layouts(infer_layouts(spec, infer, infer_ranks), spec, rank=rank,
                                               target_modules=target_modules)
    return plan_between(train_side, infer_side, shapes | infer_shapes, train_ranks=train_ranks,
                        infer_ranks=infer_ranks)


def adapter_layouts(layouts: dict[int, list[LocalTensor]], spec: Qwen2Spec, *, rank: int,
                    target_modules: tuple[str, ...]) -> tuple[dict[int, list[LocalTensor]], dict[str, tuple[int, ...]]]:
    """Each rank's adapter tensors laid out as its weights are, and the HF shapes of the adapter names."""
    weights, shapes = hf_shapes(spec), {}
    out = {r: [a for t in tensors for a in _adapter_tensors(t, rank, target_modules, weights, shapes)]
           for r, tensors in layouts.items()}
    return out, shapes


def adapted_weight(adapter_key: str) -> str:
    """`...qkv_proj.lora_B` -> `...qkv_proj.weight`: the vLLM parameter an adapter tensor updates."""
    return adapter_key.rsplit(".", 1)[0] + ".weight"


def _adapter_tensors(weight: LocalTensor, rank: int, targets: tuple[str, ...], weights: dict,
                     shapes: dict) -> list[LocalTensor]:
    """A's and B's tensors laid out as `weight` is (none where it has no adapter); fills `shapes` for their names."""
    if not weight.name.endswith(".weight") or weight.index is not None or not weight.segments:
        return []
    module = weight.segments[0].hf_name.removesuffix(".weight").rsplit(".", 1)[-1]
    target = _TARGET_OF.get(module)
    if target not in targets:
        return []
    base = weight.name.removesuffix(".weight")
    rows, columns = weight.shape
    if weight.dim == 0:  # row pieces: B by W's rows, the fused A whole
        b_segments = []
        for seg in weight.segments:
            name = seg.hf_name.replace(".weight", ".lora_B")
            shapes[name] = (weights[seg.hf_name][0], rank)
            b_segments.append(Segment(name, seg.hf_start, seg.length, seg.local_start))
        fused_a = f"model.layers.{hf_layer_index(weight.segments[0].hf_name)}.{target}.lora_A"
        shapes[fused_a] = (rank, columns)
        return [LocalTensor(f"{base}.lora_B", (rows, rank), 0, tuple(b_segments)),
                LocalTensor(f"{base}.lora_A", (rank, columns), 0, (Segment(fused_a, 0, rank, 0),))]
    a_segments = []  # column pieces: A by W's columns, B whole
    for seg in weight.segments:
        name = seg.hf_name.replace(".weight", ".lora_A")
        shapes[name] = (rank, weights[seg.hf_name][1])
        a_segments.append(Segment(name, seg.hf_start, seg.length, seg.local_start))
    b_name = weight.segments[0].hf_name.replace(".weight", ".lora_B")
    shapes[b_name] = (rows, rank)
    return [LocalTensor(f"{base}.lora_A", (rank, columns), 1, tuple(a_segments)),
            LocalTensor(f"{base}.lora_B", (rows, rank), 0, (Segment(b_name, 0, rows, 0),))]
