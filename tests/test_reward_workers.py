"""CPU reward workers (`rewards.<name>.world_size`) on a local Ray cluster: the same scores as in-process
scoring, and a verifier that raises or hangs, a worker that hangs (SIGSTOP) or dies (SIGKILL) scoring
0 for the samples concerned, counted, without stalling the step.

Runs where: one local Ray cluster (ray.init(num_cpus=2)) shared by the module; ~30 s on 2 cores.
"""
import os
import signal
import sys
import time
from pathlib import Path

import pytest
import ray
import torch

from mindspeed_rl.data.rewards import VERIFIERS, arith_acc, compute_rule_rewards
from mindspeed_rl.workers.reward_workers import RewardWorkerGroup
from mindspeed_rl.workers.supervision import WorkerFailure

sys.path.insert(0, str(Path(__file__).resolve().parent))
from test_config import load  # noqa: E402

LIMIT = 0.5


# Registered for these tests only (passed to the group, which ships them to its workers).
def picky(response: str, label: str) -> float:
    """Raises on "boom", hangs on "hang" (sleeps far past the limit), else 1.0."""
    if response == "boom":
        raise ValueError("boom")
    if response == "hang":
        time.sleep(60)
    return 1.0


def self_destructive(response: str, label: str) -> float:
    """Stops its whole worker process on "freeze" (a hung worker), kills it on "crash" (a dead one).

    It first gives Ray's threads a moment (well inside the verifier limit) to send the answer of the sample before:
    a process stopped or killed the instant that task returned could take that answer with it, and the test would
    see a healthy sample scored 0 (it did, about one run in three)."""
    if response in ("freeze", "crash"):
        time.sleep(0.2)
    if response == "freeze":
        os.kill(os.getpid(), signal.SIGSTOP)
    if response == "crash":
        os.kill(os.getpid(), signal.SIGKILL)
    return arith_acc(response, label)


@pytest.fixture(scope="module", autouse=True)
def local_ray():
    # This module is not importable in the workers: its verifiers travel by value.
    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])
    os.environ.setdefault("RAY_ACCEL_ENV_VAR_OVERRIDE_ON_ZERO", "0")
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    ray.init(num_cpus=2, include_dashboard=False, configure_logging=False, log_to_driver=False)
    yield
    ray.shutdown()


def _batch(n: int) -> tuple[list[str], list[str]]:
    responses = [f"{i % 7}" if i % 3 else f"Step 1: {i} +" for i in range(n)]
    labels = [str(i % 5) for i in range(n)]
    return responses, labels


def test_workers_from_config_score_like_the_driver() -> None:
    config = load("grpo_tiny_cpu", "+rewards.rule.world_size=2", "rl_config.verifier_function=[arith_acc,step]",
                  "rl_config.verifier_weight=[1.0,0.5]")
    group = RewardWorkerGroup.from_config(config)
    assert group is not None and group.num_workers == 2 and group.key == "rewards.rule"
    try:
        responses, labels = _batch(37)
        rewards, failed = group.score(responses, labels)
        expected = compute_rule_rewards(responses, labels, ["arith_acc", "step"], [1.0, 0.5])
        assert failed == 0
        assert torch.equal(rewards.total, expected.total)
        assert rewards.per_verifier.keys() == expected.per_verifier.keys()
        for name, scores in expected.per_verifier.items():
            assert torch.equal(rewards.per_verifier[name], scores)
        assert len(set(group.pids())) == 2  # two processes
    finally:
        group.kill()
    assert RewardWorkerGroup.from_config(load("grpo_tiny_cpu", "+rewards.rule.world_size=0")) is None
    assert RewardWorkerGroup.from_config(load("grpo_tiny_cpu")) is None


