"""Ray placement of the hybrid actor's ranks, SPMD calls across them, and their supervision.

Every blocking call waits with a deadline and turns a rank that raised, died or hung into one
`WorkerFailure` line (supervision.py). `kill()` ends the ranks from any state within seconds and
removes the shared-memory segments they leave behind; `shutdown()` asks them to finish first.
"""
from __future__ import annotations

import contextlib
import socket
import time
import uuid
from typing import Any

import ray

from mindspeed_rl import interrupts
from mindspeed_rl.protocol import RolloutBatch
from mindspeed_rl.workers.actor_group import RankGroupBase
from mindspeed_rl.workers.rank_process import RankInfo
from mindspeed_rl.workers.placement import place_ranks
from mindspeed_rl.workers.processes import (RANK_GROUP_ENV_VAR, descendants, free_port, mapped_shm_segments,
                                            processes_of_group, remove_shm_segments, sigkill_rank_processes,
                                            wait_for_exit)
from mindspeed_rl.workers.supervision import (Deadlines, HeartbeatWatch, WorkerAddress, WorkerFailure,
                                              deadline_text, describe_worker_error, lost_nodes, lost_nodes_text,
                                              silent_ranks)

_EXIT_WAIT_SECONDS = 10.0
_RANK_EXIT_GRACE_SECONDS = 3.0


