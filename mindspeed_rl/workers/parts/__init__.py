"""A rank is composed of parts (workers/rank_worker.py): the training engine, the inference engine, the reference, the
reward model, the critic. Each part declares, on its own class:

- its RPCs: methods decorated with `@phase_rpc` (their residency row, their console name, whether they change the
  training weights) or `@part_rpc` (no row: bridge set-up and the like);
- `STATES`: the state groups it registers with the offloader (rows of memory/residency.py);
- `PUSH_END`: its end of the weight push ("source": it holds the training weights; "destination": vLLM's);
- `STAGE`: built before the sharding manager settles the device (Megatron engines) or after (vLLM, which sizes its
  KV cache by what is free);
- `CHECKPOINT`: the RPCs that save and load its trained state in a run's checkpoint, and where its LR schedule's
  state goes in trainer_state.json (None: nothing of it is saved);
- `build_part(rank, started)`: builds its engine(s) on the rank.

A role is a tuple of parts (workers/roles.py). Routing a call to a rank group, the calls after which the inference
weights are stale, the console's phase names and the architecture page's parts table all derive from these
declarations; nothing keeps a second list of RPC names.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, ClassVar

MEGATRON, VLLM = "megatron", "vllm"  # STAGE values
SOURCE, DESTINATION = "source", "destination"  # PUSH_END values


@dataclass(frozen=True)
class Checkpointed:
    """A part's share of a run's checkpoint: `save(dir, with_optimizer=, with_rng=)` returns its scheduler state,
    `load(dir, load_optimizer=, load_rng=, scheduler_state=)` restores it; `state_key` names that state in
    trainer_state.json."""

    save: str
    load: str
    state_key: str


class Part:
    NAME: ClassVar[str] = ""
    STATES: ClassVar[frozenset[str]] = frozenset()
    STAGE: ClassVar[str] = MEGATRON
    PUSH_END: ClassVar[str | None] = None
    CHECKPOINT: ClassVar[Checkpointed | None] = None

    def build_part(self, started: float) -> None:
        raise NotImplementedError


def part_rpc(method: Callable) -> Callable:
    """An RPC of a part that runs in no residency row (it moves no state and computes nothing on the device)."""
    method.rpc = True
    return method


def declared_rpcs(part: type) -> dict[str, Callable]:
    """The RPCs `part` declares on its own class, by name."""
    return {name: fn for name, fn in vars(part).items() if callable(fn) and (hasattr(fn, "phase") or hasattr(fn, "rpc"))}


def part_declaring(parts, method: str) -> type | None:
    """Which of `parts` declares RPC `method` (None: the rank base's own, e.g. offload_states)."""
    return next((part for part in parts if method in declared_rpcs(part)), None)
