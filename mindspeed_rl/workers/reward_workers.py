"""CPU reward workers: `rewards.<name>.world_size: N` Ray actors that score a batch with the rule verifiers
of `rl_config.verifier_function` in parallel (ROLL's CPU-only role; MindSpeed-RL's `RuleReward` actors).

What may fail, and what happens then (the step never waits longer than the limits below):

* A verifier that raises on a sample: that sample's score from that verifier is 0, counted.
* A verifier that does not answer within `rl_config.verifier_timeout_seconds` (the per-sample limit the
  in-process path gives math-verify): 0, counted. Each call runs in a helper thread of the actor and
  the actor stops waiting for it at the limit; Python cannot stop a thread, so a worker left with a
  thread still running is replaced by a fresh actor after the step.
* A worker that cannot be built (a verifier that does not unpickle in it) stops the run (WorkerFailure):
  scoring every step 0 would hide it.
* A whole worker that dies (crash, OOM kill) or hangs (stuck in C code that holds the GIL, stopped):
  the driver sends each worker its samples a few at a time and gives every call
  ``samples x verifiers x limit + margin`` seconds; a call past that, or a dead worker, scores 0 for
  every sample it had not answered, counted, and the worker is killed and replaced.

Every failed sample is counted once in `reward_workers/failed_samples` and named in a warning line.
Scores of the samples that did not fail equal the in-process `compute_rule_rewards` bit for bit (the
same verifiers, combined by the same `combine_verifier_scores`).
"""
from __future__ import annotations

import collections
import concurrent.futures
import contextlib
import logging
import os
import queue
import signal
import socket
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import ray

from mindspeed_rl import interrupts
from mindspeed_rl.data.rewards import VERIFIERS, RuleRewards, combine_verifier_scores
from mindspeed_rl.workers.supervision import WorkerFailure

Verifier = Callable[[str, str], float]

DEFAULT_SAMPLES_PER_CALL = 4
# Beyond the verifiers' own limits: Ray's round trip and a busy host's scheduling.
DEFAULT_MARGIN_SECONDS = 10.0
# A fresh worker's first answer: process start and the verifiers' imports (math-verify, sympy).
DEFAULT_STARTUP_SECONDS = 120.0
_WAIT_SLICE_SECONDS = 0.2
_REASONS_SHOWN = 3


# --- inside a worker -------------------------------------------------------------------------------


class _CallThread:
    """A daemon thread that runs one call at a time, handed over through its inbox."""

    def __init__(self) -> None:
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        threading.Thread(target=self._loop, name="verifier", daemon=True).start()

    def _loop(self) -> None:
        while True:
            item = self._inbox.get()
            if item is None:
                return
            fn, args, future = item
            try:
                future.set_result(fn(*args))
            except BaseException as error:  # noqa: BLE001 - every failure of a verifier is the sample's
                future.set_exception(error)

    def submit(self, fn: Callable, args: tuple) -> concurrent.futures.Future:
        future: concurrent.futures.Future = concurrent.futures.Future()
        self._inbox.put((fn, args, future))
        return future

    def retire(self) -> None:
        """The thread ends once its current call returns (if it ever does)."""
        self._inbox.put(None)


class _TimedOut(Exception):
    pass


class _Runner:
    """Runs calls in a helper thread with a time limit; a call past it is abandoned with its thread."""

    def __init__(self) -> None:
        self._thread: Optional[_CallThread] = None
        self.abandoned = 0

    def run(self, fn: Callable, args: tuple, timeout_seconds: float) -> Any:
        if self._thread is None:
            self._thread = _CallThread()
        future = self._thread.submit(fn, args)
        done, _ = concurrent.futures.wait([future], timeout=timeout_seconds)
        if not done:
            self._thread.retire()
            self._thread = None
            self.abandoned += 1
            raise _TimedOut
        return future.result()  # the verifier's value, or its exception


class RewardWorker:
    """One CPU worker: scores (response, label) pairs with the verifiers it was given."""

    def __init__(self, verifiers: dict[str, Verifier], timeout_seconds: float) -> None:
        self._verifiers = verifiers
        self._timeout = timeout_seconds
        self._runner = _Runner()
        # math-verify's own signal-based limit cannot run in a helper thread and says so once; here the
        # runner's limit bounds every call instead, so that warning would be wrong.
        logging.getLogger("mindspeed_rl.data.math_answers").setLevel(logging.ERROR)

    def ping(self) -> tuple[str, int]:
        return socket.gethostname(), os.getpid()

    def score(self, responses: list[str], labels: list[str], names: list[str]) -> dict:
        """Each named verifier's score per sample; a failure scores 0 and is listed as (index, name, reason)."""
        scores = {name: [0.0] * len(responses) for name in names}
        failures: list[tuple[int, str, str]] = []
        for index, (response, label) in enumerate(zip(responses, labels)):
            for name in names:
                try:
                    scores[name][index] = float(self._runner.run(self._verifiers[name], (response, label),
                                                                 self._timeout))
                except _TimedOut:
                    failures.append((index, name, f"gave no answer within {self._timeout:g} s"))
                except BaseException as error:  # noqa: BLE001 - raised by the verifier, in its thread
                    failures.append((index, name, f"raised {type(error).__name__}: {str(error)[:200]}"))
        return {"scores": scores, "failures": failures, "abandoned": self._runner.abandoned}


