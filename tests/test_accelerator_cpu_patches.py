"""Each Megatron-on-CPU patch does what its reason says, and the scoped ones leave no trace.

Runs where: in the pytest process, no process group needed.
"""
import torch

from mindspeed_rl.accelerator import get_accelerator
from mindspeed_rl.accelerator.megatron_cpu import CPURNGStatesTracker, megatron_on_cpu


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


def test_megatron_scope_makes_cuda_factories_and_moves_mean_cpu():
    with megatron_on_cpu():
        made = [torch.zeros(2, device="cuda"), torch.tensor([1.0], device="cuda"), torch.ones(2, 2, device="cuda:0"),
                torch.empty_like(torch.ones(2), device=torch.device("cuda"))]
        moved = torch.ones(2).cuda()
        to = [torch.ones(2).to("cuda"), torch.ones(2).to(device="cuda"), torch.ones(2).to("cuda", torch.float64)]
        kind = torch.ones(2).type()
        cast = torch.ones(2).type(torch.float64)
    assert all(t.device.type == "cpu" for t in [*made, moved, *to])
    assert to[2].dtype == torch.float64 and cast.dtype == torch.float64
    assert kind == "torch.cuda.FloatTensor"  # megatron's clip_grads asserts exactly this


def test_megatron_scope_restores_torch_after_it():
    originals = (torch.zeros, torch.tensor, torch.Tensor.to, torch.Tensor.type, torch.Tensor.cuda)
    with megatron_on_cpu():
        with megatron_on_cpu():  # re-entrant: the inner exit keeps the outer patches
            pass
        assert torch.zeros(1, device="cuda").device.type == "cpu"
    assert (torch.zeros, torch.tensor, torch.Tensor.to, torch.Tensor.type, torch.Tensor.cuda) == originals
    assert torch.ones(2).type() == "torch.FloatTensor"
    assert "to" not in torch.Tensor.__dict__ and "type" not in torch.Tensor.__dict__


def test_megatron_scope_leaves_ordinary_calls_unwrapped():
    # The point of scoping the factories: the forward's ops (matmul, add, softmax) are torch's own.
    with megatron_on_cpu():
        assert torch.matmul is torch._C._VariableFunctions.matmul
        assert torch._C._is_torch_function_mode_enabled() is False


def test_cpu_accelerator_contract():
    acc = get_accelerator("cpu")
    assert acc.distributed_backend == "gloo" and acc.is_host and not acc.supports_pinned_memory
    assert acc.memory_allocated_bytes() is None
    assert acc.host_buffer(10).nbytes() == 10
