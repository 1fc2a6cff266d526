"""Which runs put their one rank in the driver process (workers/local_group.py) and which start Ray:
`reason_for_ray` on the shipped configs, and the error line of an exception raised in this process.

Runs where: in-process, config loading only (no Ray, no engines); ~5 s.
"""
import sys
from pathlib import Path

from mindspeed_rl.workers.local_group import reason_for_ray
from mindspeed_rl.workers.supervision import describe_local_error

sys.path.insert(0, str(Path(__file__).resolve().parent))
from test_config import config_error, load  # noqa: E402


def test_the_one_rank_demos_run_their_rank_in_the_driver():
    assert reason_for_ray(load("grpo_tiny_cpu")) is None
    assert reason_for_ray(load("grpo_tiny_math_cpu")) is None


def test_local_single_rank_false_starts_ray_for_one_rank():
    assert reason_for_ray(load("grpo_tiny_cpu", "runtime.local_single_rank=false")) == "runtime.local_single_rank=false"


def test_a_ray_address_starts_ray_for_one_rank():
    config = load("grpo_tiny_cpu", "runtime.ray_address=auto")
    assert reason_for_ray(config) == "runtime.ray_address=auto"


def test_restarts_start_ray_for_one_rank():
    # The in-process rank is the driver: a restart could not survive its death.
    assert reason_for_ray(load("grpo_tiny_cpu", "runtime.max_restarts=1")) == \
        "runtime.max_restarts=1: a restart needs the rank in a process of its own"


def test_two_rank_processes_start_ray():
    assert reason_for_ray(load("grpo_tiny_cpu_pp2_infer_tp2")) == "2 rank processes"


def test_a_disaggregated_run_starts_ray():
    config = load("grpo_tiny_cpu_disaggregated")
    assert reason_for_ray(config) == "disaggregated: actor_train and actor_infer have ranks of their own"


def test_cpu_reward_workers_start_ray_even_for_one_rank():
    config = load("grpo_tiny_cpu_colocated_roles")
    assert config.num_rank_processes == 1
    assert reason_for_ray(config) == "rewards.rule.world_size=2 CPU reward workers"


def test_a_rewards_section_without_workers_leaves_the_rank_in_the_driver():
    assert reason_for_ray(load("grpo_tiny_cpu_colocated_roles", "rewards.rule.world_size=0")) is None


def test_local_single_rank_takes_a_bool_only():
    assert config_error("grpo_tiny_cpu", "runtime.local_single_rank=sometimes") == (
        "runtime.local_single_rank: expected bool, got 'sometimes' (str)")


def _fail_here():
    raise ValueError("bad value\nsecond line")


def test_an_error_raised_in_this_process_is_described_by_type_message_and_innermost_frame():
    try:
        _fail_here()
    except ValueError as error:
        line = _fail_here.__code__.co_firstlineno + 1
        assert describe_local_error(error) == (
            f"ValueError: bad value (at test_local_group_selection.py:{line} in _fail_here)")


class _CheckpointFailed(BaseException):
    """Like torch.distributed.checkpoint's CheckpointException (a full disk during a save): no Exception."""


class _Rank:
    ROLE = ""

    def __init__(self, config, rank_info, *, model_dir, ref_model_dir):
        pass

    def address(self):
        from mindspeed_rl.workers.supervision import WorkerAddress

        return WorkerAddress(rank=0, host="h", pid=42)

    def save(self):
        raise _CheckpointFailed("unexpected pos 704 vs 598")

    def stop(self):
        import signal

        from mindspeed_rl.interrupts import RunInterrupted

        raise RunInterrupted(signal.SIGTERM)


def test_an_in_process_rank_failing_with_any_base_exception_is_one_worker_failure_line_but_a_stop_is_not():
    import pytest

    from mindspeed_rl.interrupts import RunInterrupted
    from mindspeed_rl.workers.local_group import LocalActorGroup
    from mindspeed_rl.workers.supervision import WorkerFailure

    group = LocalActorGroup(config=load("grpo_tiny_cpu"), env_vars={}, model_dir="", ref_model_dir="", threads=0,
                            worker_class=_Rank)
    try:
        with pytest.raises(WorkerFailure) as info:
            group.call("save")
        assert str(info.value).startswith("rank 0 (host h, pid 42) failed in save: _CheckpointFailed: unexpected pos")
        with pytest.raises(RunInterrupted):
            group.call("stop")
    finally:
        group._closed.set()  # the watchdog thread; kill() would also end this process's torch.distributed world
