"""Watching the worker ranks from the driver: a deadline per RPC, heartbeats, and one-line failures.

A rank that raises or dies ends the run with one line naming the rank, its host and pid, the RPC and
the worker's own error. A rank that stops making progress (a hang, a SIGSTOP) ends it once the RPC's
deadline passes; heartbeats tell a rank that stopped responding from ranks merely waiting for it in
a collective, so the message names the culprit.
"""
from __future__ import annotations

import re
import socket
import threading
import time
from dataclasses import dataclass

HEARTBEAT_SECONDS = 1.0
_HEARTBEAT_NAMESPACE = "mindspeed_rl"


class WorkerFailure(Exception):
    """A worker raised, died or hung; the message is one line for the user."""


@dataclass(frozen=True, kw_only=True)
class WorkerAddress:
    rank: int
    host: str
    pid: int
    ip: str = "127.0.0.1"  # the node's address (Ray's view): where rank 0 listens when ranks span nodes
    role: str = ""  # disaggregated: actor_train or actor_infer (each numbers its ranks from 0)

    def describe(self) -> str:
        return f"{self.role + ' ' if self.role else ''}rank {self.rank} (host {self.host}, pid {self.pid})"


def this_worker_address(rank: int, role: str = "") -> WorkerAddress:
    import os

    import ray

    return WorkerAddress(rank=rank, host=socket.gethostname(), pid=os.getpid(), ip=ray.util.get_node_ip_address(),
                         role=role)


class Deadlines:
    """How long one RPC may run: `rpc_timeout_seconds` (initialize: its own), or `slack` times the
    slowest earlier run of the same RPC if that is longer, so a phase whose normal length grows past
    the base (longer responses, a bigger model) is not taken for a hang."""

    def __init__(self, *, rpc_timeout_seconds: float, initialize_timeout_seconds: float, slack: float = 4.0):
        self.base = {"initialize": initialize_timeout_seconds}
        self.default = rpc_timeout_seconds
        self.slack = slack
        self.slowest: dict[str, float] = {}

    def seconds(self, method: str) -> float:
        return max(self.base.get(method, self.default), self.slack * self.slowest.get(method, 0.0))

    def observe(self, method: str, seconds: float) -> None:
        self.slowest[method] = max(self.slowest.get(method, 0.0), seconds)


def deadline_text(method: str, seconds: float) -> str:
    """The limit a hung `method` passed, and the key that sets it, for the failure line."""
    key = "initialize" if method == "initialize" else "rpc"
    return f"{seconds:.0f} s (runtime.{key}_timeout_seconds, or 4x the slowest earlier {method})"


# -- heartbeats ---------------------------------------------------------------------------------
def _heartbeat_key(run_key: str, rank: int) -> bytes:
    return f"{run_key}/heartbeat/{rank}".encode()


def start_heartbeat(run_key: str, rank: int, interval_seconds: float = HEARTBEAT_SECONDS) -> threading.Thread:
    """A daemon thread in the worker bumping a counter in Ray's GCS key-value store. It keeps beating
    while the main thread waits in a collective (the wait releases the GIL) and stops with the process
    (SIGSTOP, a deadlock holding the GIL)."""
    from ray.experimental import internal_kv

    def beat() -> None:
        count = 0
        while True:
            count += 1
            try:
                internal_kv._internal_kv_put(_heartbeat_key(run_key, rank), str(count).encode(), overwrite=True,
                                             namespace=_HEARTBEAT_NAMESPACE)
            except Exception:  # the GCS going away at shutdown must not print from a daemon thread
                return
            time.sleep(interval_seconds)

    thread = threading.Thread(target=beat, name="mindspeed-rl-heartbeat", daemon=True)
    thread.start()
    return thread


def read_heartbeats(run_key: str, ranks: list[int]) -> dict[int, bytes | None]:
    from ray.experimental import internal_kv

    return {rank: internal_kv._internal_kv_get(_heartbeat_key(run_key, rank), namespace=_HEARTBEAT_NAMESPACE)
            for rank in ranks}


def silent_ranks(run_key: str, ranks: list[int], *, watch_seconds: float = 3 * HEARTBEAT_SECONDS) -> list[int]:
    """The ranks whose heartbeat did not move during `watch_seconds`."""
    if not ranks:
        return []
    before = read_heartbeats(run_key, ranks)
    time.sleep(watch_seconds)
    after = read_heartbeats(run_key, ranks)
    return [rank for rank in ranks if after[rank] is None or after[rank] == before[rank]]


