"""Each Megatron-on-CPU patch does what its reason says, and the scoped ones leave no trace.

Runs where: in the pytest process, no process group needed.
"""
import torch

from mindspeed_rl.accelerator import get_accelerator
from mindspeed_rl.accelerator.megatron_cpu import CPURNGStatesTracker, CudaToCpuMode, megatron_on_cpu


def test_rng_tracker_forks_the_cpu_generator_and_restores_it():
    tracker = CPURNGStatesTracker()
    tracker.add("model-parallel-rng", 1234)
    torch.manual_seed(0)
    outer_expected = torch.rand(3)
    torch.manual_seed(0)
    with tracker.fork("model-parallel-rng"):
        inside = torch.rand(3)
    outer = torch.rand(3)
    torch.manual_seed(1234)
    assert torch.equal(inside, torch.rand(3)), "the fork draws from the tracked seed"
    assert torch.equal(outer, outer_expected), "the default stream continues as if no fork happened"
    with tracker.fork("model-parallel-rng"):
        second = torch.rand(3)
    assert not torch.equal(second, inside), "the tracked stream advances between forks"


def test_megatron_context_is_scoped():
    original = torch.cuda.current_device
    with megatron_on_cpu():
        assert torch.cuda.current_device() == torch.device("cpu")
        with megatron_on_cpu():  # re-entrant
            assert torch.cuda.current_device() == torch.device("cpu")
        assert torch.cuda.current_device() == torch.device("cpu")
    assert torch.cuda.current_device is original


def test_cuda_to_cpu_mode_rewrites_devices_and_types():
    with CudaToCpuMode():
        made = torch.zeros(2, device="cuda")
        moved = torch.ones(2).cuda()
        to = torch.ones(2).to("cuda")
        kind = torch.ones(2).type()
    assert made.device.type == moved.device.type == to.device.type == "cpu"
    assert kind == "torch.cuda.FloatTensor"  # megatron's clip_grads asserts exactly this
    assert torch.ones(2).type() == "torch.FloatTensor"


def test_cpu_accelerator_contract():
    acc = get_accelerator("cpu")
    assert acc.distributed_backend == "gloo" and acc.is_host and not acc.supports_pinned_memory
    assert acc.memory_allocated_bytes() is None
    assert acc.host_buffer(10).nbytes() == 10
