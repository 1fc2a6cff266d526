"""Ray placement of the hybrid actor's ranks, SPMD calls across them, and their supervision.

Every blocking call waits with a deadline and turns a rank that raised, died or hung into one
`WorkerFailure` line (supervision.py). `kill()` ends the ranks from any state within seconds and
removes the shared-memory segments they leave behind; `shutdown()` asks them to finish first.
"""
from __future__ import annotations

import contextlib
import os
import signal
import socket
import time
import uuid
from typing import Any

import ray

from mindspeed_rl import interrupts
from mindspeed_rl.workers.actor_hybrid_worker import ActorHybridWorker, RankInfo, Shard
from mindspeed_rl.workers.placement import place_ranks
from mindspeed_rl.workers.fault_injection import FAULT_ENV_VAR, FAULT_LOG_ENV_VAR, worker_class_with_faults
from mindspeed_rl.workers.supervision import (Deadlines, WorkerAddress, WorkerFailure, deadline_text,
                                              describe_worker_error, silent_ranks)

GRACEFUL_SHUTDOWN_SECONDS = 30.0
_EXIT_WAIT_SECONDS = 10.0


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class RayActorGroup:
    """`world_size` ActorHybridWorker ranks packed on one set of devices (colocated roles), or one side
    of a disaggregated actor (`worker_class` and `world_size` of that side, workers/disaggregated.py)."""

    def __init__(self, *, config, device: str, env_vars: dict[str, str], model_dir: str, ref_model_dir: str,
                 worker_class=None, world_size: int | None = None):
        runtime = config.runtime
        world_size = world_size or config.world_size
        cpus_per_rank = 1.0
        self.run_key = f"run-{uuid.uuid4().hex[:12]}"
        self.deadlines = Deadlines(rpc_timeout_seconds=runtime.rpc_timeout_seconds,
                                   initialize_timeout_seconds=runtime.initialize_timeout_seconds)
        self.master_port = _free_port()
        self.addresses: list[WorkerAddress] = []
        self.shm_segments: set[str] = set()
        self.workers: list = []
        self.placement = place_ranks(world_size, device=device, cpus_per_slot=cpus_per_rank,
                                     num_gpus_per_node=config.resource_plan.num_gpus_per_node,
                                     timeout_seconds=runtime.placement_timeout_seconds)
        for name in (FAULT_ENV_VAR, FAULT_LOG_ENV_VAR):
            if os.environ.get(name):
                env_vars = {**env_vars, name: os.environ[name]}
        # A test may bring its own subclass (probes); fault injection wraps the class the group runs.
        worker_class = worker_class or ActorHybridWorker
        worker_class = worker_class_with_faults(os.environ.get(FAULT_ENV_VAR),
                                                base=worker_class.__ray_actor_class__) or worker_class
        with interrupts.shielded():
            self.workers = self._start_workers(worker_class, config, env_vars, model_dir, ref_model_dir, cpus_per_rank,
                                               device, world_size)
        self.addresses = [WorkerAddress(rank=rank, host="?", pid=0, role=worker_class_role(worker_class))
                          for rank in range(world_size)]
        self.addresses = self.call("address")
        if len({a.host for a in self.addresses}) > 1:  # across nodes: rendezvous at rank 0's node
            self.call("set_master_addr", self.addresses[0].ip)

    def _start_workers(self, worker_class, config, env_vars, model_dir, ref_model_dir, cpus_per_rank, device,
                       world_size):
        return [
            worker_class.options(
                num_cpus=cpus_per_rank,
                num_gpus=1 if device == "cuda" else 0,
                resources={"NPU": 1} if device == "npu" else None,
                scheduling_strategy=self.placement.strategy_for(rank),
                runtime_env={"env_vars": env_vars},
                max_restarts=0,
            ).remote(config, RankInfo(rank=rank, world_size=world_size, master_addr="127.0.0.1",
                                      master_port=self.master_port, run_key=self.run_key),
                     model_dir=model_dir, ref_model_dir=ref_model_dir)
            for rank in range(world_size)
        ]

    # -- calls --------------------------------------------------------------------------------------
    def call(self, method: str, *args: Any, blocking: bool = True, **kwargs: Any) -> list[Any]:
        """Run `method` on every rank (SPMD): each rank's result, or with blocking=False their Ray refs."""
        with interrupts.shielded():
            refs = [getattr(worker, method).remote(*args, **kwargs) for worker in self.workers]
        if not blocking:
            return refs
        return self.wait(method, refs)

    def initialize(self) -> list[dict[str, float]]:
        """Every rank builds its engines; their shared-memory segments are noted for the cleanup."""
        metrics = self.call("initialize")
        self.shm_segments.update(name for names in self.call("shm_segments") for name in names)
        return metrics

    def wait(self, method: str, refs: list) -> list[Any]:
        """Every rank's result, in rank order; the first rank that fails or the deadline ends the wait."""
        return wait_all([(self, method, refs)])[0]

    def _failure_message(self, rank: int, method: str, error: BaseException, waiting: list[int]) -> str:
        message = f"{self.addresses[rank].describe()} failed in {method}: {describe_worker_error(error)}"
        silent = silent_ranks(self.run_key, waiting) if waiting else []
        if silent:
            # A collective timeout on one rank is usually another rank that stopped: name that one too.
            message += "; not responding: " + ", ".join(self.addresses[r].describe() for r in silent)
        return message

    def _hang_message(self, method: str, waiting: list[int], deadline_seconds: float) -> str:
        silent = silent_ranks(self.run_key, waiting)
        limit = deadline_text(method, deadline_seconds)
        if silent:
            others = [r for r in waiting if r not in silent]
            tail = f"; ranks {others} were waiting for it" if others else ""
            return (", ".join(self.addresses[r].describe() for r in silent)
                    + f" stopped responding in {method} (no heartbeat) and did not finish within {limit}{tail}")
        return (", ".join(self.addresses[r].describe() for r in waiting)
                + f" did not finish {method} within {limit}; each is still alive (heartbeat)")

    # ROLL's cluster-level state control: `actor.offload_states(blocking=True)`.
    def offload_states(self, include: list[str] | None = None, *, keep_contents: bool | None = None,
                       blocking: bool = True) -> list[Any]:
        return self.call("offload_states", include, keep_contents, blocking=blocking)

    def reload_states(self, include: list[str] | None = None, *, blocking: bool = True) -> list[Any]:
        return self.call("reload_states", include, blocking=blocking)

    # -- endings ------------------------------------------------------------------------------------
    def shutdown(self) -> None:
        """After a successful run: let every rank close its engines, then end the processes."""
        try:
            self.deadlines.base["shutdown"] = GRACEFUL_SHUTDOWN_SECONDS
            self.call("shutdown")
        except WorkerFailure as failure:
            print(f"[shutdown] {failure}; killing the workers", flush=True)
        finally:
            self.kill()

    def kill(self) -> None:
        """End every rank now, whatever it is doing (also a stopped or hung one), and unlink the
        shared-memory segments vLLM leaves behind (a killed process never unlinks its own)."""
        # Children first found, then orphaned by the kill: Megatron's checkpoint writer starts a
        # multiprocessing Manager in each rank, and Python a resource tracker; neither dies with it.
        local_pids = self._local_pids()
        local_pids += _descendants(local_pids)
        self.shm_segments.update(_mapped_shm_segments(local_pids))
        for worker in self.workers:
            with contextlib.suppress(Exception):
                ray.kill(worker, no_restart=True)
        # Ray's kill lets a process exit on its own first; a stopped or hung one never does.
        _sigkill_ray_workers(local_pids)
        _wait_for_exit(local_pids, timeout_seconds=_EXIT_WAIT_SECONDS)
        self.placement.remove()
        remove_shm_segments(self.shm_segments, master_port=self.master_port)

    def _local_pids(self) -> list[int]:
        host = socket.gethostname()
        return [a.pid for a in self.addresses if a.pid and a.host == host]