class HeartbeatWatch:
    """Which ranks' heartbeats have not moved for `timeout_seconds` (a stopped or frozen process), read at most
    once a `poll_seconds`. A rank that never beat is not judged here: the RPC deadline covers it."""

    def __init__(self, run_key: str, *, timeout_seconds: float, poll_seconds: float = HEARTBEAT_SECONDS):
        self.run_key, self.timeout_seconds, self.poll_seconds = run_key, timeout_seconds, poll_seconds
        self._seen: dict[int, tuple[bytes, float]] = {}  # rank -> (last value, when it was first seen)
        self._polled = float("-inf")

    def silent(self, ranks: list[int]) -> list[int]:
        now = time.monotonic()
        if not ranks or now - self._polled < self.poll_seconds:
            return []
        self._polled = now
        silent = []
        for rank, value in read_heartbeats(self.run_key, ranks).items():
            seen = self._seen.get(rank)
            if value is None:
                continue
            if seen is None or seen[0] != value:
                self._seen[rank] = (value, now)
            elif now - seen[1] >= self.timeout_seconds:
                silent.append(rank)
        return silent


# -- lost nodes -----------------------------------------------------------------------------------
def lost_nodes(addresses: list[WorkerAddress], *, timeout_seconds: float = 1.0) -> dict[str, list[WorkerAddress]]:
    """node address -> its ranks, for each node of these ranks whose raylet is gone (the raylet killed, the
    machine down): Ray lists it dead, or its node manager port does not answer. Ray itself marks a node dead
    only after its health checks fail (~15 s), after the ranks' deaths have already reached the driver."""
    import ray

    try:
        nodes = ray.nodes()
    except Exception:  # the failure line must come out whatever the cluster's state (its head gone too)
        return {}
    by_ip: dict[str, list[dict]] = {}
    for node in nodes:
        by_ip.setdefault(node["NodeManagerAddress"], []).append(node)
    answers: dict[str, bool] = {}
    lost: dict[str, list[WorkerAddress]] = {}
    for address in addresses:
        if address.ip not in by_ip:  # not a node Ray knows by this address: nothing to say about it
            continue
        if address.ip not in answers:
            answers[address.ip] = any(node.get("Alive") and _port_answers(address.ip, node["NodeManagerPort"],
                                                                          timeout_seconds)
                                      for node in by_ip[address.ip])
        if not answers[address.ip]:
            lost.setdefault(address.ip, []).append(address)
    return lost


def _port_answers(host: str, port: int, timeout_seconds: float) -> bool:
    try:
        with socket.create_connection((host, int(port)), timeout=timeout_seconds):
            return True
    except (OSError, ValueError):
        return False


def lost_nodes_text(lost: dict[str, list[WorkerAddress]]) -> str:
    """`node 10.0.0.2 was lost (rank 1 ran there)`, for the front of the failure line; "" when none was."""
    return "; ".join(f"node {ip} was lost ("
                     + ", ".join(f"{a.role + ' ' if a.role else ''}rank {a.rank}" for a in ranks)
                     + " ran there)" for ip, ranks in lost.items())


# -- messages -------------------------------------------------------------------------------------
_FRAME = re.compile(r'File "([^"]+)", line (\d+), in (\S+)')


def describe_worker_error(error: BaseException) -> str:
    """The worker's own error in one line: `Type: message (at file.py:123 in fn)`."""
    from ray.exceptions import RayActorError, RayTaskError

    if isinstance(error, RayTaskError):
        cause = error.cause if isinstance(getattr(error, "cause", None), BaseException) else None
        text = f"{type(cause).__name__}: {_first_line(str(cause))}" if cause else _first_line(str(error))
        # Ray keeps the worker's traceback only as text, in the error's message.
        frames = _FRAME.findall(getattr(error, "traceback_str", None) or str(error))
        if frames:
            path, line, function = frames[-1]
            text += f" (at {path.rsplit('/', 1)[-1]}:{line} in {function})"
        return text
    if isinstance(error, RayActorError):
        return "the worker process died (killed, or crashed outside Python)"
    return f"{type(error).__name__}: {_first_line(str(error))}"


def describe_local_error(error: BaseException) -> str:
    """describe_worker_error's line for an exception raised in this process (a rank in the driver,
    workers/local_group.py): the innermost frame comes from its traceback."""
    import traceback

    text = f"{type(error).__name__}: {_first_line(str(error))}"
    frames = traceback.extract_tb(error.__traceback__)
    if frames:
        text += f" (at {frames[-1].filename.rsplit('/', 1)[-1]}:{frames[-1].lineno} in {frames[-1].name})"
    return text


def _first_line(text: str) -> str:
    lines = [line.strip() for line in text.strip().splitlines() if line.strip()]
    return lines[0] if lines else "(no message)"
