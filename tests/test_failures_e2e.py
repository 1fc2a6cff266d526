"""End to end: how a run ends when it does not finish (README "When a run fails").

Each test launches `python cli/train_grpo.py` in its own session, as a terminal would, with a fault
injected at a known point (`MINDSPEED_RL_INJECT_FAULT`, mindspeed_rl/workers/fault_injection.py) or
a signal sent in a known phase, and checks the exit code, the one line the user reads, the time it
took, and that no process of the run's session and no new /dev/shm segment is left.

Runs where (`make test-failures`, which .ci/run calls): subprocesses: a one-rank run's rank in the CLI's own process
(no Ray; the cases marked `ray` set runtime.local_single_rank=false), the 2-rank runs Ray and 2 worker processes;
~4 min in all on 2 cores.
"""
import signal
import time

import pytest

from run_watch import launch, leftovers, shm_entries

pytestmark = pytest.mark.failures  # `make test-failures`, beside `make test`'s 25-minute budget

ONE_RANK = "grpo_tiny_cpu"
# The one-rank run through Ray (a separate rank process), as runs with more ranks go.
THROUGH_RAY = "runtime.local_single_rank=false"
IN_PROCESS_LINE = "[init] one rank: running it in this process"
# Train PP2 -> vLLM TP2 on 2 ranks: vLLM's TP group shares a broadcast buffer in /dev/shm.
TWO_RANKS = "grpo_tiny_cpu_pp2_infer_tp2"


def _start(tmp_path, config_name: str, *overrides: str, fault: str | None = None):
    # The workers write the fault's moment to a file: their forwarded output may reach the driver after it exits.
    env = {"MINDSPEED_RL_INJECT_FAULT": fault, "MINDSPEED_RL_INJECT_FAULT_LOG": str(tmp_path / "faults.log")} \
        if fault else {}
    return launch(tmp_path, config_name, "megatron_training.train_iters=2",
                  *overrides, env=env)


def _run_into_fault(tmp_path, config_name: str, fault: str, marker: str, *overrides: str):
    """(the run, its exit code, seconds from the fault to the exit, /dev/shm before the run)."""
    shm_before = shm_entries()
    run = _start(tmp_path, config_name, *overrides, fault=fault)
    fault_seen = run.wait_for_file_line(tmp_path / "faults.log", marker)
    code, ended = run.finish()
    return run, code, ended - fault_seen, shm_before


def _last_line(run) -> str:
    lines = [line for line in run.stderr_text().splitlines() if line.strip()]
    return lines[-1] if lines else ""


def _assert_nothing_left(run, shm_before: set[str]) -> None:
    processes, shm = leftovers(run, shm_before)
    assert not processes, f"processes of the run still alive: {processes}"
    assert not shm, f"/dev/shm segments left: {shm}"


def test_a_worker_that_raises_stops_the_run_naming_rank_host_and_error(tmp_path):
    # In process; a raising Ray worker's line is built by the same describe step (test_supervision), and the
    # Ray path's teardown after a failure is what the 2-rank cases below check.
    run, code, seconds, shm_before = _run_into_fault(tmp_path, ONE_RANK, "update:0:1:raise",
                                                     "[fault] rank 0: raise in update")
    assert code == 1
    assert IN_PROCESS_LINE in run.stdout_text()
    line = _last_line(run)
    assert line.startswith("worker failure during iteration 1: rank 0 (host "), line
    assert "failed in update: RuntimeError: injected fault in update on rank 0 (at fault_injection.py:" in line
    assert run.stderr_text().count("injected fault") == 1, "the error is reported once"
    assert "Traceback" not in run.stderr_text()
    assert seconds < 60
    _assert_nothing_left(run, shm_before)


def test_a_hung_in_process_rank_ends_the_run_at_the_rpc_deadline(tmp_path):
    """The one rank runs in the driver: a watchdog thread ends the process once the call's deadline passes."""
    run, code, seconds, shm_before = _run_into_fault(tmp_path, ONE_RANK, "update:0:1:sleep",
                                                     "[fault] rank 0: sleep in update", "runtime.rpc_timeout_seconds=10")
    assert code == 1
    assert IN_PROCESS_LINE in run.stdout_text()
    line = _last_line(run)
    assert line.startswith("worker failure during iteration 1: rank 0 (host "), line
    assert ("stopped responding in update: it did not finish within 10 s (runtime.rpc_timeout_seconds, or 4x the "
            "slowest earlier update); it was at fault_injection.py:") in line, line
    assert line.endswith("; last checkpoint: none (actor_config.save is not set)"), line
    assert "Traceback" not in run.stderr_text()
    assert 10 <= seconds < 10 + 10
    _assert_nothing_left(run, shm_before)