def wait_all(calls: list[tuple["RayActorGroup", str, list]]) -> list[list[Any]]:
    """Results of calls running at once on several groups (a disaggregated push: the training ranks
    send while the inference ranks receive), each in rank order. The first rank of any group that
    fails ends the wait, so a receiver that died is named, not the senders left waiting for it."""
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
                waiting = sorted(r for i, r in pending.values() if i == index)
                message = group._failure_message(rank, method, error, waiting)
                # A sender that failed because its receiver died: name the receiver too.
                for other in sorted({i for i, _ in pending.values()} - {index}):
                    other_group = calls[other][0]
                    silent = silent_ranks(other_group.run_key, sorted(r for i, r in pending.values() if i == other))
                    if silent:
                        message += "; not responding: " + ", ".join(other_group.addresses[r].describe() for r in silent)
                raise WorkerFailure(message) from None
        if pending and time.monotonic() - started > deadline_seconds:
            waiting = {index: sorted(r for i, r in pending.values() if i == index) for index, _ in pending.values()}
            # The group with a silent rank is the culprit; the other group's ranks are waiting for it.
            index = next((i for i in sorted(waiting) if silent_ranks(calls[i][0].run_key, waiting[i])), min(waiting))
            group, method, _ = calls[index]
            raise WorkerFailure(group._hang_message(method, waiting[index], deadline_seconds))
    for group, method, _ in calls:
        group.deadlines.observe(method, time.monotonic() - started)
    return results