class RayActorGroup(RankGroupBase):
    """`world_size` ranks of `worker_class` (a plain class; Ray wraps it here) packed on one set of devices
    (colocated roles), or one side of a disaggregated actor (`world_size` of that side, workers/disaggregated.py)."""

    def __init__(self, *, config, device: str, env_vars: dict[str, str], model_dir: str, ref_model_dir: str,
                 worker_class: type, world_size: int | None = None):
        runtime = config.runtime
        world_size = world_size or config.world_size
        self.worker_class = worker_class
        cpus_per_rank = 1.0
        self.run_key = f"run-{uuid.uuid4().hex[:12]}"
        self.deadlines = Deadlines(rpc_timeout_seconds=runtime.rpc_timeout_seconds,
                                   initialize_timeout_seconds=runtime.initialize_timeout_seconds)
        self.heartbeats = HeartbeatWatch(self.run_key, timeout_seconds=runtime.heartbeat_timeout_seconds)
        self.master_port = free_port()
        self.addresses: list[WorkerAddress] = []
        self.shm_segments: set[str] = set()
        self.workers: list = []
        self.placement = place_ranks(world_size, device=device, cpus_per_slot=cpus_per_rank,
                                     num_gpus_per_node=config.resource_plan.num_gpus_per_node,
                                     timeout_seconds=runtime.placement_timeout_seconds)
        with interrupts.shielded():
            self.workers = self._start_workers(ray.remote(worker_class), config, env_vars, model_dir, ref_model_dir,
                                               cpus_per_rank, device, world_size)
        self.addresses = [WorkerAddress(rank=rank, host="?", pid=0, role=worker_class.ROLE)
                          for rank in range(world_size)]
        self.addresses = self.call("address")
        # Rank 0 listens for the rendezvous, so its node picks the port, just before the ranks meet: the driver's
        # pick above was for the driver's node, and long before (start-up takes seconds), time for another process
        # to take it (seen: EADDRINUSE). Across nodes (told apart by address too: two machines may share a
        # hostname) the ranks meet at rank 0's node.
        self.master_port = self.rank0_free_port()
        spans_nodes = len({(a.host, a.ip) for a in self.addresses}) > 1
        self.call("set_rendezvous", self.addresses[0].ip if spans_nodes else "127.0.0.1", self.master_port)

    def rank0_free_port(self) -> int:
        """A port free now on rank 0's node (the rendezvous, a disaggregated run's bridge listen there)."""
        return wait_all([(self, "free_port", [self.workers[0].free_port.remote()])])[0][0]

    def _start_workers(self, worker_class, config, env_vars, model_dir, ref_model_dir, cpus_per_rank, device,
                       world_size):
        return [
            worker_class.options(
                num_cpus=cpus_per_rank,
                num_gpus=1 if device == "cuda" else 0,
                resources={"NPU": 1} if device == "npu" else None,
                scheduling_strategy=self.placement.strategy_for(rank),
                runtime_env={"env_vars": env_vars | {RANK_GROUP_ENV_VAR: self.run_key}},
                max_restarts=0,
            ).remote(config, RankInfo(rank=rank, world_size=world_size, master_addr="127.0.0.1",
                                      master_port=self.master_port, run_key=self.run_key),
                     model_dir=model_dir, ref_model_dir=ref_model_dir)
            for rank in range(world_size)
        ]

    # -- calls --------------------------------------------------------------------------------------
    def call(self, method: str, *args: Any, blocking: bool = True, **kwargs: Any) -> list[Any]:
        """Run `method` on every rank (SPMD): each rank's result, or with blocking=False their Ray refs."""
        per_rank = self.split(method, args, kwargs, world_size=len(self.workers))
        with interrupts.shielded():
            per_rank = _stored_once(per_rank)
            refs = [getattr(worker, method).remote(*a, **k) for worker, (a, k) in zip(self.workers, per_rank)]
        if not blocking:
            return refs
        return self.wait(method, refs)

    def wait(self, method: str, refs: list) -> list[Any]:
        """Every rank's result, in rank order (a dispatched call's as shards); the first rank that fails or the
        deadline ends the wait."""
        return wait_all([(self, method, refs)])[0]

    def _failure_message(self, rank: int, method: str, error: BaseException, waiting: list[int]) -> str:
        message = f"{self.addresses[rank].describe()} failed in {method}: {describe_worker_error(error)}"
        silent = silent_ranks(self.run_key, waiting) if waiting else []
        if silent:
            # A collective timeout on one rank is usually another rank that stopped: name that one too.
            message += "; not responding: " + ", ".join(self.addresses[r].describe() for r in silent)
        return message

    def _frozen_message(self, method: str, frozen: list[int], waiting: list[int]) -> str:
        return self._stopped_message(method, frozen, waiting, f"(no heartbeat for {self.heartbeats.timeout_seconds:.0f}"
                                                              " s, runtime.heartbeat_timeout_seconds)")

    def _hang_message(self, method: str, waiting: list[int], deadline_seconds: float) -> str:
        silent = silent_ranks(self.run_key, waiting)
        limit = deadline_text(method, deadline_seconds)
        if silent:
            return self._stopped_message(method, silent, waiting, f"(no heartbeat) and did not finish within {limit}")
        return (", ".join(self.addresses[r].describe() for r in waiting)
                + f" did not finish {method} within {limit}; each is still alive (heartbeat)")

    def _stopped_message(self, method: str, stopped: list[int], waiting: list[int], why: str) -> str:
        others = [r for r in waiting if r not in stopped]
        tail = f"; ranks {others} were waiting for it" if others else ""
        return ", ".join(self.addresses[r].describe() for r in stopped) + f" stopped responding in {method} {why}{tail}"

    # -- endings ------------------------------------------------------------------------------------
    def kill(self) -> None:
        """End every rank now, whatever it is doing (also a stopped or hung one), and unlink the
        shared-memory segments vLLM leaves behind (a killed process never unlinks its own)."""
        # Children first found, then orphaned by the kill: Megatron's checkpoint writer starts a
        # multiprocessing Manager in each rank, and Python a resource tracker; neither dies with it.
        rank_pids = self._local_pids()
        local_pids = sorted(set(rank_pids + descendants(rank_pids) + processes_of_group(self.run_key)))
        self.shm_segments.update(mapped_shm_segments(local_pids))
        for worker in self.workers:
            with contextlib.suppress(Exception):
                ray.kill(worker, no_restart=True)
        # Ray's kill lets a rank exit on its own: given a moment it does (a SIGKILL racing that exit made the raylet
        # print "a worker died ... by an unexpected system error" after a run that ended well); a stopped or hung
        # one never does, and is SIGKILLed after the moment.
        wait_for_exit(rank_pids, timeout_seconds=_RANK_EXIT_GRACE_SECONDS)
        sigkill_rank_processes(local_pids)
        wait_for_exit(local_pids, timeout_seconds=_EXIT_WAIT_SECONDS)
        self.placement.remove()
        remove_shm_segments(self.shm_segments, master_port=self.master_port)

    def _local_pids(self) -> list[int]:
        host = socket.gethostname()
        return [a.pid for a in self.addresses if a.pid and a.host == host]


def _stored_once(per_rank: list[tuple[tuple, dict]]) -> list[tuple[tuple, dict]]:
    """Each distinct argument object in Ray's object store once (ranks given the same share, or the same batch,
    would each copy it in otherwise); Ray hands the ranks the values."""
    stored: dict[int, Any] = {}

    def ref(value):
        if not isinstance(value, (RolloutBatch, list)):
            return value
        if id(value) not in stored:
            stored[id(value)] = ray.put(value)
        return stored[id(value)]

    return [(tuple(ref(a) for a in args), {k: ref(v) for k, v in kwargs.items()}) for args, kwargs in per_rank]


