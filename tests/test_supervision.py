"""The driver's watchdog pieces: deadlines, heartbeats, error text, placement, fault specs.

Runs where: in-process, with a local Ray cluster of 2 CPUs and small actors (no engines); ~20 s.
"""
import os
import signal
import time

import pytest
import ray

from mindspeed_rl.config import ConfigError
from mindspeed_rl.workers.fault_injection import FaultSpec
from mindspeed_rl.workers.group import RayActorGroup, wait_all
from mindspeed_rl.workers.supervision import (Deadlines, HeartbeatWatch, WorkerAddress, WorkerFailure,
                                              describe_worker_error, silent_ranks, start_heartbeat)


def test_a_deadline_is_the_base_until_an_rpc_has_run_slowly():
    deadlines = Deadlines(rpc_timeout_seconds=10, initialize_timeout_seconds=100)
    assert deadlines.seconds("update") == 10
    assert deadlines.seconds("initialize") == 100
    deadlines.observe("update", 2.0)
    assert deadlines.seconds("update") == 10  # 4 x 2 s is still under the base
    deadlines.observe("update", 5.0)
    assert deadlines.seconds("update") == 20
    assert deadlines.seconds("generate_sequences") == 10


def test_a_fault_spec_names_method_rank_call_and_action():
    assert FaultSpec.parse("update:1:2:stop") == FaultSpec(method="update", rank=1, call=2, action="stop")
    for bad in ("update:1:2", "update:x:2:raise", "update:1:2:explode"):
        with pytest.raises(ValueError, match="METHOD:RANK:CALL:ACTION"):
            FaultSpec.parse(bad)


def test_a_fault_spec_with_times_fires_that_often_in_the_whole_run_counted_in_its_log(tmp_path, monkeypatch):
    from mindspeed_rl.workers.fault_injection import FAULT_LOG_ENV_VAR, inject, parse_faults

    monkeypatch.delenv(FAULT_LOG_ENV_VAR, raising=False)
    with pytest.raises(ValueError, match="xTIMES counts in"):
        FaultSpec.parse("update:1:2:stop:x1")
    monkeypatch.setenv(FAULT_LOG_ENV_VAR, str(tmp_path / "faults.log"))
    kill, raise_ = parse_faults("save_checkpoint:0:1:kill:x1,update:1:3:raise:x2")
    assert kill == FaultSpec(method="save_checkpoint", rank=0, call=1, action="kill", times=1)
    assert not raise_.spent(1)
    for fired in (1, 2):
        with pytest.raises(RuntimeError, match="injected fault in update on rank 1"):
            inject(raise_, 1)
        assert raise_.spent(1) == (fired == 2)  # the next process of rank 1 (a restart) reads the same log
    assert not kill.spent(0)


def test_a_fault_spec_with_a_role_wraps_only_that_groups_worker_class():
    from mindspeed_rl.workers.fault_injection import worker_class_with_faults
    from mindspeed_rl.workers.parts.inference import InferencePart
    from mindspeed_rl.workers.parts.training import TrainingPart
    from mindspeed_rl.workers.rank_worker import compose

    train, infer = compose("actor_train", (TrainingPart,)), compose("actor_infer", (InferencePart,))
    spec = "actor_infer/generate_sequences:0:2:kill"
    assert FaultSpec.parse(spec) == FaultSpec(method="generate_sequences", rank=0, call=2, action="kill",
                                              role="actor_infer")
    assert worker_class_with_faults(spec, train) is train
    faulty = worker_class_with_faults(spec, infer)
    assert issubclass(faulty, infer) and faulty.generate_sequences is not infer.generate_sequences
    assert worker_class_with_faults("update:0:2:kill", train) is not train
    assert worker_class_with_faults(None, train) is train


@pytest.fixture(scope="module")
def local_ray():
    os.environ.setdefault("RAY_ACCEL_ENV_VAR_OVERRIDE_ON_ZERO", "0")
    ray.init(num_cpus=2, include_dashboard=False, configure_logging=False, log_to_driver=False)
    yield
    ray.shutdown()


@ray.remote(num_cpus=0)
class Beating:
    def __init__(self, run_key: str, rank: int):
        start_heartbeat(run_key, rank, interval_seconds=0.2)

    def pid(self) -> int:
        return os.getpid()

    def fail(self):
        raise ValueError("bad value 7")

    def die(self):
        os._exit(3)

    def sleep(self, seconds: float) -> None:
        time.sleep(seconds)


def test_heartbeats_tell_a_stopped_process_from_a_live_one(local_ray):
    ranks = [Beating.remote("hb-test", 0), Beating.remote("hb-test", 1)]
    pids = ray.get([r.pid.remote() for r in ranks])
    time.sleep(1.0)
    assert silent_ranks("hb-test", [0, 1], watch_seconds=1.0) == []
    os.kill(pids[0], signal.SIGSTOP)
    try:
        time.sleep(0.5)
        assert silent_ranks("hb-test", [0, 1], watch_seconds=1.0) == [0]
    finally:
        os.kill(pids[0], signal.SIGKILL)
        for r in ranks:
            ray.kill(r)


