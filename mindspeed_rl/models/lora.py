"""LoRA on Megatron's tensor-parallel linears (actor_config.lora_*): y = W x + (alpha / r) B A x, W frozen.

The targets are Megatron's names, as MindSpeed-RL's: `linear_qkv` and `linear_fc1` (column-parallel: W split by
output rows over TP), `linear_proj` and `linear_fc2` (row-parallel: W split by input columns). A and B split the
way W does, so every rank's delta is local:

* column-parallel: A [r, in] whole on every TP rank, B [out/t, r] by the rows W has. The input is the whole sequence
  (gathered from its sequence-parallel slices, whose backward then only splits); `copy_to_tensor_model_parallel_region`
  between A and B all-reduces A's output gradient, so A's gradient and the input's are complete on every rank;
* row-parallel: A [r, in/t] by the columns W has, B [out, r] whole. A's partial outputs are summed over TP
  (`reduce_from_tensor_model_parallel_region`), B's output then split over the sequence like W's (sequence parallel).

The delta of one rank's W shard is `scale * B_shard @ A` (column) or `scale * B @ A_shard` (row): merging needs no
communication. A is drawn as PEFT draws it (kaiming-uniform, a = sqrt(5)) from a generator seeded by
(seed, global layer, module), so every layout starts from the same adapter; B starts at 0, so the first forward is
the base model's. Checkpoints shard A and B as W is sharded (`sharded_state_dict`; B of a gated `linear_fc1` split
into its gate and up halves like W), so an adapter saved at one TP loads at another.
"""
from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
from megatron.core.tensor_parallel.layers import set_tensor_model_parallel_attributes
from megatron.core.tensor_parallel.mappings import (copy_to_tensor_model_parallel_region,
                                                     gather_from_sequence_parallel_region,
                                                     reduce_from_tensor_model_parallel_region,
                                                     scatter_to_sequence_parallel_region)

if TYPE_CHECKING:
    from mindspeed_rl.parallel.megatron_state import RankGroups

COLUMN_TARGETS = ("linear_qkv", "linear_fc1")
ROW_TARGETS = ("linear_proj", "linear_fc2")
LORA_TARGETS = COLUMN_TARGETS + ROW_TARGETS
LORA_PARAM_NAMES = ("lora_A", "lora_B")


@dataclass(frozen=True, kw_only=True)
class LoRASettings:
    rank: int
    alpha: float
    target_modules: tuple[str, ...]
    seed: int = 0

    @property
    def scale(self) -> float:
        return self.alpha / self.rank


def is_lora_param(name: str) -> bool:
    return name.rsplit(".", 1)[-1] in LORA_PARAM_NAMES


class LoRAColumnParallelLinear(ColumnParallelLinear):
    """A column-parallel linear with an adapter (made by `add_lora`, never constructed)."""

    lora_enabled = True

    def forward(self, input_: torch.Tensor, weight: torch.Tensor | None = None,
                runtime_gather_output: bool | None = None):
        output, bias = super().forward(input_, weight, runtime_gather_output)
        if not self.lora_enabled:
            return output, bias
        x = input_
        if self.sequence_parallel:
            x = gather_from_sequence_parallel_region(x, tensor_parallel_output_grad=False, group=self.tp_group)
        h = copy_to_tensor_model_parallel_region(F.linear(x, self.lora_A), group=self.tp_group)
        return output + F.linear(h, self.lora_B) * self.lora_scale, bias

    def lora_delta(self) -> torch.Tensor:
        return self.lora_scale * (self.lora_B.float() @ self.lora_A.float())

    def sharded_state_dict(self, prefix="", sharded_offsets=(), metadata=None):
        from megatron.core.transformer.mlp import apply_swiglu_sharded_factory

        sharded = _sharded(self, prefix, {"weight": 0, "bias": 0, "lora_B": 0}, sharded_offsets, metadata)
        if self.lora_gated:  # B's rows are [gate; up] of this rank, as W's
            singleton = (metadata or {}).get("singleton_local_shards", False)
            sharded[f"{prefix}lora_B"] = apply_swiglu_sharded_factory(sharded[f"{prefix}lora_B"], sharded_offsets,
                                                                      singleton)
        return sharded


class LoRARowParallelLinear(RowParallelLinear):
    """A row-parallel linear with an adapter (made by `add_lora`, never constructed)."""

    lora_enabled = True

    def forward(self, input_: torch.Tensor):
        output, bias = super().forward(input_)
        if not self.lora_enabled:
            return output, bias
        h = reduce_from_tensor_model_parallel_region(F.linear(input_, self.lora_A), group=self.tp_group)
        delta = F.linear(h, self.lora_B) * self.lora_scale
        if self.sequence_parallel:
            delta = scatter_to_sequence_parallel_region(delta, group=self.tp_group)
        return output + delta, bias

    def lora_delta(self) -> torch.Tensor:
        return self.lora_scale * (self.lora_B.float() @ self.lora_A.float())

    def sharded_state_dict(self, prefix="", sharded_offsets=(), metadata=None):
        return _sharded(self, prefix, {"weight": 1, "lora_A": 1}, sharded_offsets, metadata)


_LORA_CLASSES = {ColumnParallelLinear: LoRAColumnParallelLinear, RowParallelLinear: LoRARowParallelLinear}


def _sharded(module, prefix, axis_map, sharded_offsets, metadata):
    from megatron.core.transformer.utils import make_sharded_tensors_for_checkpoint

    return make_sharded_tensors_for_checkpoint(module.state_dict(prefix="", keep_vars=True), prefix, axis_map,
                                               sharded_offsets, tp_group=module.tp_group,
                                               dp_cp_group=(metadata or {}).get("dp_cp_group"))


