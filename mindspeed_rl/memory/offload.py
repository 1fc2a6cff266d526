"""Move device states to host mirrors and back, keeping every tensor view valid.

A *state* is one category of device memory (train params, grads, optimizer states, reference
params, inference weights, KV cache). `Offloader` holds them by name and offloads or reloads
them; the ledger reads `resident_bytes()` from the same objects, so what is counted is what is
moved.

Storage groups free memory in place (`Accelerator.release_storage`: `resize_(0)` on a device, a
data-pointer swap on CPU) instead of re-binding `.data`: every parameter, grad view and
optimizer-state tensor object stays in place, so Megatron's contiguous buffers, the optimizer's
param groups, DDP hooks and vLLM's layers never notice. Host mirrors are
allocated once (pinned where the accelerator can DMA from them) and reused: after the first
offload, offload and reload only copy. With pinned mirrors every copy of a group is issued
non-blocking and the group waits once at the end.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Iterable, Protocol

import torch

from mindspeed_rl.accelerator import Accelerator


class OffloadableState(Protocol):
    """One category of device memory that can leave the device and come back."""

    name: str

    @property
    def resident(self) -> bool: ...

    def resident_bytes(self) -> int: ...

    def offload(self, *, keep_contents: bool | None = None) -> int:
        """Free the device memory; returns the bytes copied to the host (0 when contents are dropped)."""

    def reload(self) -> int:
        """Re-acquire the device memory; returns the bytes copied back from the host."""


def _bytes_view(storage: torch.UntypedStorage) -> torch.Tensor:
    """A flat uint8 tensor over a storage: tensor copies are multithreaded, and take non_blocking."""
    return torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage)


@dataclass
class _Slot:
    storage: torch.UntypedStorage
    nbytes: int
    mirror: torch.Tensor | None = None  # uint8 host buffer, allocated at the first offload that keeps contents


class StorageGroup:
    """All distinct storages behind the tensors of one category (e.g. optimizer states).

    `collect` is re-read whenever the group is resident: optimizer states appear at the first
    step and a tensor may be re-bound, so the slot list follows the live tensors; mirrors of
    storages that are still there are kept.
    """

    def __init__(self, name: str, collect: Callable[[], Iterable[torch.Tensor]], accelerator: Accelerator,
                 *, keep_contents: bool = True):
        self.name = name
        self.collect = collect
        self.accelerator = accelerator
        self.keep_contents = keep_contents  # default for offload(); grads and inference weights may drop
        self.resident = True
        self.slots: dict[int, _Slot] = {}
        self._saved = True  # whether the last offload copied contents out

    def _refresh(self) -> None:
        if not self.resident:
            return  # offloaded storages have size 0; the slots remember what to bring back
        slots: dict[int, _Slot] = {}
        for tensor in self.collect():
            storage = tensor.untyped_storage()
            key = storage._cdata  # the StorageImpl: stable across release/acquire, shared by all views
            if key in slots or storage.nbytes() == 0:
                continue
            old = self.slots.get(key)
            slots[key] = old if old is not None and old.nbytes == storage.nbytes() else _Slot(storage, storage.nbytes())
        self.slots = slots

    def resident_bytes(self) -> int:
        if not self.resident:
            return 0
        self._refresh()
        return sum(slot.nbytes for slot in self.slots.values())

    def storage_keys(self) -> set[int]:
        self._refresh()
        return set(self.slots)

    def host_bytes(self) -> int:
        """Its host mirrors' bytes: allocated at the first offload that keeps contents, then kept for the next."""
        return sum(slot.mirror.numel() for slot in self.slots.values() if slot.mirror is not None)

    def offload(self, *, keep_contents: bool | None = None) -> int:
        if not self.resident:
            return 0
        keep = self.keep_contents if keep_contents is None else keep_contents
        self._refresh()
        copied = 0
        if keep:
            pinned = self.accelerator.supports_pinned_memory
            for slot in self.slots.values():
                if slot.mirror is None:
                    slot.mirror = _bytes_view(self.accelerator.host_buffer(slot.nbytes))
                slot.mirror.copy_(_bytes_view(slot.storage), non_blocking=pinned)
                copied += slot.nbytes
            self.accelerator.synchronize()  # the mirrors must be complete before the storage goes
        for slot in self.slots.values():
            self.accelerator.release_storage(slot.storage)
        self._saved = keep
        self.resident = False
        return copied

    def reload(self, *, stream=None) -> int:
        """Bring the storages back; returns the bytes copied. With `stream` (Accelerator.copy_stream) the copies are
        enqueued there and the call returns at once: `Accelerator.wait_for(stream)` before the contents are used."""
        if self.resident:
            return 0
        copied = 0
        pinned = self.accelerator.supports_pinned_memory
        for slot in self.slots.values():
            # Dropped contents come back as zeros: grads as after zero_grad; inference weights are
            # overwritten by the next switch, and zeros fail its fingerprint check if not.
            # Acquired on the current stream, which uses the memory and frees it after a synchronize (offload).
            self.accelerator.acquire_storage(slot.storage, slot.nbytes, zeroed=not self._saved)
        with self.accelerator.after_current_work(stream):
            for slot in self.slots.values():
                if self._saved:
                    _bytes_view(slot.storage).copy_(slot.mirror, non_blocking=pinned)
                    copied += slot.nbytes
        if stream is None:
            self.accelerator.synchronize()
        self.resident = True
        return copied


