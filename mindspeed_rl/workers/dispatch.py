"""Dispatch by the group (verl's dispatch modes): an RPC that computes per sample declares how its inputs split
over the ranks, and the group, not the rank, splits them and gathers the results.

    @phase_rpc(OLD_LOGPROB, dispatch=Dispatch(TRAIN_DP, "batch"))
    def compute_log_prob(self, batch): ...   # gets its DP rank's share, returns (its values, metrics)

After `initialize` each rank says where it sits (`DataParallelPlace` per mode: its DP rank, the DP size, and whether
it is the one of its DP group whose results are collected); a call then sends each rank its share of the named
arguments (a RolloutBatch, or a list with one entry per prompt) and the group hands back, per rank, a `Shard` with
the range of samples the rank was given and its value where it is collected (None elsewhere), so the driver
assembles the results in sample order whatever the layout. A rank receives only what it computes on.

- TRAIN_DP: Megatron's data-parallel ranks (the ranks of one TP x CP x PP block share a slice); equal slices.
- INFER_DP: vLLM's data-parallel ranks (a TP x PP block shares a slice); balanced slices (a multi-turn rollout's
  continuations need not divide by the DP size).
"""
from __future__ import annotations

import inspect
from dataclasses import dataclass

from mindspeed_rl.protocol import RolloutBatch, Shard

TRAIN_DP, INFER_DP = "train_dp", "infer_dp"


@dataclass(frozen=True)
class Dispatch:
    """How an RPC's inputs split: `mode` and the names of the arguments that split (the others go to every rank)."""

    mode: str
    arguments: tuple[str, ...]

    def __init__(self, mode: str, *arguments: str):
        if mode not in (TRAIN_DP, INFER_DP):
            raise ValueError(f"dispatch mode must be {TRAIN_DP} or {INFER_DP}, got {mode!r}")
        object.__setattr__(self, "mode", mode)
        object.__setattr__(self, "arguments", arguments)


@dataclass(frozen=True)
class DataParallelPlace:
    """A rank's place in one mode's data-parallel split."""

    dp_rank: int
    dp_size: int
    collected: bool


def share(place: DataParallelPlace, num_samples: int, mode: str) -> tuple[int, int]:
    """[start, stop) of `num_samples` for `place`: equal slices over the training ranks (the config checks that
    they divide), balanced ones over the inference ranks."""
    rank, size = place.dp_rank, place.dp_size
    if mode == TRAIN_DP:
        per_rank = num_samples // size
        return rank * per_rank, (rank + 1) * per_rank
    return num_samples * rank // size, num_samples * (rank + 1) // size


def _cut(value, start: int, stop: int):
    if value is None:
        return None
    if isinstance(value, RolloutBatch):
        return value.select(slice(start, stop))
    return value[start:stop]


@dataclass
class Dispatched:
    """One dispatched call: each rank's arguments (ranks given the same range share the same objects) and the
    ranges they were given."""

    mode: str
    arguments: list[tuple[tuple, dict]]
    ranges: list[tuple[int, int]]


def split_call(method, dispatch: Dispatch, places: list[dict[str, DataParallelPlace]], args: tuple,
               kwargs: dict) -> Dispatched:
    """Each rank's arguments of a call of `method` (the declared RPC, for its signature)."""
    bound = inspect.signature(method).bind(None, *args, **kwargs)  # None: self
    splitting = [name for name in dispatch.arguments if bound.arguments.get(name) is not None]
    if not splitting:
        raise ValueError(f"{method.__name__}: none of the dispatched arguments {dispatch.arguments} was given")
    lengths = {len(bound.arguments[name]) for name in splitting}
    if len(lengths) != 1:
        raise ValueError(f"{method.__name__}: the dispatched arguments {splitting} differ in length {sorted(lengths)}")
    num_samples = lengths.pop()
    ranges = [share(rank_places[dispatch.mode], num_samples, dispatch.mode) for rank_places in places]
    arguments_of_range = {}
    for start, stop in dict.fromkeys(ranges):
        mine = dict(bound.arguments)
        mine.update({name: _cut(mine[name], start, stop) for name in splitting})
        rank_bound = inspect.BoundArguments(bound.signature, mine)
        arguments_of_range[start, stop] = (rank_bound.args[1:], rank_bound.kwargs)
    return Dispatched(mode=dispatch.mode, arguments=[arguments_of_range[r] for r in ranges], ranges=ranges)


def gather(results: list, dispatched: Dispatched, places: list[dict[str, DataParallelPlace]]) -> list:
    """Each rank's (value, metrics) -> (Shard of its range, metrics), the value kept where the rank is collected;
    an RPC that returns metrics only (an update) as they are."""
    gathered = []
    for result, (start, stop), rank_places in zip(results, dispatched.ranges, places):
        if isinstance(result, dict):
            gathered.append(result)
            continue
        value, metrics = result
        kept = value if rank_places[dispatched.mode].collected else None
        gathered.append((Shard(start=start, stop=stop, value=kept), metrics))
    return gathered
