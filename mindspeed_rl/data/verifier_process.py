"""Rule verifiers behind a hard wall: they run in a child process that is killed and replaced when one sample
overruns, so no response can stall a step.

A time limit inside the verifier (math-verify's signal alarm) cannot stop a regular expression running in C,
a C extension or code that swallows the alarm; a process can always be killed. The child scores the items
(sample x verifier) in order and sends each score back as it finishes; the driver gives every item
``timeout_seconds`` + WALL_GRACE_SECONDS from the previous answer. An item past that is scored 0, the child
is killed and a fresh one (forked from a server that has the verifiers' imports loaded: milliseconds)
goes on with the next item. A verifier that raises, or runs out of the child's memory limit
(MEMORY_LIMIT_BYTES of address space), scores 0 for that item. Every such item is returned as a failure
that names the verifier, the sample and why.
"""
from __future__ import annotations

import atexit
import logging
import multiprocessing
import threading
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any, Callable, Optional

logger = logging.getLogger(__name__)

# Beyond the item's own limit: the pipe's round trip and a busy host's scheduling.
WALL_GRACE_SECONDS = 0.5
# A fresh child's first message (the fork server starts and imports math-verify and sympy once).
STARTUP_SECONDS = 120.0
# Address space of the child: a response of any size is scored within this, or scores 0.
MEMORY_LIMIT_BYTES = 8 << 30

Verifier = Callable[[str, str], float]


@dataclass(frozen=True)
class ItemFailure:
    sample: int
    verifier: str
    reason: str


def _serve(conn: Connection, memory_limit_bytes: int) -> None:
    """The child: score each job's items in order, one message per item. Ctrl-C reaches the whole process group:
    the driver decides what happens then (it stops the child), so the child ignores it; it ends when the driver's
    end of the pipe closes."""
    import resource
    import signal

    from mindspeed_rl.data.math_answers import sample_time_limit

    signal.signal(signal.SIGINT, signal.SIG_IGN)

    try:
        resource.setrlimit(resource.RLIMIT_AS, (memory_limit_bytes, resource.getrlimit(resource.RLIMIT_AS)[1]))
    except (ValueError, OSError):  # a lower hard limit already applies
        pass
    conn.send(("ready",))
    while (job := _next_job(conn)) is not None:
        verifiers, responses, labels, first_item, timeout_seconds = job
        with sample_time_limit(timeout_seconds):
            for item in range(first_item, len(responses) * len(verifiers)):
                sample, which = divmod(item, len(verifiers))
                try:
                    conn.send(("score", item, float(verifiers[which](responses[sample], labels[sample]))))
                except MemoryError:
                    conn.send(("failed", item, "ran out of the verifier process's memory limit"))
                except Exception as error:  # a verifier's bug on one output must not stop the step
                    conn.send(("failed", item, f"raised {type(error).__name__}: {str(error)[:200]}"))


def _next_job(conn: Connection) -> Optional[tuple]:
    try:
        return conn.recv()
    except (EOFError, OSError):  # the driver is gone
        return None


class VerifierProcess:
    """One child process at a time, replaced when an item overruns its wall or the child dies."""

    def __init__(self, *, memory_limit_bytes: int = MEMORY_LIMIT_BYTES) -> None:
        self._context = multiprocessing.get_context("forkserver")
        self._context.set_forkserver_preload(["mindspeed_rl.data.rewards"])
        self._memory_limit_bytes = memory_limit_bytes
        self._process: Optional[Any] = None
        self._conn: Optional[Connection] = None
        self._lock = threading.Lock()

    def start(self) -> None:
        """Start the child in the background: a run does it before its ranks start, so that the fork server's imports
        (math-verify, sympy) overlap theirs instead of delaying the first score, which takes the child once ready."""
        threading.Thread(target=self._start_locked, name="verifier-start", daemon=True).start()

    def _start_locked(self) -> None:
        with self._lock:
            try:
                self._ensure_child()
            except RuntimeError:
                pass  # the first score starts another and says why if that fails too

    def score(self, verifiers: dict[str, Verifier], responses: list[str], labels: list[str], *,
              timeout_seconds: float) -> tuple[dict[str, list[float]], list[ItemFailure]]:
        """Each verifier's score of every sample (0 for a failed item), and the failed items."""
        names, functions = list(verifiers), list(verifiers.values())
        scores = {name: [0.0] * len(responses) for name in names}
        failures: list[ItemFailure] = []
        total, item = len(responses) * len(names), 0
        with self._lock:
            while item < total:
                conn = self._ensure_child()
                conn.send((functions, responses, labels, item, timeout_seconds))
                item = self._collect(conn, names, scores, failures, item, total, timeout_seconds)
        return scores, failures

    def _collect(self, conn: Connection, names: list[str], scores: dict[str, list[float]],
                 failures: list[ItemFailure], item: int, total: int, timeout_seconds: float) -> int:
        """Read answers from `item` on; returns the next item to send (after a killed one) or `total`."""
        while item < total:
            sample, which = divmod(item, len(names))
            message = self._receive(conn, timeout_seconds + WALL_GRACE_SECONDS)
            if message is None:
                failures.append(ItemFailure(sample, names[which], f"ran past the per-sample wall of "
                                                                   f"{timeout_seconds + WALL_GRACE_SECONDS:g} s "
                                                                   f"(or its process died); replaced"))
                self._stop_child()
                return item + 1
            kind, answered, value = message
            assert answered == item, (answered, item)
            if kind == "score":
                scores[names[which]][sample] = value
            else:
                failures.append(ItemFailure(sample, names[which], value))
            item += 1
        return item

    def _receive(self, conn: Connection, seconds: float) -> Optional[tuple]:
        try:
            return conn.recv() if conn.poll(seconds) else None
        except (EOFError, OSError):  # the child died (killed by the OS, a crash in C)
            return None

    def _ensure_child(self) -> Connection:
        if self._process is not None and self._process.is_alive() and self._conn is not None:
            return self._conn
        self._stop_child()
        parent, child = self._context.Pipe()
        self._process = self._context.Process(target=_serve, args=(child, self._memory_limit_bytes),
                                              name="mindspeed-rl-verifier", daemon=True)
        self._process.start()
        child.close()
        if self._receive(parent, STARTUP_SECONDS) is None:
            self._stop_child()
            raise RuntimeError(f"the verifier process did not start within {STARTUP_SECONDS:g} s")
        self._conn = parent
        return parent

    def _stop_child(self) -> None:
        if self._process is not None:
            self._process.kill()
            self._process.join(timeout=10)
        if self._conn is not None:
            self._conn.close()
        self._process, self._conn = None, None

    def close(self) -> None:
        with self._lock:
            self._stop_child()


_shared: Optional[VerifierProcess] = None
_shared_lock = threading.Lock()


def shared_verifier_process() -> VerifierProcess:
    """This process's verifier child, started on first use and stopped at exit."""
    global _shared
    with _shared_lock:
        if _shared is None:
            _shared = VerifierProcess()
            atexit.register(_shared.close)
        return _shared
