"""A run that restarts itself (`runtime.max_restarts`): after a worker failure (a rank that raised, died or froze, a
node lost) the ranks are torn down and started again from the newest intact checkpoint this run saved (before its
first save: where it started), so the iterations after a restart are those of a run never interrupted.

What makes them equal is kept in the checkpoint, not here: the sampler's position, the KL controller, the rng
streams, the rollout started ahead (trainer/rollouts.Rollouts); every sampling stream is seeded by (iteration,
refill), so dynamic sampling's refills and multi-turn tool calls regenerate as they were. Here: whether to restart,
the one line per restart, and the wait for a cluster that lost a node.
"""
from __future__ import annotations

import copy
import dataclasses
import re
import time

from mindspeed_rl.errors import ConfigError
from mindspeed_rl.trainer.stopping import WORKER_FAILURE_EXIT_CODE, RunProgress, RunStopped
from mindspeed_rl.memory.capacity import failure_phase_and_detail
from mindspeed_rl.workers.supervision import WorkerFailure

# Process ids, ports and Ray's ids differ between two failures that are the same failure.
_VOLATILE = re.compile(r"\b(pid|port) \d+|\b[0-9a-f]{16,}\b")
CLUSTER_POLL_SECONDS = 1.0


def failure_signature(failure: WorkerFailure, progress: RunProgress) -> tuple[int, str, str]:
    """(iteration, phase, the failure line without process ids): what "failed the same way" compares."""
    return progress.iteration, progress.phase if not progress.iteration else "", _VOLATILE.sub(r"\1 _", str(failure))


class Restarts:
    """How many restarts are left, and the failure each one followed."""

    def __init__(self, *, max_restarts: int, restart_wait_seconds: float):
        self.max_restarts, self.restart_wait_seconds = max_restarts, restart_wait_seconds
        self.count = 0
        self.failed_at: float | None = None  # monotonic, of the last failure: the restart's seconds are counted from it
        self.cause = ""  # the last failure's line
        self._last: tuple[int, str, str] | None = None

    def after(self, failure: WorkerFailure, progress: RunProgress) -> None:
        """Count a restart after `failure`, or end the run: none left (as without restarts), or the same failure
        at the same iteration as the one before the last restart (a restart would only repeat it)."""
        signature = failure_signature(failure, progress)
        if self.max_restarts and failure_phase_and_detail(str(failure)) is not None:
            print("[restart] not restarting: the same layout runs out of device memory again", flush=True)
            raise failure
        if self.count and signature == self._last:
            raise RunStopped(WORKER_FAILURE_EXIT_CODE, f"{progress.worker_failure_line(failure)}; it failed the same "
                                                       f"way before restart {self.count}, at the same point: not "
                                                       "restarting again")
        if self.count >= self.max_restarts:
            if self.max_restarts:
                print(f"[restart] none left: all {self.max_restarts} of runtime.max_restarts used", flush=True)
            raise failure
        self.count, self._last, self.failed_at = self.count + 1, signature, time.monotonic()
        self.cause = progress.worker_failure_line(failure)
        progress.restarts = self.count

    def restart_line(self, start_iteration: int, resume_from: str) -> str:
        """The one line of a restart: its number, the failure, where it resumes."""
        return (f"[restart] {self.count} of {self.max_restarts} after {self.cause}; resuming from iteration "
                f"{start_iteration} ({resume_from})")

    def config_for_restart(self, config):
        """The run's config with Ray's placement waiting up to restart_wait_seconds (a node may be coming back)."""
        restarted = copy.copy(config)
        restarted.runtime = dataclasses.replace(
            config.runtime, placement_timeout_seconds=max(config.runtime.placement_timeout_seconds,
                                                          self.restart_wait_seconds))
        return restarted

    def resumed_line(self, iteration: int) -> str:
        seconds = time.monotonic() - self.failed_at if self.failed_at is not None else 0.0
        return f"[restart] {self.count}: resuming at iteration {iteration}, {seconds:.1f} s after the failure"


def wait_for_cluster(check, *, seconds: float, what: str) -> None:
    """Run `check` (raises ConfigError while the cluster is short) until it passes or `seconds` have gone; the
    last shortfall then ends the run (a restart that found no room is a failure of the run, not of its config)."""
    deadline, said = time.monotonic() + seconds, False
    while True:
        try:
            check()
            return
        except ConfigError as error:
            if time.monotonic() >= deadline:
                raise RunStopped(WORKER_FAILURE_EXIT_CODE, f"restart failed: {what} did not come back within "
                                                           f"runtime.restart_wait_seconds={seconds:g}: "
                                                           f"{error}") from None
            if not said:
                print(f"[restart] waiting up to {seconds:g} s for {what}: {error}", flush=True)
                said = True
        time.sleep(CLUSTER_POLL_SECONDS)
