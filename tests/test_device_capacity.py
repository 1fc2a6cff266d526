"""In process: `runtime.device_memory_limit` (memory/capacity.py) - a phase's states coming in past the capacity, the
activations growing past it during a backward graph's forward, and a phase's record past it each raise
`out of device memory in <phase>`; the driver's one line; no restart for it; the config key; the launch plan's
verdict; a device allocator's own out-of-memory error named the same way. The planner's verdicts against real runs
under a capacity: tests/test_capacity_e2e.py (`make test-capacity`)."""
import sys
from pathlib import Path

import pytest
import torch

from mindspeed_rl.accelerator import get_accelerator
from mindspeed_rl.memory import ActivationMeter, MemoryLedger, Offloader
from mindspeed_rl.memory.capacity import DeviceCapacity, OutOfDeviceMemory, failure_phase_and_detail
from mindspeed_rl.memory.residency import (GENERATE, INFER_WEIGHTS, KV_CACHE, SWITCH, TRAIN_PARAMS, UPDATE,
                                           ResidencyPolicy)
from mindspeed_rl.trainer.restarts import Restarts
from mindspeed_rl.trainer.stopping import RunProgress
from mindspeed_rl.workers.sharding_manager import ShardingManager
from mindspeed_rl.workers.supervision import WorkerFailure

sys.path.insert(0, str(Path(__file__).resolve().parent))
from test_config import config_error, load  # noqa: E402

MIB = 1 << 20
OOM_FAILURE = ("rank 1 (host h, pid 7) failed in update: OutOfDeviceMemory: out of device memory in update: 9.00 MiB "
               "needed at once of runtime.device_memory_limit 8.00 MiB (activations 5.00 MiB, train_params 4.00 MiB) "
               "(at ledger.py:40 in check)")


def test_bytes_held_at_once_past_the_capacity_are_refused_naming_the_largest():
    capacity = DeviceCapacity(8 * MIB)
    capacity.check(UPDATE, {"a": 4 * MIB, "b": 4 * MIB})  # exactly full fits
    with pytest.raises(OutOfDeviceMemory) as raised:
        capacity.check(UPDATE, {"a": 4 * MIB, "b": 3 * MIB, "c": 2 * MIB, "d": 1})
    assert str(raised.value) == ("out of device memory in update: 9.00 MiB needed at once of "
                                 "runtime.device_memory_limit 8.00 MiB (a 4.00 MiB, b 3.00 MiB, c 2.00 MiB)")


def _manager(capacity_bytes: int) -> ShardingManager:
    """Train params and vLLM's weights and KV cache over CPU tensors (1, 2 and 3 MiB), all offloaded."""
    offloader = Offloader(get_accelerator("cpu"))
    for name, mib in ((TRAIN_PARAMS, 1), (INFER_WEIGHTS, 2), (KV_CACHE, 3)):
        tensor = torch.zeros(mib * MIB, dtype=torch.uint8)
        offloader.register(name, lambda t=tensor: [t])
    manager = ShardingManager(offloader=offloader, policy=ResidencyPolicy.offloading())
    offloader.offload_all()
    manager.capacity = DeviceCapacity(capacity_bytes)
    return manager


def test_a_phase_whose_states_pass_the_capacity_is_refused_as_they_come_in():
    _manager(5 * MIB + 1).enter(GENERATE)  # vLLM's 5 MiB fit
    with pytest.raises(OutOfDeviceMemory, match=r"^out of device memory in generate: 5\.00 MiB needed at once"):
        _manager(5 * MIB - 1).enter(GENERATE)


def test_the_switch_is_checked_with_what_it_holds():
    with pytest.raises(OutOfDeviceMemory, match="^out of device memory in switch: "):
        _manager(2 * MIB).enter(SWITCH)  # train params and vLLM's weights: 3 MiB


