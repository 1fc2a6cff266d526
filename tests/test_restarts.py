"""In process: the restart decisions of `runtime.max_restarts` (trainer/restarts.py): counted, ended when none are
left (the failure as without restarts), stopped when a failure repeats at the same point, and a cluster waited for.
The restarts themselves: tests/test_restarts_e2e.py (`make test-restarts`)."""
import sys
from pathlib import Path

import pytest

from mindspeed_rl.errors import ConfigError
from mindspeed_rl.trainer.restarts import Restarts, failure_signature, wait_for_cluster
from mindspeed_rl.trainer.stopping import RunProgress, RunStopped
from mindspeed_rl.workers.supervision import WorkerFailure

sys.path.insert(0, str(Path(__file__).resolve().parent))
from test_config import config_error, load  # noqa: E402

KILLED = "rank 1 (host h, pid {pid}) failed in update: the worker process died (killed, or crashed outside Python)"


def _progress(iteration: int) -> RunProgress:
    return RunProgress(save_root=None, iteration=iteration)


def test_two_failures_that_differ_only_in_process_ids_have_one_signature():
    first = failure_signature(WorkerFailure(KILLED.format(pid=101)), _progress(3))
    assert first == failure_signature(WorkerFailure(KILLED.format(pid=202)), _progress(3))
    assert first != failure_signature(WorkerFailure(KILLED.format(pid=202)), _progress(4))


def test_each_restart_is_counted_and_said_in_one_line():
    restarts, progress = Restarts(max_restarts=2, restart_wait_seconds=10), _progress(3)
    restarts.after(WorkerFailure(KILLED.format(pid=1)), progress)
    assert restarts.restart_line(1, "the initial weights") == (
        f"[restart] 1 of 2 after worker failure during iteration 3: {KILLED.format(pid=1)}; last checkpoint: none "
        "(actor_config.save is not set); resuming from iteration 1 (the initial weights)")
    progress.iteration = 5
    restarts.after(WorkerFailure(KILLED.format(pid=2)), progress)
    assert (restarts.count, progress.restarts) == (2, 2)
    assert restarts.restart_line(5, "SAVE/iter_0000004").startswith(
        "[restart] 2 of 2 after worker failure during iteration 5: ")


def test_no_restart_left_ends_the_run_with_the_failure_itself(capsys):
    restarts = Restarts(max_restarts=1, restart_wait_seconds=10)
    restarts.after(WorkerFailure(KILLED.format(pid=1)), _progress(3))
    last = WorkerFailure(KILLED.format(pid=2))
    with pytest.raises(WorkerFailure) as raised:
        restarts.after(last, _progress(5))
    assert raised.value is last  # the run ends with the line a run without restarts prints
    assert capsys.readouterr().out.splitlines()[-1] == "[restart] none left: all 1 of runtime.max_restarts used"
    with pytest.raises(WorkerFailure):
        Restarts(max_restarts=0, restart_wait_seconds=10).after(last, _progress(1))


def test_the_same_failure_at_the_same_iteration_after_a_restart_stops_the_run():
    restarts = Restarts(max_restarts=5, restart_wait_seconds=10)
    restarts.after(WorkerFailure(KILLED.format(pid=1)), _progress(3))
    with pytest.raises(RunStopped) as stopped:
        restarts.after(WorkerFailure(KILLED.format(pid=2)), _progress(3))
    assert stopped.value.exit_code == 1
    assert stopped.value.message.endswith("it failed the same way before restart 1, at the same point: not "
                                          "restarting again")


def test_a_restart_waits_for_the_cluster_and_gives_up_after_the_wait(monkeypatch, capsys):
    monkeypatch.setattr("mindspeed_rl.trainer.restarts.CLUSTER_POLL_SECONDS", 0.01)
    answers = iter([ConfigError("resources", "CPU: 2 needed, 1 in the cluster")] * 3 + [None])

    def check():
        answer = next(answers)
        if answer is not None:
            raise answer

    wait_for_cluster(check, seconds=5, what="the layout's CPUs")  # back at the fourth look
    assert capsys.readouterr().out.count("[restart] waiting up to 5 s for the layout's CPUs") == 1

    def short():
        raise ConfigError("resources", "CPU: 2 needed, 1 in the cluster")

    with pytest.raises(RunStopped, match="restart failed: the layout's CPUs did not come back within "
                                         "runtime.restart_wait_seconds=0.05: resources: CPU: 2 needed"):
        wait_for_cluster(short, seconds=0.05, what="the layout's CPUs")


def test_a_restart_places_its_ranks_with_the_restart_wait():
    config = load("grpo_tiny_cpu", "runtime.restart_wait_seconds=120")
    restarted = Restarts(max_restarts=1, restart_wait_seconds=120).config_for_restart(config)
    assert restarted.runtime.placement_timeout_seconds == 120
    assert config.runtime.placement_timeout_seconds == 60  # the run's own config is unchanged


def test_max_restarts_is_a_count_and_the_wait_positive():
    assert load("grpo_tiny_cpu").runtime.max_restarts == 0
    assert config_error("grpo_tiny_cpu", "runtime.max_restarts=-1") == "runtime.max_restarts: must be >= 0, got -1"
    assert config_error("grpo_tiny_cpu", "runtime.max_restarts=1.5") == \
        "runtime.max_restarts: expected int, got 1.5 (float)"
    assert config_error("grpo_tiny_cpu", "runtime.restart_wait_seconds=0") == \
        "runtime.restart_wait_seconds: must be > 0, got 0.0"
