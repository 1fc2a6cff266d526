"""The memory ledger: device-resident bytes per category at every phase boundary (and the host bytes the offloader
holds per state: `memory/<phase>/host/<state>_bytes`).

The figures come from the objects that own the memory (the offloader's states, the KV cache)
rather than from a global counter, so each byte is attributed to a category. Where the device
has an allocator (CUDA, NPU) every record is cross-checked against its own count: what the
ledger cannot attribute is reported as `unaccounted_bytes`, and a ledger that claims more than
the allocator holds is a bug, logged as such. Activations are measured by what autograd saves
for backward (`ActivationMeter`), which works on every device including CPU.
"""
from __future__ import annotations

import logging
import threading
from dataclasses import dataclass, field
from typing import Callable

import torch

from mindspeed_rl.accelerator import Accelerator
from mindspeed_rl.memory.capacity import DeviceCapacity
from mindspeed_rl.memory.residency import RECORDED_PHASES, STATE_GROUPS

ACTIVATIONS = "activations"
CATEGORIES = STATE_GROUPS + (ACTIVATIONS,)
# The phases recorded while they run, the residency table's (`reward` only with a reward model).
PHASES = RECORDED_PHASES

logger = logging.getLogger(__name__)


@dataclass(frozen=True, kw_only=True)
class LedgerRecord:
    phase: str
    bytes_by_category: dict[str, int]
    allocator_bytes: int | None  # the device allocator's own count; None on CPU
    # Host bytes the offloader holds per state (mirrors of offloaded states, host-only states).
    host_bytes_by_category: dict[str, int] = field(default_factory=dict)

    @property
    def total_bytes(self) -> int:
        return sum(self.bytes_by_category.values())

    def metrics(self, prefix: str = "memory") -> dict[str, float]:
        """`memory/<phase>/<category>_bytes`, `.../total_bytes` and, where known, the allocator's view."""
        out = {f"{prefix}/{self.phase}/{name}_bytes": float(value) for name, value in self.bytes_by_category.items()}
        out[f"{prefix}/{self.phase}/total_bytes"] = float(self.total_bytes)
        if self.allocator_bytes is not None:
            out[f"{prefix}/{self.phase}/allocator_bytes"] = float(self.allocator_bytes)
            out[f"{prefix}/{self.phase}/unaccounted_bytes"] = float(self.allocator_bytes - self.total_bytes)
        if self.host_bytes_by_category:
            host = self.host_bytes_by_category
            out |= {f"{prefix}/{self.phase}/host/{name}_bytes": float(value) for name, value in host.items()}
            out[f"{prefix}/{self.phase}/host/total_bytes"] = float(sum(host.values()))
        return out


@dataclass
class MemoryLedger:
    """Records snapshots of `read_states()` (bytes per category) under phase names; keeps the latest of each
    phase only, so a run of any length holds a bounded ledger (each record is in that iteration's metrics)."""

    read_states: Callable[[], dict[str, int]]
    accelerator: Accelerator
    records: dict[str, LedgerRecord] = field(default_factory=dict)
    read_host_states: Callable[[], dict[str, int]] | None = None  # host bytes per state (Offloader.host_bytes)
    capacity: DeviceCapacity | None = None  # runtime.device_memory_limit: a record past it is out of memory

    def record(self, phase: str, extra: dict[str, int] | None = None) -> LedgerRecord:
        self.accelerator.synchronize()  # pending frees and copies must have landed before counting
        by_category = {**self.read_states(), **(extra or {})}
        if self.capacity is not None:
            self.capacity.check(phase.removeprefix("after_"), by_category)
        entry = LedgerRecord(phase=phase, bytes_by_category=by_category,
                             allocator_bytes=self.accelerator.memory_allocated_bytes(),
                             host_bytes_by_category=self.read_host_states() if self.read_host_states else {})
        if entry.allocator_bytes is not None and entry.allocator_bytes < entry.total_bytes:
            logger.warning("memory ledger at %s counts %d bytes but the allocator holds %d: a category is "
                           "counted twice or not really freed", phase, entry.total_bytes, entry.allocator_bytes)
        self.records[phase] = entry
        return entry

    def latest(self, phase: str) -> LedgerRecord | None:
        return self.records.get(phase)

    def activation_guard(self, phase: str, held_bytes: dict[str, int]) -> Callable[[int], None] | None:
        """For `ActivationMeter(on_grow=...)`: out of memory as soon as `held_bytes` (the states resident through
        the phase) and the live activations pass the capacity; None without one."""
        if self.capacity is None:
            return None
        capacity = self.capacity
        return lambda live_bytes: capacity.check(phase, {**held_bytes, ACTIVATIONS: live_bytes})


class _Saved:
    """What autograd keeps instead of a saved tensor while the meter is on; frees its count on death."""

    __slots__ = ("tensor", "meter", "key")

    def __init__(self, tensor: torch.Tensor, meter: "ActivationMeter", key: int):
        self.tensor, self.meter, self.key = tensor, meter, key

    def __del__(self):
        self.meter._release(self.key)


class ActivationMeter:
    """Peak bytes of the tensors autograd saves for backward, i.e. the activations.

    Storages of known states (parameters, which linear layers save too) are excluded by key;
    several views of one storage count once. Forward-only phases save nothing and read 0.
    """

    def __init__(self, exclude_storage_keys: set[int], *, on_grow: Callable[[int], None] | None = None):
        """`on_grow(live_bytes)` runs each time the live activations grow (a capacity check: it may raise)."""
        self.exclude = exclude_storage_keys
        self.on_grow = on_grow
        self.peak_bytes = 0
        self._live_bytes = 0
        self._refs: dict[int, list[int]] = {}  # storage key -> [references, nbytes]
        self._lock = threading.Lock()  # backward may run on autograd's device threads
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)

    def __enter__(self) -> "ActivationMeter":
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self._hooks.__exit__(*exc)

    def _pack(self, tensor: torch.Tensor):
        try:
            storage = tensor.untyped_storage()
        except (RuntimeError, NotImplementedError):  # sparse or otherwise storage-less tensors
            return tensor
        key = storage._cdata
        if key in self.exclude:
            return tensor
        with self._lock:
            entry = self._refs.setdefault(key, [0, storage.nbytes()])
            grew = entry[0] == 0
            if grew:
                self._live_bytes += entry[1]
                self.peak_bytes = max(self.peak_bytes, self._live_bytes)
            entry[0] += 1
            live = self._live_bytes
        saved = _Saved(tensor, self, key)  # counted from here: released when dropped, also if the check raises
        if grew and self.on_grow is not None:
            self.on_grow(live)
        return saved

    @staticmethod
    def _unpack(packed):
        return packed.tensor if isinstance(packed, _Saved) else packed

    def _release(self, key: int) -> None:
        with self._lock:
            entry = self._refs[key]
            entry[0] -= 1
            if entry[0] == 0:
                self._live_bytes -= entry[1]
                del self._refs[key]
