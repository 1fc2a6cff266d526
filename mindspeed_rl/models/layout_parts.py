"""The parts both layouts are built from (models/layouts.py, and DeepSeek-V3's in
models/deepseek_v3_layouts.py): a rank-local tensor as segments of full HF tensors, the ways to cut one
(whole, an even slice, a stack of ranges, one expert's slices) and vLLM's fused-expert MoE layer. Their own
module so the model-specific layouts import them without importing each other.
"""
from __future__ import annotations

import re
from dataclasses import dataclass

from mindspeed_rl.models.qwen2 import Qwen2Spec


@dataclass(frozen=True)
class Segment:
    """local[local_start : local_start + length] == hf[hf_start : hf_start + length] along `dim`."""

    hf_name: str
    hf_start: int
    length: int
    local_start: int


@dataclass(frozen=True)
class LocalTensor:
    name: str
    shape: tuple[int, ...]
    dim: int  # the dimension the segments run along; other dims are whole
    segments: tuple[Segment, ...]
    index: int | None = None  # set: this is param[index] of a stacked (3-D expert) parameter

    @property
    def key(self) -> str:
        return self.name if self.index is None else f"{self.name}[{self.index}]"

    def at(self, index: int) -> "LocalTensor":
        return LocalTensor(self.name, self.shape, self.dim, self.segments, index)


_KEY = re.compile(r"^(.*)\[(\d+)\]$")


def tensor_view(tensors: dict, key: str):
    """The tensor a LocalTensor key names: `tensors[name]`, or `tensors[name][index]` (a view)."""
    match = _KEY.match(key)
    if match is None:
        return tensors[key]
    return tensors[match.group(1)][int(match.group(2))]


def parameter_shapes(layout: list[LocalTensor]) -> dict[str, tuple[int, ...]]:
    """Shapes of the parameters a layout lives in (stacked ones get their leading expert dim)."""
    shapes: dict[str, tuple[int, ...]] = {}
    for t in layout:
        if t.index is None:
            shapes[t.name] = t.shape
        else:
            count = max(shapes.get(t.name, (0,))[0], t.index + 1)
            shapes[t.name] = (count, *t.shape)
    return shapes


def _whole(name: str, hf_name: str, shape: tuple[int, ...]) -> LocalTensor:
    return LocalTensor(name, shape, 0, (Segment(hf_name, 0, shape[0], 0),))


def _even(name: str, hf_name: str, full_shape: tuple[int, ...], dim: int, rank: int, size: int) -> LocalTensor:
    part = full_shape[dim] // size
    shape = tuple(part if d == dim else n for d, n in enumerate(full_shape))
    return LocalTensor(name, shape, dim, (Segment(hf_name, rank * part, part, 0),))


def _stack(name: str, pieces: list[tuple[str, int, int]], other_dims: tuple[int, ...]) -> LocalTensor:
    """Concatenate (hf_name, hf_start, length) ranges along dim 0."""
    segments, offset = [], 0
    for hf_name, start, length in pieces:
        segments.append(Segment(hf_name, start, length, offset))
        offset += length
    return LocalTensor(name, (offset, *other_dims), 0, tuple(segments))


def _expert(spec: Qwen2Spec, src: str, expert: int, part: int, size: int) -> tuple[LocalTensor, LocalTensor]:
    """(gate_up rows [gate_part; up_part], down columns part) of one expert split `size` ways."""
    h, f = spec.hidden_size, spec.moe_ffn_hidden_size
    x = f"{src}mlp.experts.{expert}."
    n = f // size
    fc1 = _stack("", [(x + "gate_proj.weight", part * n, n), (x + "up_proj.weight", part * n, n)], (h,))
    fc2 = _even("", x + "down_proj.weight", (h, f), 1, part, size)
    return fc1, fc2


def _named(t: LocalTensor, name: str, index: int | None = None) -> LocalTensor:
    return LocalTensor(name, t.shape, t.dim, t.segments, index)


def _vllm_moe(spec: Qwen2Spec, p: str, size: int, rank: int, expert_parallel: bool) -> list[LocalTensor]:
    """Router + fused experts of one layer on vLLM MoE rank `rank` of `size` (= TP x DP).

    With expert parallelism each rank holds whole experts, contiguous blocks
    (`determine_expert_map`, "linear" placement); without, every rank holds every expert's
    `rank`-th slice of the intermediate dimension."""
    fused = p + "mlp.experts.routed_experts."
    out = [_whole(p + "mlp.gate.weight", p + "mlp.gate.weight", (spec.num_experts, spec.hidden_size))]
    per_rank = spec.num_experts // size if expert_parallel else spec.num_experts
    for local in range(per_rank):
        expert, part, parts = (rank * per_rank + local, 0, 1) if expert_parallel else (local, rank, size)
        fc1, fc2 = _expert(spec, p, expert, part, parts)
        out += [_named(fc1, fused + "w13_weight", local), _named(fc2, fused + "w2_weight", local)]
    return out
