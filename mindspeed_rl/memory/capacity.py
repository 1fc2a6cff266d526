"""A device's capacity (`runtime.device_memory_limit`), refused as a device refuses an allocation.

On CPU there is no device allocator to run out: the capacity is enforced where the engine takes memory that the
ledger attributes, at the moment it takes it - a phase's states coming in (the sharding manager, every phase of the
residency table, idle and the switch included), the activations autograd saves as they grow (`ActivationMeter`),
and each phase's record (the update's states, activations and swapped optimizer bucket together, as the planner
sums them). On CUDA/NPU the allocator itself is capped as well (`Accelerator.limit_memory`) and its own
out-of-memory error is reported the same way (workers/phase_rpc.py).

The failure is one line for the user, `out of device memory in <phase>: ...` (trainer/stopping.py); the run is not
restarted for it (the same layout runs out again).
"""
from __future__ import annotations

from dataclasses import dataclass

from mindspeed_rl.sizes import format_bytes

MARK = "out of device memory in "


class OutOfDeviceMemory(RuntimeError):
    """A phase needed more device memory than the device has; the message starts with `MARK`."""


def out_of_memory(phase: str, detail: str) -> OutOfDeviceMemory:
    return OutOfDeviceMemory(f"{MARK}{phase}: {detail}")


@dataclass(frozen=True)
class DeviceCapacity:
    capacity_bytes: int

    def check(self, phase: str, bytes_by_category: dict[str, int]) -> None:
        """Raise OutOfDeviceMemory when the bytes held at once pass the capacity (naming the three largest)."""
        total = sum(bytes_by_category.values())
        if total <= self.capacity_bytes:
            return
        largest = sorted(((v, k) for k, v in bytes_by_category.items() if v), reverse=True)[:3]
        parts = ", ".join(f"{name} {format_bytes(value)}" for value, name in largest)
        raise out_of_memory(phase, f"{format_bytes(total)} needed at once of runtime.device_memory_limit "
                                   f"{format_bytes(self.capacity_bytes)} ({parts})")


def failure_phase_and_detail(failure_text: str) -> tuple[str, str] | None:
    """(phase, the rest of the line) of a worker failure that ran out of device memory; None for any other."""
    start = failure_text.find(MARK)
    if start < 0:
        return None
    phase, _, detail = failure_text[start + len(MARK):].partition(": ")
    detail = detail.split("; not responding:")[0]
    at = detail.rfind(" (at ")  # the worker's innermost frame: not the user's business here
    return phase, detail[:at] if at >= 0 and detail.endswith(")") else detail