def test_the_heartbeat_watch_names_a_stopped_rank_after_its_timeout_and_never_a_rank_that_never_beat(local_ray):
    ranks = [Beating.remote("watch-test", 0), Beating.remote("watch-test", 1)]
    pids = ray.get([r.pid.remote() for r in ranks])
    watch = HeartbeatWatch("watch-test", timeout_seconds=1.0, poll_seconds=0.1)
    try:
        deadline = time.monotonic() + 2.0
        while time.monotonic() < deadline:
            assert watch.silent([0, 1, 5]) == [], "live ranks, and rank 5 has never beaten"
            time.sleep(0.1)
        os.kill(pids[0], signal.SIGSTOP)
        stopped = time.monotonic()
        while not (named := watch.silent([0, 1, 5])):
            assert time.monotonic() - stopped < 3.0, "the stopped rank is named within its timeout and a poll"
            time.sleep(0.1)
        # Silence counts from the rank's last beat, which came up to one beat interval (0.2 s) before the stop.
        assert time.monotonic() - stopped >= 1.0 - 0.2
        assert named == [0]
    finally:
        os.kill(pids[0], signal.SIGKILL)
        for r in ranks:
            ray.kill(r)


class _Group:
    """What wait_all reads of a rank group, with RayActorGroup's own messages."""

    def __init__(self, run_key: str, actors, deadline_seconds: float):
        self.run_key = run_key
        self.deadlines = Deadlines(rpc_timeout_seconds=deadline_seconds, initialize_timeout_seconds=deadline_seconds)
        self.heartbeats = HeartbeatWatch(run_key, timeout_seconds=60.0)
        self.addresses = [WorkerAddress(rank=r, host="h", pid=pid) for r, pid in
                          enumerate(ray.get([a.pid.remote() for a in actors]))]

    _hang_message = RayActorGroup._hang_message
    _failure_message = RayActorGroup._failure_message
    _frozen_message = RayActorGroup._frozen_message
    _stopped_message = RayActorGroup._stopped_message


def test_a_rank_that_beats_but_never_finishes_is_reported_at_the_rpc_deadline(local_ray):
    actors = [Beating.remote("deadline-test", 0)]
    group = _Group("deadline-test", actors, deadline_seconds=2.0)
    started = time.monotonic()
    try:
        with pytest.raises(WorkerFailure) as raised:
            wait_all([(group, "update", [actors[0].sleep.remote(30)])])
        assert str(raised.value) == ("rank 0 (host h, pid %d) did not finish update within 2 s "
                                     "(runtime.rpc_timeout_seconds, or 4x the slowest earlier update); each is still "
                                     "alive (heartbeat)" % group.addresses[0].pid)
        assert time.monotonic() - started < 10
    finally:
        ray.kill(actors[0])


def test_a_raising_worker_is_described_by_its_type_message_and_frame(local_ray):
    actor = Beating.remote("err-test", 0)
    with pytest.raises(ray.exceptions.RayTaskError) as raised:
        ray.get(actor.fail.remote())
    text = describe_worker_error(raised.value)
    assert text.startswith("ValueError: bad value 7 (at test_supervision.py:")
    assert text.endswith(" in fail)")
    ray.kill(actor)


def test_a_dead_worker_is_described_as_died(local_ray):
    actor = Beating.remote("die-test", 0)
    with pytest.raises(ray.exceptions.RayActorError) as raised:
        ray.get(actor.die.remote())
    assert describe_worker_error(raised.value).startswith("the worker process died")


def test_a_placement_that_cannot_be_satisfied_names_the_missing_resource(local_ray):
    from mindspeed_rl.workers.placement import place_ranks

    started = time.monotonic()
    with pytest.raises(ConfigError, match=r"could not place 3 rank\(s\) within 2 s .*CPU: 3 needed, 2 in the cluster"):
        place_ranks(3, device="cpu", cpus_per_slot=1.0, num_gpus_per_node=None, timeout_seconds=2)
    assert time.monotonic() - started < 10


def test_ranks_are_cut_into_nodes_of_num_gpus_per_node():
    from mindspeed_rl.workers.placement import node_slices

    assert node_slices(16, 8) == [range(0, 8), range(8, 16)]
    assert node_slices(4, None) == [range(0, 4)]
    assert node_slices(6, 4) == [range(0, 4), range(4, 6)]


def test_each_node_is_one_strict_pack_group_and_rank_r_sits_on_node_r_div_per_node(local_ray):
    from mindspeed_rl.workers.placement import place_ranks

    placement = place_ranks(2, device="cpu", cpus_per_slot=0.5, num_gpus_per_node=1, timeout_seconds=30)
    try:
        assert len(placement.groups) == 2
        assert placement.slots == [(0, 0), (1, 0)]
        assert all(group.bundle_specs == [{"CPU": 0.5}] for group in placement.groups)
    finally:
        placement.remove()