def test_activations_growing_past_the_capacity_stop_the_forward():
    ledger = MemoryLedger(lambda: {}, get_accelerator("cpu"), capacity=DeviceCapacity(3 * MIB))
    weight = torch.ones(256, 256, requires_grad=True)
    x = torch.ones(1024, 256)  # each saved [1024, 256] fp32 activation is 1 MiB
    guard = ledger.activation_guard(UPDATE, {TRAIN_PARAMS: 1 * MIB})
    with ActivationMeter({weight.untyped_storage()._cdata}, on_grow=guard) as meter:
        h = torch.tanh(x @ weight)  # saves x (1 MiB) and the tanh's output (1 MiB): 3 MiB with the params
        with pytest.raises(OutOfDeviceMemory, match="^out of device memory in update: 4.00 MiB"):
            torch.tanh(h @ weight)
    assert meter.peak_bytes == 3 * MIB
    assert ledger.activation_guard(UPDATE, {}) is not None
    assert MemoryLedger(lambda: {}, get_accelerator("cpu")).activation_guard(UPDATE, {}) is None


def test_a_record_past_the_capacity_names_its_phase():
    ledger = MemoryLedger(lambda: {TRAIN_PARAMS: 2 * MIB}, get_accelerator("cpu"), capacity=DeviceCapacity(3 * MIB))
    ledger.record("after_update")
    with pytest.raises(OutOfDeviceMemory, match="^out of device memory in update: "):
        ledger.record("after_update", extra={"activations": 2 * MIB})


def test_the_driver_says_it_in_one_line_starting_with_the_phase():
    line = RunProgress(save_root=None, iteration=2).worker_failure_line(WorkerFailure(OOM_FAILURE))
    assert line == ("out of device memory in update: 9.00 MiB needed at once of runtime.device_memory_limit 8.00 MiB "
                    "(activations 5.00 MiB, train_params 4.00 MiB); on rank 1 (host h, pid 7) during iteration 2; "
                    "last checkpoint: none (actor_config.save is not set)")
    assert failure_phase_and_detail("rank 0 (host h, pid 1) failed in update: RuntimeError: boom") is None


def test_running_out_of_device_memory_is_not_restarted(capsys):
    failure = WorkerFailure(OOM_FAILURE)
    with pytest.raises(WorkerFailure) as raised:
        Restarts(max_restarts=3, restart_wait_seconds=10).after(failure, RunProgress(iteration=1))
    assert raised.value is failure
    assert capsys.readouterr().out.strip() == "[restart] not restarting: the same layout runs out of device memory again"


def test_the_limit_is_a_size_or_null():
    assert load("grpo_tiny_cpu").runtime.device_memory_limit_bytes is None
    assert load("grpo_tiny_cpu", "runtime.device_memory_limit=64MiB").runtime.device_memory_limit_bytes == 64 * MIB
    assert load("grpo_tiny_cpu", "runtime.device_memory_limit=64GB").runtime.device_memory_limit_bytes == 64 * 10**9
    assert config_error("grpo_tiny_cpu", "runtime.device_memory_limit=lots").startswith(
        "runtime.device_memory_limit: a size such as 64MiB or 64GB, or null")


def test_the_launch_plan_names_the_first_phase_over_the_limit():
    from mindspeed_rl.planner.from_config import architecture, plan_config, resolve_hf_config
    from mindspeed_rl.trainer.setup import capacity_verdict

    config = load("grpo_tiny_cpu", "generate_config.cpu_kvcache_space_gb=0.002")
    plan = plan_config(config, architecture(resolve_hf_config(config)), with_switch=False, device="cpu")[0]
    totals = {phase: total for phase, (_, total) in plan.totals().items()}
    assert totals[GENERATE] < totals[UPDATE]
    assert capacity_verdict(plan, totals[UPDATE]).endswith(f"fits (peak {_mib(totals[UPDATE])} in update on rank 0)")
    assert capacity_verdict(plan, totals[UPDATE] - 1).endswith(
        f"does not fit: update needs {_mib(totals[UPDATE])} on rank 0, the first phase over")
    assert f"does not fit: {GENERATE} needs" in capacity_verdict(plan, totals[GENERATE] - 1)


def _mib(value: int) -> str:
    return f"{value / MIB:.2f} MiB"


def test_a_device_allocators_own_out_of_memory_error_names_the_phase():
    from mindspeed_rl.workers.phase_rpc import _device_out_of_memory_named

    with pytest.raises(OutOfDeviceMemory) as raised, _device_out_of_memory_named(UPDATE):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB.\nmore text")
    assert str(raised.value) == "out of device memory in update: CUDA out of memory. Tried to allocate 2.00 GiB."

