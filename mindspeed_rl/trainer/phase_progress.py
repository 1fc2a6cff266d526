"""Progress while the driver waits: a phase that runs longer than `runtime.progress_seconds` prints
`[progress] iteration 3, generate: 20 s so far`, again every that many seconds, so a long generate or update is not
mistaken for a hang (the watchdog's deadlines are minutes; an iteration at 32k tokens can be too).

One mechanism for every step: the actor group is wrapped once, and each call the driver blocks on (and the
wait for a rollout) is timed under the name its RPC declares (`@phase_rpc(..., progress=...)`). The lines come from a daemon thread, so they also appear
while a single-rank run computes in this process (torch and vLLM release the GIL between kernels).
"""
from __future__ import annotations

import contextlib
import threading
import time
from typing import Any, Callable, Iterator

class PhaseClock:
    """The phase the driver is waiting on, and a thread that reports it once it has run `every_seconds`."""

    def __init__(self, *, every_seconds: float, iteration: Callable[[], int], print_line: Callable[[str], None]):
        self.every_seconds, self._iteration, self._print_line = every_seconds, iteration, print_line
        self._lock = threading.Lock()
        self._phase: str | None = None
        self._started = 0.0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        if every_seconds > 0:
            self._thread = threading.Thread(target=self._watch, name="phase-progress", daemon=True)
            self._thread.start()

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        with self._lock:
            outer = self._phase  # a wait inside another (a save's RPCs) is reported as the outer phase
            if outer is None:
                self._phase, self._started = name, time.monotonic()
        try:
            yield
        finally:
            if outer is None:
                with self._lock:
                    self._phase = None

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)

    def _watch(self) -> None:
        reported: tuple[str, float] | None = None  # the (phase, start) the lines so far were about
        lines = 0
        poll_seconds = min(1.0, self.every_seconds / 4)
        while not self._stop.wait(poll_seconds):
            with self._lock:
                phase, started = self._phase, self._started
            if phase is None:
                continue
            if reported != (phase, started):
                reported, lines = (phase, started), 0
            elapsed = time.monotonic() - started
            if elapsed >= (lines + 1) * self.every_seconds:
                lines += 1
                self._print_line(f"[progress] iteration {self._iteration()}, {phase}: {elapsed:.0f} s so far")


class ProgressReportingGroup:
    """The actor group, each blocking call and each rollout wait timed by a `PhaseClock`; every other
    attribute is the wrapped group's."""

    def __init__(self, group: Any, clock: PhaseClock):
        self._group, self._clock = group, clock

    def call(self, method: str, *args: Any, blocking: bool = True, **kwargs: Any) -> list[Any]:
        if not blocking:
            return self._group.call(method, *args, blocking=False, **kwargs)
        with self._clock.phase(self._name(method)):
            return self._group.call(method, *args, **kwargs)

    def _name(self, method: str) -> str:
        """What the console calls the RPC: its declaration's `progress` name (workers/parts/), else the method's."""
        declared = self._group.declared(method) if hasattr(self._group, "declared") else None
        return getattr(declared, "progress", None) or method

    def start_generate(self, *args: Any, **kwargs: Any) -> Any:
        # A one-rank run in this process generates here (its finish only hands the result over); a Ray group
        # returns at once.
        with self._clock.phase("generate"):
            return self._group.start_generate(*args, **kwargs)

    def finish_generate(self) -> list[Any]:
        with self._clock.phase("generate"):
            return self._group.finish_generate()

    def start_score(self, prompt_token_ids: list[list[int]], response_token_ids: list[list[int]]) -> None:
        # As start_generate: a group that re-scores in this process does it here.
        with self._clock.phase(self._name("score_sequences")):
            self._group.start_score(prompt_token_ids, response_token_ids)

    def finish_score(self) -> list[Any]:
        with self._clock.phase(self._name("score_sequences")):
            return self._group.finish_score()

    def stop_reporting(self) -> None:
        self._clock.close()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._group, name)


def console_clock(*, every_seconds: float, iteration: Callable[[], int]) -> PhaseClock:
    """The run's clock, its lines on the console."""
    return PhaseClock(every_seconds=every_seconds, iteration=iteration, print_line=lambda line: print(line, flush=True))