_RemoteRewardWorker = ray.remote(RewardWorker)


# --- the driver's side -----------------------------------------------------------------------------


@dataclass
class _Call:
    ref: Any
    start: int           # first sample of the batch it scores; -1 for a ping
    end: int
    budget_seconds: float


@dataclass
class _Slot:
    handle: Any
    created: float
    ping_ref: Any
    host: str = ""
    pid: int = 0
    ready: bool = False
    replace: bool = False
    calls: collections.deque = field(default_factory=collections.deque)
    clock: float = 0.0

    def describe(self) -> str:
        return f"pid {self.pid} on {self.host}" if self.pid else "(not started)"


def cpu_reward_section(config) -> Optional[tuple[str, Any]]:
    """(name, section) of the `rewards.<name>` section that asks for CPU rule workers (world_size > 0;
    a reward model's ranks are the actor's), or None: scoring then runs in the driver."""
    for name, section in config.rewards.items():
        if section.world_size and not section.is_model:
            return name, section
    return None


class RewardWorkerGroup:
    """`num_workers` CPU Ray actors scoring a batch in parallel; see the module doc for failures."""

    def __init__(self, *, name: str, num_workers: int, verifier_functions: list[str], verifier_weights: list[float],
                 timeout_seconds: float, verifiers: Optional[dict[str, Verifier]] = None,
                 samples_per_call: int = DEFAULT_SAMPLES_PER_CALL, margin_seconds: float = DEFAULT_MARGIN_SECONDS,
                 startup_seconds: float = DEFAULT_STARTUP_SECONDS, num_cpus_per_worker: float = 0.0) -> None:
        if num_workers < 1:
            raise ValueError(f"num_workers must be >= 1, got {num_workers}")
        if len(verifier_functions) != len(verifier_weights) or not verifier_functions:
            raise ValueError(f"one weight per verifier: {verifier_functions} / {verifier_weights}")
        registry = VERIFIERS if verifiers is None else verifiers
        unknown = [n for n in verifier_functions if n not in registry]
        if unknown:
            raise ValueError(f"unknown verifiers {unknown}; registered: {sorted(registry)}")
        self.key = f"rewards.{name}"
        self.verifier_functions, self.verifier_weights = list(verifier_functions), list(verifier_weights)
        self._names = list(dict.fromkeys(verifier_functions))
        self._verifiers = {n: registry[n] for n in self._names}
        self.timeout_seconds = timeout_seconds
        self.samples_per_call, self.margin_seconds = samples_per_call, margin_seconds
        self.startup_seconds, self.num_cpus_per_worker = startup_seconds, num_cpus_per_worker
        self.replaced = 0
        with interrupts.shielded():
            self._slots = [self._start() for _ in range(num_workers)]

    @classmethod
    def from_config(cls, config) -> Optional["RewardWorkerGroup"]:
        """The group of the config's `rewards.<name>` section with world_size > 0, or None (score in the
        driver). The config allows one reward role (config/resources.py)."""
        rl = config.rl_config
        found = cpu_reward_section(config)
        if found is None:
            return None
        name, section = found
        return cls(name=name, num_workers=section.world_size, verifier_functions=rl.verifier_function,
                   verifier_weights=rl.verifier_weight, timeout_seconds=rl.verifier_timeout_seconds)

    @property
    def num_workers(self) -> int:
        return len(self._slots)

    def _start(self) -> _Slot:
        handle = _RemoteRewardWorker.options(num_cpus=self.num_cpus_per_worker, max_restarts=0).remote(
            self._verifiers, self.timeout_seconds)
        return _Slot(handle=handle, created=time.monotonic(), ping_ref=handle.ping.remote())

    def wait_ready(self) -> None:
        """Block until every worker answers (each within the startup allowance, else it is replaced)."""
        self._run_calls()
        self._replace_marked()

    # -- scoring ------------------------------------------------------------------------------------
    def score(self, responses: list[str], labels: list[str]) -> tuple[RuleRewards, int]:
        """The batch's RuleRewards and how many samples failed (scored 0 by at least one verifier)."""
        if len(responses) != len(labels):
            raise ValueError(f"{len(responses)} responses but {len(labels)} labels")
        self._scores = {name: [0.0] * len(responses) for name in self._names}
        self._failed: dict[int, str] = {}
        self._responses, self._labels = responses, labels
        per_call_seconds = self.timeout_seconds * len(self._names)
        with interrupts.shielded():
            for slot, (start, end) in zip(self._slots, _split(len(responses), len(self._slots))):
                for first in range(start, end, self.samples_per_call):
                    last = min(first + self.samples_per_call, end)
                    ref = slot.handle.score.remote(responses[first:last], labels[first:last], self._names)
                    slot.calls.append(_Call(ref=ref, start=first, end=last,
                                            budget_seconds=(last - first) * per_call_seconds + self.margin_seconds))
        self._run_calls()
        self._replace_marked()
        failed = self._failed
        if failed:
            shown = "; ".join(f"sample {i}: {reason}" for i, reason in sorted(failed.items())[:_REASONS_SHOWN])
            more = f"; {len(failed) - _REASONS_SHOWN} more" if len(failed) > _REASONS_SHOWN else ""
            print(f"[reward] warning: {len(failed)} of {len(responses)} sample(s) scored 0 by a failed verifier or "
                  f"worker ({self.key}): {shown}{more}", flush=True)
        rewards = combine_verifier_scores(self._scores, self.verifier_functions, self.verifier_weights)
        return rewards, len(failed)

    def _run_calls(self) -> None:
        now = time.monotonic()
        for slot in self._slots:
            if not slot.ready:
                slot.calls.appendleft(_Call(ref=slot.ping_ref, start=-1, end=-1, budget_seconds=self.startup_seconds))
                slot.clock = slot.created
            else:
                slot.clock = now
        while True:
            heads = {slot.calls[0].ref: slot for slot in self._slots if slot.calls}
            if not heads:
                return
            with interrupts.shielded():
                ready, _ = ray.wait(list(heads), num_returns=1, timeout=_WAIT_SLICE_SECONDS)
            for ref in ready:
                slot = heads[ref]
                call = slot.calls.popleft()
                try:
                    with interrupts.shielded():
                        result = ray.get(ref)
                except ray.exceptions.RayError as error:
                    if getattr(error, "actor_init_failed", False):
                        # Not a failure of one sample: the worker cannot be built (a verifier that does not
                        # unpickle there, an import error). Scoring every step 0 would hide it.
                        raise WorkerFailure(f"reward worker of {self.key} could not start: {_last_line(error)}") \
                            from None
                    self._fail_slot(slot, call, f"reward worker {slot.describe()} died ({_last_line(error)})")
                    continue
                slot.clock = time.monotonic()
                self._take(slot, call, result)
            now = time.monotonic()
            for slot in self._slots:
                if slot.calls and now - slot.clock > slot.calls[0].budget_seconds:
                    call = slot.calls.popleft()
                    what = "did not start" if call.start < 0 else "gave no answer"
                    self._fail_slot(slot, call, f"reward worker {slot.describe()} {what} within "
                                                f"{call.budget_seconds:.0f} s")

    def _take(self, slot: _Slot, call: _Call, result: Any) -> None:
        if call.start < 0:
            slot.host, slot.pid = result
            slot.ready = True
            return
        for name, values in result["scores"].items():
            self._scores[name][call.start:call.end] = values
        for index, name, reason in result["failures"]:
            self._failed.setdefault(call.start + index, f"{name} {reason}")
        if result["abandoned"]:
            slot.replace = True  # a verifier thread is still running in it

    def _fail_slot(self, slot: _Slot, call: _Call, reason: str) -> None:
        """The worker is gone or hung: every sample it has not answered scores 0; it is replaced."""
        for pending in [call, *slot.calls]:
            for index in range(max(pending.start, 0), max(pending.end, 0)):
                for name in self._names:
                    self._scores[name][index] = 0.0
                self._failed.setdefault(index, reason)
        slot.calls.clear()
        slot.replace = True
        self._kill(slot)

    def _replace_marked(self) -> None:
        for index, slot in enumerate(self._slots):
            if slot.replace:
                self._kill(slot)
                with interrupts.shielded():
                    self._slots[index] = self._start()
                self.replaced += 1
                print(f"[reward] replaced reward worker {slot.describe()} ({self.key})", flush=True)

    # -- endings ------------------------------------------------------------------------------------
    def kill(self) -> None:
        """End every worker now, whatever it is doing."""
        for slot in self._slots:
            self._kill(slot)

    def pids(self) -> list[int]:
        return [slot.pid for slot in self._slots if slot.pid]

    @staticmethod
    def _kill(slot: _Slot) -> None:
        with contextlib.suppress(Exception):
            ray.kill(slot.handle, no_restart=True)
        # Ray's kill lets a process exit on its own first; a stopped or hung one never does.
        if slot.pid and slot.host == socket.gethostname():
            with contextlib.suppress(OSError):
                with open(f"/proc/{slot.pid}/cmdline", "rb") as cmdline:
                    is_ray_worker = cmdline.read().startswith(b"ray::")
                if is_ray_worker:
                    os.kill(slot.pid, signal.SIGKILL)


def _last_line(error: BaseException) -> str:
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    text = lines[-1] if lines else type(error).__name__
    return text if len(text) <= 200 else text[:197] + "..."


def _split(count: int, parts: int) -> list[tuple[int, int]]:
    """Contiguous, near-equal ranges of ``range(count)``, one per part."""
    base, extra = divmod(count, parts)
    bounds, start = [], 0
    for part in range(parts):
        end = start + base + (1 if part < extra else 0)
        bounds.append((start, end))
        start = end
    return bounds
