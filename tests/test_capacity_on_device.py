"""On CUDA (make gpu-check, `MINDSPEED_RL_TEST_DEVICE=cuda`): `runtime.device_memory_limit` caps the allocator itself
(Accelerator.limit_memory), and its out-of-memory error is named as the capacity's line. The CPU capacity:
tests/test_device_capacity.py. Skipped elsewhere."""
import os

import pytest
import torch

from mindspeed_rl.accelerator import get_accelerator
from mindspeed_rl.memory.capacity import OutOfDeviceMemory
from mindspeed_rl.memory.residency import UPDATE

MIB = 1 << 20


@pytest.mark.skipif(os.environ.get("MINDSPEED_RL_TEST_DEVICE") != "cuda", reason="needs CUDA (make gpu-check runs it)")
def test_a_capped_cuda_allocator_refuses_past_the_limit_with_the_line():
    """On CUDA the limit caps the allocator itself (Accelerator.limit_memory): an allocation past it raises torch's
    out-of-memory error, which a phase RPC names as the capacity's line; below the cap allocations go on."""
    from mindspeed_rl.workers.phase_rpc import _device_out_of_memory_named

    accelerator = get_accelerator("cuda")
    total = torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory
    torch.cuda.empty_cache()  # earlier tests' cached blocks would serve the allocation without asking the cap
    accelerator.limit_memory(torch.cuda.memory_reserved() + 256 * MIB)
    try:
        with pytest.raises(OutOfDeviceMemory, match=r"^out of device memory in update: CUDA out of memory"), \
                _device_out_of_memory_named(UPDATE):
            torch.empty(512 * MIB, dtype=torch.uint8, device="cuda")
        assert torch.empty(64 * MIB, dtype=torch.uint8, device="cuda").numel() == 64 * MIB
    finally:
        accelerator.limit_memory(total)