def lora_settings_of(actor_config, *, seed: int) -> LoRASettings | None:
    """actor_config's LoRA (its lora_* keys), or None without one."""
    if not actor_config.uses_lora:
        return None
    return LoRASettings(rank=actor_config.lora_r, alpha=actor_config.lora_alpha,
                        target_modules=tuple(actor_config.lora_target_modules), seed=seed)


def with_adapters(model: torch.nn.Module, settings: LoRASettings | None, *, parallel: RankGroups) -> None:
    """`add_lora` where the run has LoRA (`settings`); a model without it keeps every weight trainable."""
    if settings is not None:
        add_lora(model, settings, parallel=parallel)


def saved_state(state: dict, *, adapters_only: bool) -> dict:
    """A model's sharded state as a checkpoint holds it: whole, or with MindSpeed-RL's lora_ckpt_filter the adapters
    only (the backbone is the HF checkpoint's)."""
    return {key: value for key, value in state.items() if is_lora_param(key)} if adapters_only else state


def add_lora(model: torch.nn.Module, settings: LoRASettings, *, parallel: RankGroups) -> None:
    """Adapters on every target linear of this rank's stage of a GPTModel, cut to this rank's TP shard (`parallel`,
    the caller's); every other parameter frozen (no gradient, so DDP gives it no grad buffer and the optimizer no
    state)."""
    for layer in model.decoder.layers:
        for name, module in layer.named_modules():
            leaf = name.rsplit(".", 1)[-1]
            if leaf in settings.target_modules:
                _attach(module, leaf, layer.layer_number, settings, tp=parallel.tp, tp_rank=parallel.tp_rank)
    for name, param in model.named_parameters():
        param.requires_grad_(is_lora_param(name))


def _attach(module: torch.nn.Module, leaf: str, layer_number: int, settings: LoRASettings, *, tp: int,
            tp_rank: int) -> None:
    kind = type(module)
    if kind not in _LORA_CLASSES or (leaf in COLUMN_TARGETS) != (kind is ColumnParallelLinear):
        raise TypeError(f"{leaf} of layer {layer_number} is a {kind.__name__}: LoRA here wraps Megatron's local "
                        "ColumnParallelLinear (linear_qkv, linear_fc1) and RowParallelLinear (linear_proj, linear_fc2)")
    weight = module.weight
    column = kind is ColumnParallelLinear
    assert not (column and module.gather_output), "an adapter on a gathered output is not needed by GPT's layers"
    in_features = weight.shape[1] if column else weight.shape[1] * tp
    generator = torch.Generator().manual_seed(_adapter_seed(settings.seed, layer_number, leaf))
    a_full = torch.empty(settings.rank, in_features)
    torch.nn.init.kaiming_uniform_(a_full, a=math.sqrt(5), generator=generator)  # PEFT's lora_A init
    if not column:
        a_full = a_full.narrow(1, tp_rank * weight.shape[1], weight.shape[1])
    out_rows = weight.shape[0]
    module.lora_A = torch.nn.Parameter(a_full.to(device=weight.device, dtype=weight.dtype).contiguous())
    module.lora_B = torch.nn.Parameter(torch.zeros(out_rows, settings.rank, device=weight.device, dtype=weight.dtype))
    # The split one is a TP shard: marked so, Megatron's grad norm (and so its clipping) counts it on every TP rank;
    # unmarked it counts as a replica, on TP rank 0 only, and the norm misses the other ranks' shares.
    sharded, dim = (module.lora_B, 0) if column else (module.lora_A, 1)
    set_tensor_model_parallel_attributes(sharded, is_parallel=True, dim=dim, stride=1)
    module.lora_scale = settings.scale
    module.lora_gated = column and leaf == "linear_fc1" and module.config.gated_linear_unit
    module.__class__ = _LORA_CLASSES[kind]


def _adapter_seed(seed: int, layer_number: int, leaf: str) -> int:
    return (seed * 1_000_003 + layer_number * 101 + LORA_TARGETS.index(leaf)) % (2**63)


def lora_modules(model: torch.nn.Module) -> Iterator[tuple[str, torch.nn.Module]]:
    for name, module in model.named_modules():
        if isinstance(module, (LoRAColumnParallelLinear, LoRARowParallelLinear)):
            yield name, module


@contextlib.contextmanager
def adapters_disabled(model: torch.nn.Module):
    """The backbone alone (MindSpeed-RL's `disable_adapter()`): the reference of a shared backbone."""
    modules = [module for _, module in lora_modules(model)]
    for module in modules:
        module.lora_enabled = False
    try:
        yield
    finally:
        for module in modules:
            module.lora_enabled = True


class MergedWeights(Mapping):
    """This rank's weights by `named_parameters()` name without the adapters' own, each adapted weight read as
    W + scale B A of its shard (computed when read, the last one kept): what the weight push and the HF export
    read, without holding a merged copy of the model."""

    def __init__(self, model: torch.nn.Module):
        self._params = {name: param for name, param in model.named_parameters() if not is_lora_param(name)}
        self._adapted = {f"{name}.weight": module for name, module in lora_modules(model)}
        self._last: tuple[str, torch.Tensor] | None = None

    def __getitem__(self, name: str) -> torch.Tensor:
        module = self._adapted.get(name)
        if module is None:
            return self._params[name].data
        if self._last is None or self._last[0] != name:
            with torch.no_grad():
                weight = module.weight.data
                self._last = (name, (weight.float() + module.lora_delta()).to(weight.dtype))
        return self._last[1]

    def __iter__(self):
        return iter(self._params)

    def __len__(self) -> int:
        return len(self._params)