class Offloader:
    """The named states of one rank; offloads and reloads them and counts the bytes it copies."""

    def __init__(self, accelerator: Accelerator):
        self.accelerator = accelerator
        self.states: dict[str, OffloadableState] = {}
        # States that live on the host only and never move (LoRA's backbone copy of vLLM's weights): registered so
        # that the ledger counts them.
        self.host_states: dict[str, Callable[[], Iterable[torch.Tensor]]] = {}
        self.bytes_copied = 0

    def register(self, name: str, collect: Callable[[], Iterable[torch.Tensor]], *,
                 keep_contents: bool = True) -> StorageGroup:
        group = StorageGroup(name, collect, self.accelerator, keep_contents=keep_contents)
        self.add(group)
        return group

    def register_host(self, name: str, collect: Callable[[], Iterable[torch.Tensor]]) -> None:
        if name in self.host_states or name in self.states:
            raise ValueError(f"state {name!r} registered twice")
        self.host_states[name] = collect

    def add(self, state: OffloadableState) -> None:
        if state.name in self.states:
            raise ValueError(f"offload state {state.name!r} registered twice")
        self.states[state.name] = state

    def _state(self, name: str) -> OffloadableState:
        if name not in self.states:
            raise KeyError(f"unknown offload state {name!r}; registered: {sorted(self.states)}")
        return self.states[name]

    def offload(self, name: str, *, keep_contents: bool | None = None) -> int:
        copied = self._state(name).offload(keep_contents=keep_contents)
        self.bytes_copied += copied
        return copied

    def reload(self, name: str) -> int:
        copied = self._state(name).reload()
        self.bytes_copied += copied
        return copied

    def offload_all(self, names: Iterable[str] | None = None, *, keep_contents: bool | None = None) -> int:
        return sum(self.offload(name, keep_contents=keep_contents) for name in self._names(names))

    def reload_all(self, names: Iterable[str] | None = None) -> int:
        return sum(self.reload(name) for name in self._names(names))

    def _names(self, names: Iterable[str] | None) -> list[str]:
        return list(self.states) if names is None else list(names)

    def is_resident(self, name: str) -> bool:
        return self._state(name).resident

    def resident_bytes(self) -> dict[str, int]:
        return {name: state.resident_bytes() for name, state in self.states.items()}

    def phase_bytes(self) -> dict[str, int]:
        """What the ledger records: resident bytes, or for a state that moves within a phase (the swapped optimizer
        states) the most it held since the last record."""
        return {name: state.peak_since_read() if hasattr(state, "peak_since_read") else state.resident_bytes()
                for name, state in self.states.items()}

    def host_bytes(self) -> dict[str, int]:
        """Host bytes per state: the storage groups' mirrors (vLLM's states keep none of their own here) and the
        host-only states."""
        out = {name: state.host_bytes() for name, state in self.states.items() if hasattr(state, "host_bytes")}
        for name, collect in self.host_states.items():
            out[name] = sum(tensor.untyped_storage().nbytes() for tensor in collect())
        return out

    def storage_keys(self) -> set[int]:
        """Storages owned by storage groups: the activation meter must not count them."""
        keys: set[int] = set()
        for state in self.states.values():
            if hasattr(state, "storage_keys"):
                keys |= state.storage_keys()
        return keys
