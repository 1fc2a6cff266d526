"""Move tensor storages between the device and host mirrors, keeping every view valid.

Freeing a storage with `resize_(0)` (instead of re-binding `.data`) leaves each parameter, grad
view and optimizer-state tensor object in place, so Megatron's contiguous buffers, the optimizer's
param groups and DDP hooks never notice. Host mirrors are allocated once and reused: offload and
reload only copy.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Iterable

import torch

from mindspeed_rl.accelerator import Accelerator


@dataclass
class _Slot:
    storage: torch.UntypedStorage
    nbytes: int
    mirror: torch.UntypedStorage | None = None


@dataclass
class StorageGroup:
    """All distinct storages behind a set of tensors of one category (e.g. optimizer states)."""

    name: str
    collect: Callable[[], Iterable[torch.Tensor]]  # re-read on every offload: state may appear lazily
    keep_contents: bool = True  # grads may be dropped instead of copied
    resident: bool = True
    slots: dict[int, _Slot] = field(default_factory=dict)

    def _refresh(self) -> None:
        for tensor in self.collect():
            storage = tensor.untyped_storage()
            key = storage._cdata  # the StorageImpl: stable across resize_, shared by all views
            if key not in self.slots and storage.nbytes() > 0:
                self.slots[key] = _Slot(storage=storage, nbytes=storage.nbytes())

    def resident_bytes(self) -> int:
        if not self.resident:
            return 0
        self._refresh()
        return sum(slot.nbytes for slot in self.slots.values())


class Offloader:
    """Offload/reload named storage groups; counts the bytes it copies."""

    def __init__(self, accelerator: Accelerator):
        self.accelerator = accelerator
        self.groups: dict[str, StorageGroup] = {}
        self.bytes_copied = 0

    def register(self, name: str, collect: Callable[[], Iterable[torch.Tensor]], *, keep_contents: bool = True) -> None:
        assert name not in self.groups, f"storage group {name} registered twice"
        self.groups[name] = StorageGroup(name=name, collect=collect, keep_contents=keep_contents)

    def offload(self, name: str) -> int:
        group = self.groups[name]
        if not group.resident:
            return 0
        group._refresh()
        moved = 0
        for slot in group.slots.values():
            if group.keep_contents:
                if slot.mirror is None:
                    slot.mirror = self.accelerator.host_buffer(slot.nbytes)
                slot.mirror.copy_(slot.storage)
                moved += slot.nbytes
            slot.storage.resize_(0)
        group.resident = False
        self.bytes_copied += moved
        return moved

    def reload(self, name: str) -> int:
        group = self.groups[name]
        if group.resident:
            return 0
        moved = 0
        for slot in group.slots.values():
            slot.storage.resize_(slot.nbytes)
            if group.keep_contents:
                slot.storage.copy_(slot.mirror)
                moved += slot.nbytes
            else:
                slot.storage.fill_(0)  # dropped grads come back as zeros, as after zero_grad
        group.resident = True
        self.bytes_copied += moved
        return moved

    def resident_bytes(self) -> dict[str, int]:
        return {name: group.resident_bytes() for name, group in self.groups.items()}