def test_a_verifier_that_raises_or_hangs_scores_zero_for_that_sample_counted(capsys) -> None:
    group = RewardWorkerGroup(name="rule", num_workers=2, verifier_functions=["arith_acc", "picky"],
                              verifier_weights=[1.0, 1.0], timeout_seconds=LIMIT,
                              verifiers={"arith_acc": arith_acc, "picky": picky}, margin_seconds=5.0)
    try:
        group.wait_ready()
        responses, labels = ["3", "boom", "4", "hang", "1", "2"], ["3", "0", "1", "0", "1", "2"]
        started = time.monotonic()
        rewards, failed = group.score(responses, labels)
        elapsed = time.monotonic() - started
        assert failed == 2
        assert rewards.per_verifier["picky"].tolist() == [1.0, 0.0, 1.0, 0.0, 1.0, 1.0]
        # The other verifier still scores the failed samples; its scores are the driver's.
        assert torch.equal(rewards.per_verifier["arith_acc"],
                           compute_rule_rewards(responses, labels, ["arith_acc"], [1.0]).total)
        assert rewards.total.tolist() == pytest.approx([2.0, 0.0, 1.2, 0.0, 2.0, 2.0])
        assert elapsed < 10, elapsed  # one limit for the hang, not the verifier's 60 s
        out = capsys.readouterr().out
        assert "2 of 6 sample(s) scored 0" in out
        assert "picky raised ValueError: boom" in out and f"picky gave no answer within {LIMIT:g} s" in out
        # The worker left running the hung verifier's thread is replaced; the next batch is clean.
        assert group.replaced == 1
        rewards, failed = group.score(["3", "4"], ["3", "4"])
        assert failed == 0 and rewards.total.tolist() == [2.0, 2.0]
    finally:
        group.kill()


def test_a_hung_or_dead_worker_scores_zero_for_what_it_had_not_answered_and_is_replaced(capsys) -> None:
    group = RewardWorkerGroup(name="rule", num_workers=2, verifier_functions=["arith_acc"], verifier_weights=[1.0],
                              timeout_seconds=LIMIT, verifiers={"arith_acc": self_destructive},
                              samples_per_call=1, margin_seconds=3.0)
    try:
        group.wait_ready()
        old_pids = group.pids()
        # Worker 0 scores samples 0-3 and stops at sample 1; worker 1 scores 4-7 and dies at sample 5.
        responses = ["1", "freeze", "3", "4", "5", "crash", "7", "8"]
        labels = ["1", "2", "3", "4", "5", "6", "7", "0"]
        started = time.monotonic()
        rewards, failed = group.score(responses, labels)
        elapsed = time.monotonic() - started
        assert rewards.total.tolist() == [1.0, 0.0, 0.0, 0.0, 1.0, 0.0, 0.0, 0.0]
        assert failed == 6  # 1-3 after the hang, 5-7 after the crash; 7 would have scored 1, it is counted
        assert elapsed < LIMIT + 3.0 + 8.0, elapsed  # the limit + the margin, plus a busy host
        out = capsys.readouterr().out
        assert "6 of 8 sample(s) scored 0" in out
        # The crashed worker is reported as died, or, when its call's deadline comes first on a busy host,
        # as not answering: either way its samples score 0 and are counted above.
        assert "gave no answer within" in out
        # Both were replaced: the stopped one killed, not left behind; the next batch is whole.
        assert group.replaced == 2
        group.wait_ready()
        assert not set(group.pids()) & set(old_pids)
        time.sleep(1.0)
        assert not any(os.path.exists(f"/proc/{pid}") and _state(pid) != "Z" for pid in old_pids)
        responses = ["1", "2", "3", "4", "5", "6", "7", "8"]
        rewards, failed = group.score(responses, labels)
        assert failed == 0 and rewards.total.tolist() == pytest.approx([1.0] * 7 + [0.2])
    finally:
        group.kill()


def _state(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return "gone"


def test_a_worker_that_cannot_start_stops_the_run_with_the_reason() -> None:
    def unloadable(response: str, label: str) -> float:
        return 1.0

    # A verifier whose module the workers cannot import (pickled by reference to a module that only
    # exists here).
    unloadable.__module__ = "module_only_in_the_driver"
    sys.modules["module_only_in_the_driver"] = type(sys)("module_only_in_the_driver")
    sys.modules["module_only_in_the_driver"].unloadable = unloadable
    unloadable.__qualname__ = "unloadable"
    group = RewardWorkerGroup(name="rule", num_workers=1, verifier_functions=["u"], verifier_weights=[1.0],
                              timeout_seconds=LIMIT, verifiers={"u": unloadable})
    try:
        with pytest.raises(WorkerFailure, match="reward worker of rewards.rule could not start: .*module_only_in_the_driver"):
            group.score(["1"], ["1"])
    finally:
        group.kill()
        del sys.modules["module_only_in_the_driver"]


def test_unknown_verifier_is_refused_before_any_worker_starts() -> None:
    with pytest.raises(ValueError, match="unknown verifiers"):
        RewardWorkerGroup(name="rule", num_workers=1, verifier_functions=["nope"], verifier_weights=[1.0],
                          timeout_seconds=1.0)
    assert "arith_acc" in VERIFIERS
