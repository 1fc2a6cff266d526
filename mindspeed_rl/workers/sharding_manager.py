"""The sharding manager: the one place device states move, by the residency table (memory/residency.py).

`enter(phase)` makes the resident state groups equal that phase's row: it offloads what the row leaves out
first, then reloads what it needs (the KV cache last), so two phases' states never peak together. A rank
that holds both ends of the weight push (colocated) goes into `generate` through the `switch` row, where
the push (resharding/weight_push.py) writes the training weights into vLLM's live parameters. `leave(phase)`
keeps what the table says outlives the phase's call (`ResidencyPolicy.after`).

ROLL's manual control is built on the same move: `offload_states` / `reload_states` settle the device on
the resident set less / plus the named states, and `PhaseStates` is ROLL's strategy object for one phase
(`state_offload_manager(PhaseStates(manager, phase), ...)` enters the phase, runs the body, leaves it).
The manager knows no engine: it moves registered states and calls the push.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Iterable

from mindspeed_rl.memory.offload import Offloader
from mindspeed_rl.memory.residency import (DROPPED_ON_PHASE_CHANGE, GENERATE, OLD_LOGPROB, RELOADED_LAST, STATE_GROUPS,
                                           SWITCH, UPDATE, ResidencyPolicy)
from mindspeed_rl.resharding.weight_push import WeightPush

# MindSpeed-RL's names for the timed parts of the switch (trainer/metrics.py sums them into
# timing/resharding_to_infer and timing/resharding_to_train).
_ENTER_TIMINGS = {GENERATE: "timing/resharding_enter_infer", OLD_LOGPROB: "timing/onload_forward",
                  UPDATE: "timing/onload_train"}
_LEAVE_TIMINGS = {GENERATE: "timing/resharding_exit_infer"}


@dataclass
class Moved:
    """Bytes copied by one settle: host -> device (reloaded) and device -> host (offloaded)."""

    reloaded: int = 0
    offloaded: int = 0

    def __add__(self, other: "Moved") -> "Moved":
        return Moved(self.reloaded + other.reloaded, self.offloaded + other.offloaded)


class ShardingManager:
    def __init__(self, *, offloader: Offloader, policy: ResidencyPolicy, weight_push: WeightPush | None = None):
        self.offloader = offloader
        self.policy = policy
        self.weight_push = weight_push  # set where this rank holds both ends of the push
        # Disaggregated: this rank's end of the push over the bridge, which the sync_weights call (the switch row)
        # runs; the manager reads only what it needs beyond that row.
        self.bridge_push: WeightPush | None = None
        self.metrics: dict[str, float] = {}  # timings and push figures since the last pop_metrics

    # -- phases ------------------------------------------------------------------------------------
    def enter(self, phase: str) -> Moved:
        """Resident state groups := the phase's row (through the switch and its push into generate)."""
        started = time.perf_counter()
        moved = Moved()
        if phase == GENERATE and self.weight_push is not None:
            moved += self._settle(self.policy.resident(SWITCH) | self.weight_push.states_needed(), phase_change=True)
            self._add(self.weight_push.push())
        needed = self.policy.resident(phase)
        if phase == SWITCH and self.bridge_push is not None:
            needed |= self.bridge_push.states_needed()
        moved += self._settle(needed, phase_change=True)
        if phase in _ENTER_TIMINGS:
            self._add({_ENTER_TIMINGS[phase]: time.perf_counter() - started})
        return moved

    def leave(self, phase: str) -> Moved:
        """After `phase`'s call: keep what the iteration's next phase needs too, and the pinned states."""
        started = time.perf_counter()
        moved = self._settle(self.policy.after(phase), phase_change=True)
        if phase in _LEAVE_TIMINGS:
            self._add({_LEAVE_TIMINGS[phase]: time.perf_counter() - started})
        return moved

    def pop_metrics(self) -> dict[str, float]:
        metrics, self.metrics = self.metrics, {}
        return metrics

    # -- ROLL's manual control ---------------------------------------------------------------------
    def offload_states(self, include: Iterable[str] | None = None, *, keep_contents: bool | None = None) -> int:
        """Move states (default: all) off the device; their contents are kept as registered (grads and the KV
        cache are dropped unless `keep_contents=True`). Returns the bytes copied."""
        names = set(self._registered() if include is None else include)
        return self._settle(self._resident() - names, keep_contents=keep_contents).offloaded

    def reload_states(self, include: Iterable[str] | None = None) -> int:
        """Bring states (default: all) back to the device. Returns the bytes copied."""
        names = set(self._registered() if include is None else include)
        return self._settle(self._resident() | names).reloaded

    # -- the one mover -----------------------------------------------------------------------------
    def _settle(self, target: Iterable[str], *, phase_change: bool = False, keep_contents: bool | None = None) -> Moved:
        """Offload every registered state outside `target`, then reload those in it (the KV cache last).
        A phase change drops what the next push overwrites instead of copying it."""
        target = set(target)
        leaving = [name for name in self._registered() if name not in target and self.offloader.is_resident(name)]
        moved = Moved()
        for name in leaving:
            keep = False if phase_change and name in DROPPED_ON_PHASE_CHANGE else keep_contents
            moved.offloaded += self.offloader.offload(name, keep_contents=keep)
        if leaving:
            self.offloader.accelerator.empty_cache()  # what left is free for what comes
        for name in sorted(target & set(self._registered()), key=lambda n: n == RELOADED_LAST):
            moved.reloaded += self.offloader.reload(name)
        return moved

    def _registered(self) -> list[str]:
        return [name for name in STATE_GROUPS if name in self.offloader.states]

    def _resident(self) -> set[str]:
        return {name for name in self._registered() if self.offloader.is_resident(name)}

    def _add(self, metrics: dict[str, float]) -> None:
        for key, value in metrics.items():
            self.metrics[key] = self.metrics.get(key, 0.0) + value


class PhaseStates:
    """ROLL's strategy object for one phase: `reload_states` enters it, `offload_states` leaves it (what
    the table keeps for the next phase stays). `state_offload_manager` drives it around a call."""

    def __init__(self, manager: ShardingManager, phase: str):
        self.manager, self.phase = manager, phase

    def reload_states(self) -> int:
        return self.manager.enter(self.phase).reloaded

    def offload_states(self) -> int:
        return self.manager.leave(self.phase).offloaded


class StateSet:
    """ROLL's strategy object over named states of one rank (`state_offload_manager(StateSet(manager,
    names), ...)`): reloads them before the body and offloads them after, through the manager."""

    def __init__(self, manager: ShardingManager, names: Iterable[str]):
        self.manager, self.names = manager, tuple(names)

    def reload_states(self) -> int:
        return self.manager.reload_states(self.names)

    def offload_states(self) -> int:
        return self.manager.offload_states(self.names)