def test_a_sigkilled_worker_stops_both_ranks_and_its_shm_segments_are_removed(tmp_path):
    run, code, seconds, shm_before = _run_into_fault(tmp_path, TWO_RANKS, "generate_sequences:0:1:kill",
                                                     "[fault] rank 0: kill in generate_sequences")
    assert code == 1
    assert "rank 0 (host " in _last_line(run) and "died" in _last_line(run), _last_line(run)
    assert seconds < 60
    _assert_nothing_left(run, shm_before)


def test_a_stopped_rank_is_named_once_its_heartbeat_stops_whatever_the_rpc_deadline(tmp_path):
    # The RPC deadline stays at its default (30 min): the heartbeat names the frozen rank (a rank that beats but
    # never finishes meets the deadline instead: test_supervision).
    run, code, seconds, shm_before = _run_into_fault(tmp_path, TWO_RANKS, "update:1:1:stop",
                                                     "[fault] rank 1: stop in update",
                                                     "runtime.heartbeat_timeout_seconds=5")
    assert code == 1
    line = _last_line(run)
    assert "rank 1 (host " in line and "stopped responding in update (no heartbeat for 5 s" in line, line
    assert "ranks [0] were waiting for it" in line
    # The heartbeat timeout, then the teardown.
    assert 5 <= seconds < 5 + 15
    _assert_nothing_left(run, shm_before)


def test_a_killed_inference_rank_of_a_disaggregated_run_is_named_and_both_groups_end(tmp_path):
    """Disaggregated: the inference rank dies as its second rollout starts, which would first receive the second push;
    the training rank, blocked sending to it over the bridge, is not blamed, and nothing of either group is left."""
    run, code, seconds, shm_before = _run_into_fault(tmp_path, "grpo_tiny_cpu_disaggregated",
                                                     "actor_infer/generate_sequences:0:2:kill",
                                                     "[fault] rank 0: kill in generate_sequences")
    assert code == 1
    line = _last_line(run)
    assert line.startswith("worker failure during iteration 2:"), line
    assert "actor_infer rank 0 (host " in line and "died" in line, line
    assert seconds < 60
    _assert_nothing_left(run, shm_before)


PHASES = {
    # phase: (fault that holds a rank there, the line that says it is there)
    "initialize": (None, "[init] rank 0 (host"),
    "generate": ("generate_sequences:0:1:sleep", "[fault] rank 0: sleep in generate_sequences"),
    "update": ("update:0:2:sleep", "[fault] rank 0: sleep in update"),
}


STOP_CASES = [
    # Each phase once, each signal in some: the two signals take the same path (interrupts.py) in every phase.
    *[pytest.param(False, signum, phase, id=f"in_process-{signum.name}-{phase}")
      for signum, phase in ((signal.SIGTERM, "initialize"), (signal.SIGINT, "generate"))],
    # The Ray path (update, the phase the in-process cases leave out): Ray's daemons and the rank process get the
    # Ctrl-C too.
    pytest.param(True, signal.SIGINT, "update", id="ray-SIGINT-update"),
]


@pytest.mark.parametrize("through_ray,signum,phase", STOP_CASES)
def test_a_stop_signal_ends_the_run_within_15_s_leaving_nothing(tmp_path, phase, signum, through_ray):
    fault, marker = PHASES[phase]
    shm_before = shm_entries()
    save = tmp_path / "save"
    run = _start(tmp_path, ONE_RANK, f"actor_config.save={save}", "megatron_training.save_interval=1",
                 *((THROUGH_RAY,) if through_ray else ()), fault=fault)
    if fault:
        run.wait_for_file_line(tmp_path / "faults.log", marker)
    else:
        run.wait_for(marker)
    sent = time.monotonic()
    if signum == signal.SIGINT:
        run.signal_group(signum)  # Ctrl-C: the whole foreground group, Ray's daemons and workers too
    else:
        run.process.send_signal(signum)  # `kill PID`, a scheduler's stop: the driver alone
    code, ended = run.finish()
    assert code == 128 + signum
    assert ended - sent < 15
    name = signal.Signals(signum).name
    where = {"initialize": "during initialize", "generate": "at iteration 1", "update": "at iteration 2"}[phase]
    checkpoint = str(save / "iter_0000001") if phase == "update" else "none"
    assert _last_line(run) == f"interrupted by {name} {where}; last checkpoint: {checkpoint}"
    assert "Traceback" not in run.stderr_text()
    # A save in progress is never left behind as a directory that looks like a checkpoint.
    assert not list(save.glob(".tmp_*")) if save.exists() else True
    _assert_nothing_left(run, shm_before)