def wait_all(calls: list[tuple["RayActorGroup", str, list]]) -> list[list[Any]]:
    """Results of calls running at once on several groups (a disaggregated push: the training ranks
    send while the inference ranks receive), each in rank order (a dispatched call's gathered). The first
    rank of any group that fails ends the wait, so a receiver that died is named, not the senders left
    waiting for it."""
    started = time.monotonic()
    pending = {ref: (index, rank) for index, (_, _, refs) in enumerate(calls) for rank, ref in enumerate(refs)}
    results: list[list[Any]] = [[None] * len(refs) for _, _, refs in calls]
    deadline_seconds = max(group.deadlines.seconds(method) for group, method, _ in calls)
    while pending:
        with interrupts.shielded():
            ready, _ = ray.wait(list(pending), num_returns=1, timeout=interrupts.RAY_WAIT_SLICE_SECONDS)
        for ref in ready:
            index, rank = pending.pop(ref)
            group, method, _ = calls[index]
            try:
                with interrupts.shielded():
                    results[index][rank] = ray.get(ref)
            except ray.exceptions.RayError as error:
                raise _failure(calls, _failure_message(calls, pending, index, rank, error)) from None
        _raise_if_frozen(calls, pending)
        if pending and time.monotonic() - started > deadline_seconds:
            waiting = {index: sorted(r for i, r in pending.values() if i == index) for index, _ in pending.values()}
            # The group with a silent rank is the culprit; the other group's ranks are waiting for it.
            index = next((i for i in sorted(waiting) if silent_ranks(calls[i][0].run_key, waiting[i])), min(waiting))
            group, method, _ = calls[index]
            raise _failure(calls, group._hang_message(method, waiting[index], deadline_seconds))
    for group, method, _ in calls:
        group.deadlines.observe(method, time.monotonic() - started)
    # A dispatched call's results as shards of the samples each rank was given (workers/dispatch.py).
    return [group.gathered(method, group_results) for (group, method, _), group_results in zip(calls, results)]


def _failure(calls: list[tuple["RayActorGroup", str, list]], message: str) -> WorkerFailure:
    """The failure line, led by the nodes lost with their ranks when that is why (their ranks died or went silent)."""
    lost = lost_nodes([address for group, _, _ in calls for address in group.addresses])
    return WorkerFailure(f"{lost_nodes_text(lost)}: {message}" if lost else message)


# A rank's peers see its death (a closed connection in a collective) before Ray reports it.
DEATH_GRACE_SECONDS = 5.0


def _failure_message(calls: list[tuple["RayActorGroup", str, list]], pending: dict, index: int, rank: int,
                     error: BaseException) -> str:
    """The line for the first failed rank. When it raised (not died), a rank that dies within DEATH_GRACE_SECONDS is
    the cause, usually: that one is named first, then the error it caused."""
    group, method, _ = calls[index]
    if not isinstance(error, ray.exceptions.RayActorError):
        died = _died_meanwhile(pending)
        if died is not None:
            dead_index, dead_rank, death = died
            dead_group, dead_method, _ = calls[dead_index]
            return (f"{dead_group.addresses[dead_rank].describe()} failed in {dead_method}: "
                    f"{describe_worker_error(death)}; then {group.addresses[rank].describe()} failed in {method}: "
                    f"{describe_worker_error(error)}")
    waiting = sorted(r for i, r in pending.values() if i == index)
    message = group._failure_message(rank, method, error, waiting)
    # A sender that failed because its receiver died: name the receiver too.
    for other in sorted({i for i, _ in pending.values()} - {index}):
        other_group = calls[other][0]
        silent = silent_ranks(other_group.run_key, sorted(r for i, r in pending.values() if i == other))
        if silent:
            message += "; not responding: " + ", ".join(other_group.addresses[r].describe() for r in silent)
    return message


def _died_meanwhile(pending: dict) -> tuple[int, int, BaseException] | None:
    """(call index, rank, error) of a pending rank whose process dies within DEATH_GRACE_SECONDS, else None."""
    remaining = dict(pending)
    deadline = time.monotonic() + DEATH_GRACE_SECONDS
    while remaining and time.monotonic() < deadline:
        with interrupts.shielded():
            ready, _ = ray.wait(list(remaining), num_returns=1, timeout=interrupts.RAY_WAIT_SLICE_SECONDS)
        for ref in ready:
            index, rank = remaining.pop(ref)
            try:
                with interrupts.shielded():
                    ray.get(ref)
            except ray.exceptions.RayActorError as death:
                return index, rank, death
            except ray.exceptions.RayError:
                pass
    return None


def _raise_if_frozen(calls: list[tuple["RayActorGroup", str, list]], pending: dict) -> None:
    """A rank whose heartbeat stopped (SIGSTOP, a frozen host) ends the wait at once, whatever the deadline."""
    for index, (group, method, _) in enumerate(calls):
        waiting = sorted(r for i, r in pending.values() if i == index)
        frozen = group.heartbeats.silent(waiting)
        if frozen:
            raise _failure(calls, group._frozen_message(method, frozen, waiting))
