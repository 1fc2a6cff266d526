"""The only code that knows whether we run on `cpu`, `cuda` or `npu`.

Everything else asks `get_accelerator()` for a device, a collective backend, memory statistics,
host buffers and a context in which Megatron-core may run.
"""
from mindspeed_rl.accelerator.base import Accelerator, detect_device, get_accelerator, missing_device

__all__ = ["Accelerator", "detect_device", "get_accelerator", "missing_device"]
