"""The stop of a run-ahead rollout (rl_config.async_engine, trainer/partial_rollout.py): its generate stops at the first
decode step after which a global batch of prompt groups is complete and no group that must finish (one at the
declared age) is unfinished; the unfinished samples are aborted with their tokens (engines/vllm_stepped.py).

The samples of a group may sit on several inference-DP ranks, so the decision is collective: after each step every
inference rank adds up its unfinished samples per group, one all-reduce over vLLM's world sums them, and every rank
reads the same answer from the same sums (the ranks of a TP x PP block count their shared samples alike, which only
scales a count that is compared with zero).
"""
from __future__ import annotations

from dataclasses import dataclass, replace

import torch


@dataclass(frozen=True, kw_only=True)
class GroupStop:
    """Per prompt (one sample each), the pool group it belongs to; sliced with the prompts by the dispatch
    (workers/dispatch.py cuts it like a list), the rule itself whole on every rank."""

    sample_groups: tuple[int, ...]
    groups: int  # every group of the pool; a group with no sample in this generate is complete already
    target_groups: int  # complete groups enough to stop (a global batch)
    must_finish: tuple[int, ...] = ()  # groups at the declared age: the generate does not stop while one is unfinished

    def __len__(self) -> int:
        return len(self.sample_groups)

    def __getitem__(self, cut: slice) -> "GroupStop":
        return replace(self, sample_groups=self.sample_groups[cut])

    def should_stop(self, pending_per_group: torch.Tensor) -> bool:
        """From the unfinished samples of each group over every rank."""
        if not bool(pending_per_group.any()):
            return True
        complete = int((pending_per_group == 0).sum())
        return complete >= self.target_groups and not bool(pending_per_group[list(self.must_finish)].any())

    def until(self, group=None):
        """The engine's `until(unfinished prompt indices of this rank) -> stop?`, all-reduced over `group` (vLLM's
        world's CPU group; None: the default group, if initialised)."""
        import torch.distributed as dist

        def stop(unfinished: list[int]) -> bool:
            pending = torch.zeros(self.groups, dtype=torch.int64)
            for index in unfinished:
                pending[self.sample_groups[index]] += 1
            if dist.is_initialized() and dist.get_world_size(group) > 1:
                dist.all_reduce(pending, group=group)
            return self.should_stop(pending)

        return stop
