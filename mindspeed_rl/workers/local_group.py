"""One rank in the driver process: `RayActorGroup`'s interface without Ray, for a run with exactly one
rank process (`runtime.local_single_rank`; docs/overhead.md, ranked list item 1).

For one rank Ray buys nothing and costs seconds of start-up (Ray's daemons, a second process that
imports torch again), hundreds of MiB of helper processes and a pickled copy of every batch. Here the
rank (`ActorHybridWorkerBase`) is an object of this process and a call is a method call. What
supervision.py does across processes still holds:

* a worker exception ends the call as `WorkerFailure`, one line naming rank 0 (host, pid), the method
  and the error with its innermost frame, worded as on the Ray path;
* a call past its deadline (`Deadlines`) cannot be interrupted in the thread it hangs in: a watchdog
  thread prints the run's failure line, removes vLLM's shared-memory segments and ends the process
  with exit code 1;
* SIGINT/SIGTERM raise `RunInterrupted` inside the rank's code (mindspeed_rl/interrupts.py) and
  `kill()` tears the rank down in this process (process group, shared-memory segments).

A crash of the rank (SIGKILL, a segfault) is a crash of the driver: no process is left to report it.
"""
from __future__ import annotations

import contextlib
import os
import socket
import sys
import threading
import time
import warnings
from dataclasses import dataclass
from typing import Any, Callable

import torch

from mindspeed_rl.interrupts import RunInterrupted
from mindspeed_rl.workers.actor_group import GRACEFUL_SHUTDOWN_SECONDS, RankGroupBase
from mindspeed_rl.workers.rank_process import RankInfo
# Imported now (they import vLLM's segment cleanup): the watchdog removes the segments while the hung thread
# may hold an import lock.
from mindspeed_rl.workers.processes import (descendants, free_port, mapped_shm_segments, remove_shm_segments,
                                            sigkill_rank_processes)
from mindspeed_rl.workers.reward_workers import cpu_reward_section
from mindspeed_rl.workers.supervision import (Deadlines, WorkerAddress, WorkerFailure, deadline_text,
                                              describe_local_error)

HUNG_EXIT_CODE = 1  # trainer/stopping.py WORKER_FAILURE_EXIT_CODE
_WATCH_INTERVAL_SECONDS = 0.5
# rank_env_vars' keys where a value the user set wins (the rest are set, as a Ray rank's runtime_env does).
_USER_WINS = ("VLLM_LOGGING_LEVEL", "THP_MEM_ALLOC_ENABLE", "PYTHONWARNINGS", "TORCH_FR_BUFFER_SIZE")


def reason_for_ray(config) -> str | None:
    """Why the run starts Ray, or None: its one rank runs in this process."""
    runtime = config.runtime
    if not runtime.local_single_rank:
        return "runtime.local_single_rank=false"
    if runtime.ray_address:
        return f"runtime.ray_address={runtime.ray_address}"
    if runtime.max_restarts:  # the in-process rank is the driver: its death could not be survived
        return f"runtime.max_restarts={runtime.max_restarts}: a restart needs the rank in a process of its own"
    if config.disaggregated:
        return "disaggregated: actor_train and actor_infer have ranks of their own"
    if config.num_rank_processes != 1:
        return f"{config.num_rank_processes} rank processes"
    rewards = cpu_reward_section(config)
    if rewards is not None:
        return f"rewards.{rewards[0]}.world_size={rewards[1].world_size} CPU reward workers"
    return None


def check_local_devices(config, device: str) -> None:
    """The device mappings must name devices this host has (the Ray path checks its cluster instead)."""
    if device == "cuda":
        count = torch.cuda.device_count()
    elif device == "npu":
        import torch_npu  # noqa: F401  (registers torch.npu)

        count = torch.npu.device_count()
    else:
        count = os.cpu_count() or 1
    config.resource_plan.check_cluster(count, num_nodes=1, what=f"{device} device(s) on this host")


def prepare_this_process(env_vars: dict[str, str], threads: int) -> None:
    """What a Ray rank gets from its runtime_env, for this process; before the rank imports Megatron and
    vLLM, which read these at import or engine start. THP_MEM_ALLOC_ENABLE only takes effect if set
    before torch's first allocation (the CLI sets it before importing torch)."""
    for key, value in env_vars.items():
        if key in _USER_WINS:
            os.environ.setdefault(key, value)
        else:
            os.environ[key] = value
    # PYTHONWARNINGS is read at interpreter start: set what it would have, unless -W/PYTHONWARNINGS were given.
    if os.environ.get("PYTHONWARNINGS") == "ignore" and not sys.warnoptions:
        warnings.simplefilter("ignore")
    if threads > 0:
        torch.set_num_threads(threads)  # vLLM makes this a no-op once its engine starts


@dataclass(frozen=True)
class _Call:
    method: str
    started: float
    seconds: float
    thread: int