def worker_class_role(worker_class) -> str:
    """The ROLE a (Ray-wrapped) worker class names its ranks with."""
    cls = getattr(worker_class, "__ray_actor_class__", worker_class)
    return getattr(cls, "ROLE", "")


def _wait_for_exit(pids: list[int], *, timeout_seconds: float) -> None:
    """Ray's kill is asynchronous; wait for the local processes, then SIGKILL what is left."""
    end = time.monotonic() + timeout_seconds
    alive = list(pids)
    while alive and time.monotonic() < end:
        alive = [pid for pid in alive if _is_running(pid)]
        if alive:
            time.sleep(0.1)
    _sigkill_ray_workers(alive)


def _sigkill_ray_workers(pids: list[int]) -> None:
    for pid in pids:
        try:
            # Not a reused pid: a rank ("ray::...") or one of the Python children it started.
            cmdline = open(f"/proc/{pid}/cmdline", "rb").read()
        except OSError:
            continue
        if b"ray::" in cmdline or b"python" in cmdline:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, signal.SIGKILL)


def _descendants(pids: list[int]) -> list[int]:
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            with contextlib.suppress(OSError, IndexError, ValueError):
                with open(f"/proc/{entry}/stat") as handle:
                    parent = int(handle.read().rsplit(")", 1)[1].split()[1])
                children.setdefault(parent, []).append(int(entry))
    found, frontier = [], list(pids)
    while frontier:
        kids = children.get(frontier.pop(), [])
        found += kids
        frontier += kids
    return found


def _is_running(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as handle:
            return handle.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (FileNotFoundError, ProcessLookupError, IndexError):
        return False


def _mapped_shm_segments(pids: list[int]) -> set[str]:
    """The /dev/shm files these processes have mapped and not yet unlinked."""
    names = set()
    for pid in pids:
        with contextlib.suppress(OSError):
            with open(f"/proc/{pid}/maps") as handle:
                for line in handle:
                    path = line.split(maxsplit=5)[-1].strip() if line.count(" ") >= 5 else ""
                    if path.startswith("/dev/shm/") and not path.endswith("(deleted)"):
                        names.add(path[len("/dev/shm/"):])
    return names


def remove_shm_segments(names: set[str], *, master_port: int) -> None:
    from mindspeed_rl.engines.vllm_engine import remove_cpu_shm_segments

    for name in names:
        with contextlib.suppress(OSError):
            os.unlink(os.path.join("/dev/shm", name))
    remove_cpu_shm_segments(master_port)


def merge_shards(shards: list[Shard]) -> list[Shard]:
    """The reporting rank's shard for each sample range, in sample order."""
    reported = {(s.start, s.stop): s for s in shards if s.value is not None}
    return [reported[key] for key in sorted(reported)]


def merge_metrics(per_rank: list[dict[str, float]]) -> dict[str, float]:
    """Rank 0's timings; memory figures as the maximum over ranks (the device that runs out first)."""
    merged = dict(per_rank[0])
    for metrics in per_rank[1:]:
        for key, value in metrics.items():
            if key.startswith("memory/"):
                merged[key] = max(merged.get(key, 0.0), value)
    return merged


def default_env_vars(threads_per_rank: int) -> dict[str, str]:
    env = {
        # vLLM must run in-process so the trainer reaches its model, weights and KV cache.
        "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
        # vLLM otherwise shrinks torch to 1 thread "for serving"; it also freezes the count later.
        "OMP_NUM_THREADS": str(threads_per_rank),
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "TOKENIZERS_PARALLELISM": "false",
        "VLLM_LOGGING_LEVEL": os.environ.get("VLLM_LOGGING_LEVEL", "ERROR"),
        "PYTHONWARNINGS": "ignore",
        # Where the device is host memory, a storage that comes back after an offload is fresh
        # memory: with 2 MiB pages torch's allocator takes 512x fewer page faults to map it
        # (measured in benchmarks/bench_offload.py). It only changes host allocations >= 2 MiB.
        "THP_MEM_ALLOC_ENABLE": "1",
    }
    return env
