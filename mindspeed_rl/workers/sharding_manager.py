"""The sharding manager: the one place device states move, by the residency table (memory/residency.py).

`enter(phase)` makes the resident state groups equal that phase's row: it offloads what the row leaves out
first, then reloads what it needs (the KV cache last), so two phases' states never peak together. `leave(phase)`
keeps what the table says outlives the phase's call (`ResidencyPolicy.after`).

The manager owns this rank's end of the weight push (resharding/weight_push.py), and one trigger runs it: the
`switch` row. A rank with both ends (colocated) goes into `generate` through that row every time (vLLM's weights
were dropped since); the inference rank of a disaggregated actor goes through it when the training weights changed
since its last push (the call says so: `weights_changed`); the training rank of one enters it when asked for the
phase. The driver asks for phases, never for a push.

ROLL's manual control is built on the same move: `offload_states` / `reload_states` settle the device on
the resident set less / plus the named states, and `PhaseStates` is ROLL's strategy object for one phase
(`state_offload_manager(PhaseStates(manager, phase), ...)` enters the phase, runs the body, leaves it).
The manager knows no engine: it moves registered states and calls the push.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Iterable

from mindspeed_rl.memory.capacity import DeviceCapacity
from mindspeed_rl.memory.offload import Offloader
from mindspeed_rl.memory.residency import (DROPPED_ON_PHASE_CHANGE, GENERATE, INFER_WEIGHTS_HOST, OLD_LOGPROB,
                                           RELOADED_LAST, STATE_GROUPS, SWITCH, UPDATE, ResidencyPolicy)
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
        self.push: WeightPush | None = None  # this rank's end(s) of the weight push
        self.colocated = False  # both ends here: every generate goes through the switch
        # An inference rank of a disaggregated actor: the training weights changed since its last push.
        self.weights_changed = False
        self.metrics: dict[str, float] = {}  # timings and push figures since the last pop_metrics
        self.capacity: DeviceCapacity | None = None  # runtime.device_memory_limit, checked as each phase's states come
        if weight_push is not None:
            self.attach_push(weight_push, colocated=True)

    def attach_push(self, push: WeightPush, *, colocated: bool) -> None:
        self.push, self.colocated = push, colocated
        self.offloader.register_host(INFER_WEIGHTS_HOST, push.host_tensors)
        self.weights_changed = not colocated  # a destination starts with vLLM's dummy weights

    def close_push(self) -> None:
        if self.push is not None:
            self.push.close()
            self.push = None

    # -- phases ------------------------------------------------------------------------------------
    def enter(self, phase: str) -> Moved:
        """Resident state groups := the phase's row; into the switch row (and through it into generate where this
        rank's vLLM needs new weights) this rank's end of the push runs."""
        started = time.perf_counter()
        moved = Moved()
        through_switch = phase == GENERATE and self.push is not None and (self.colocated or self.weights_changed)
        if phase == SWITCH or through_switch:
            moved += self._switch()
        if phase != SWITCH:
            moved += self._settle(self.policy.resident(phase), phase_change=True)
            self._check_capacity(phase)
        if phase in _ENTER_TIMINGS:
            self._add({_ENTER_TIMINGS[phase]: time.perf_counter() - started})
        return moved

    def _switch(self) -> Moved:
        needed = self.policy.resident(SWITCH) | (self.push.states_needed() if self.push is not None else frozenset())
        moved = self._settle(needed, phase_change=True)
        self._check_capacity(SWITCH)
        if self.push is not None:
            self._add(self.push.push())
            self.weights_changed = False
        return moved

    def leave(self, phase: str) -> Moved:
        """After `phase`'s call: keep what the iteration's next phase needs too, and the pinned states."""
        started = time.perf_counter()
        moved = self._settle(self.policy.after(phase), phase_change=True)
        if phase in _LEAVE_TIMINGS:
            self._add({_LEAVE_TIMINGS[phase]: time.perf_counter() - started})
        return moved

    def _check_capacity(self, phase: str) -> None:
        if self.capacity is not None:
            self.capacity.check(phase, self.offloader.resident_bytes())

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