class LocalActorGroup(RankGroupBase):
    """`RayActorGroup`'s calls, deadlines and endings over one rank object (of `worker_class`) in this process."""

    def __init__(self, *, config, env_vars: dict[str, str], model_dir: str, ref_model_dir: str, threads: int,
                 worker_class: type, on_hang: Callable[[str], None] | None = None):
        runtime = config.runtime
        self.worker_class = worker_class
        prepare_this_process(env_vars, threads)
        self.run_key = ""  # no heartbeats: the watchdog is a thread of this process
        self.deadlines = Deadlines(rpc_timeout_seconds=runtime.rpc_timeout_seconds,
                                   initialize_timeout_seconds=runtime.initialize_timeout_seconds)
        self.master_port = free_port()
        self.shm_segments: set[str] = set()
        self._on_hang = on_hang or (lambda message: print(f"worker failure: {message}", file=sys.stderr, flush=True))
        self._current: _Call | None = None
        self._closed = threading.Event()
        self.addresses = [WorkerAddress(rank=0, host=socket.gethostname(), pid=os.getpid(), role=worker_class.ROLE)]
        threading.Thread(target=self._watch, name="mindspeed-rl-watchdog", daemon=True).start()
        # run_key "": no heartbeat thread, no Ray.
        rank_info = RankInfo(rank=0, world_size=1, master_addr="127.0.0.1", master_port=self.master_port)
        self.worker = self._guarded("__init__", lambda: worker_class(config, rank_info, model_dir=model_dir,
                                                                     ref_model_dir=ref_model_dir))
        self.addresses = self.call("address")

    # -- calls --------------------------------------------------------------------------------------
    def call(self, method: str, *args: Any, blocking: bool = True, **kwargs: Any) -> list[Any]:
        """[the rank's result]. One process cannot run a call in the background: with blocking=False it
        runs now all the same, and `wait` hands back what this returned."""
        bound = getattr(self.worker, method)
        (args, kwargs), = self.split(method, args, kwargs, world_size=1)
        results = [self._guarded(method, lambda: bound(*args, **kwargs))]
        return self.gathered(method, results) if blocking else results

    def wait(self, method: str, refs: list) -> list[Any]:
        return self.gathered(method, list(refs))

    def _guarded(self, method: str, run: Callable[[], Any]) -> Any:
        started = time.monotonic()
        self._current = _Call(method, started, self.deadlines.seconds(method), threading.get_ident())
        try:
            result = run()
        except (RunInterrupted, KeyboardInterrupt, SystemExit):
            raise  # a stop, not the rank's failure
        except BaseException as error:  # the rank's own error, as the Ray path reports a RayTaskError (torch's
            # CheckpointException, e.g. a save on a full disk, is a BaseException, not an Exception)
            raise WorkerFailure(f"{self.addresses[0].describe()} failed in {method}: "
                                f"{describe_local_error(error)}") from None
        finally:
            self._current = None
        self.deadlines.observe(method, time.monotonic() - started)
        return result

    # -- the watchdog -------------------------------------------------------------------------------
    def _watch(self) -> None:
        while not self._closed.wait(_WATCH_INTERVAL_SECONDS):
            call = self._current
            if call is not None and time.monotonic() - call.started > call.seconds:
                self._end_hung_run(call)

    def _end_hung_run(self, call: _Call) -> None:
        """The rank's thread is stuck in `call` and cannot be interrupted: report, clean up, exit."""
        frame = sys._current_frames().get(call.thread)
        where = (f"; it was at {os.path.basename(frame.f_code.co_filename)}:{frame.f_lineno} in "
                 f"{frame.f_code.co_name}") if frame is not None else ""
        try:
            self._on_hang(f"{self.addresses[0].describe()} stopped responding in {call.method}: it did not "
                          f"finish within {deadline_text(call.method, call.seconds)}{where}")
        finally:
            with contextlib.suppress(Exception):
                self.shm_segments.update(mapped_shm_segments([os.getpid()]))
                remove_shm_segments(self.shm_segments, master_port=self.master_port)
            # Python children (Megatron's checkpoint writer starts a multiprocessing Manager) would outlive os._exit.
            sigkill_rank_processes(descendants([os.getpid()]))
            with contextlib.suppress(Exception):
                sys.stdout.flush()
                sys.stderr.flush()
            os._exit(HUNG_EXIT_CODE)

    # -- endings ------------------------------------------------------------------------------------
    def _close_ranks(self) -> None:
        """The rank closes its engines (vLLM first, see _close_vllm); kill() then cleans up."""
        self.deadlines.base["shutdown"] = GRACEFUL_SHUTDOWN_SECONDS
        self._guarded("shutdown", self._close_vllm)
        self.call("shutdown")

    def kill(self) -> None:
        """End the rank from any state it was left in (raised, interrupted): stop watching, close vLLM and
        the process groups, unlink the shared-memory segments vLLM made. Its objects go with this process."""
        import torch.distributed as dist

        self._closed.set()
        with contextlib.suppress(Exception):
            self._close_vllm()
        with contextlib.suppress(Exception):
            if dist.is_initialized():
                dist.destroy_process_group()
        self.shm_segments.update(mapped_shm_segments([os.getpid()]))
        remove_shm_segments(self.shm_segments, master_port=self.master_port)

    def _close_vllm(self) -> None:
        """vLLM destroys its groups in a finalizer at exit, which raises once they are gone: close it first.
        A Ray rank is killed instead, and never gets there."""
        engine = getattr(getattr(self, "worker", None), "inference_model", None)
        if engine is not None:
            engine.shutdown()
        state = sys.modules.get("vllm.distributed.parallel_state")
        if state is not None:  # also the groups of an engine whose start was interrupted
            state.destroy_model_parallel()
            state.destroy_distributed_environment()
