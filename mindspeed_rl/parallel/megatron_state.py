"""The one module that sets Megatron's global parallel state (`megatron.core.parallel_state`) from the run's training
layout and reads it back: everything else gets this rank's coordinates and process groups as a `RankGroups` from here
(the CPU patches of accelerator/megatron_cpu.py aside, which patch Megatron's own functions).

Megatron's own modules keep reading its globals; ours do not.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from mindspeed_rl.parallel.layout import TrainLayout


@dataclass(frozen=True)
class RankGroups:
    """This rank in the training layout: the sizes, its coordinates and the process groups over them (Megatron's)."""

    tp: int
    pp: int
    ep: int
    cp: int
    dp: int  # data-parallel ranks, CP excluded (Megatron's data-parallel group)
    tp_rank: int
    pp_rank: int
    ep_rank: int
    cp_rank: int
    dp_rank: int
    tp_group: Any
    pp_group: Any
    cp_group: Any
    dp_group: Any
    pp_last_rank: int  # the global rank of this rank's last pipeline stage

    @property
    def first_stage(self) -> bool:
        return self.pp_rank == 0

    @property
    def last_stage(self) -> bool:
        return self.pp_rank == self.pp - 1

    @property
    def layout(self) -> TrainLayout:
        return TrainLayout(tp=self.tp, pp=self.pp, ep=self.ep, cp=self.cp)


def initialize(layout: TrainLayout, *, rank: int, world_size: int, timeout_minutes: int) -> RankGroups:
    """Megatron's groups of `layout` over this world; checks Megatron placed this rank where the layout says."""
    from megatron.core import parallel_state as ps

    ps.initialize_model_parallel(
        distributed_timeout_minutes=timeout_minutes, tensor_model_parallel_size=layout.tp,
        pipeline_model_parallel_size=layout.pp, expert_model_parallel_size=layout.ep,
        context_parallel_size=layout.cp)
    groups = current()
    expected = layout.of(rank, world_size)
    got = (groups.tp_rank, groups.cp_rank, groups.dp_rank, groups.pp_rank, groups.ep_rank)
    assert got == (expected.tp_rank, expected.cp_rank, expected.dp_rank, expected.pp_rank, expected.ep_rank), \
        f"rank {rank}: Megatron placed it at {got}, the layout at {expected}"
    return groups


def current() -> RankGroups:
    """This rank's place in Megatron's parallel state as it is now (made by `initialize`, or a test's own call)."""
    from megatron.core import parallel_state as ps

    return RankGroups(
        tp=ps.get_tensor_model_parallel_world_size(), pp=ps.get_pipeline_model_parallel_world_size(),
        ep=ps.get_expert_model_parallel_world_size(), cp=ps.get_context_parallel_world_size(),
        dp=ps.get_data_parallel_world_size(), tp_rank=ps.get_tensor_model_parallel_rank(),
        pp_rank=ps.get_pipeline_model_parallel_rank(), ep_rank=ps.get_expert_model_parallel_rank(),
        cp_rank=ps.get_context_parallel_rank(), dp_rank=ps.get_data_parallel_rank(),
        tp_group=ps.get_tensor_model_parallel_group(), pp_group=ps.get_pipeline_model_parallel_group(),
        cp_group=ps.get_context_parallel_group(), dp_group=ps.get_data_parallel_group(),
        pp_last_rank=ps.get_pipeline_model_parallel_last_rank())


def destroy() -> None:
    from megatron.core import parallel_state as ps

    ps.destroy_model_parallel()
