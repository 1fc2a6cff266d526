"""Faults on purpose, for the failure tests: `MINDSPEED_RL_INJECT_FAULT=METHOD:RANK:CALL:ACTION`.

The CALL-th call (1-based) of worker METHOD on rank RANK, before it runs, does ACTION:
  raise  - raises RuntimeError (a bug in a worker)
  kill   - SIGKILLs its own process (a crash, the OOM killer)
  stop   - SIGSTOPs its own process (a hang: the process is alive and does nothing)
  sleep  - sleeps for an hour (a long phase; the test sends Ctrl-C / SIGTERM meanwhile)
A one-rank run's rank is the driver process itself (workers/local_group.py): `kill` and `stop` hit the
driver too, which is why the tests of those actions run 2 ranks or set runtime.local_single_rank=false.
Each action first prints `[fault] rank R: ACTION in METHOD`, and appends it to the file named by
`MINDSPEED_RL_INJECT_FAULT_LOG` when set: Ray forwards a worker's output to the driver a little later,
after a driver that fails fast may be gone, so a test watches the file. Unset (the normal case), the
production worker class is used unchanged.
"""
from __future__ import annotations

import functools
import os
import signal
import time
from dataclasses import dataclass

FAULT_ENV_VAR = "MINDSPEED_RL_INJECT_FAULT"
FAULT_LOG_ENV_VAR = "MINDSPEED_RL_INJECT_FAULT_LOG"
ACTIONS = ("raise", "kill", "stop", "sleep")


@dataclass(frozen=True, kw_only=True)
class FaultSpec:
    method: str
    rank: int
    call: int
    action: str

    @classmethod
    def parse(cls, text: str) -> "FaultSpec":
        parts = text.split(":")
        if len(parts) != 4 or parts[3] not in ACTIONS or not parts[1].isdigit() or not parts[2].isdigit():
            raise ValueError(f"{FAULT_ENV_VAR}={text!r}: expected METHOD:RANK:CALL:ACTION with ACTION in {ACTIONS}")
        return cls(method=parts[0], rank=int(parts[1]), call=int(parts[2]), action=parts[3])


def inject(spec: FaultSpec, rank: int) -> None:
    line = f"[fault] rank {rank}: {spec.action} in {spec.method}"
    print(line, flush=True)
    if os.environ.get(FAULT_LOG_ENV_VAR):
        with open(os.environ[FAULT_LOG_ENV_VAR], "a") as log:
            log.write(line + "\n")
            log.flush()
            os.fsync(log.fileno())
    if spec.action == "raise":
        raise RuntimeError(f"injected fault in {spec.method} on rank {rank}")
    if spec.action == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    if spec.action == "stop":
        os.kill(os.getpid(), signal.SIGSTOP)
    if spec.action == "sleep":
        time.sleep(3600)


def worker_class_with_faults(text: str | None, base: type | None = None, *, remote: bool = True):
    """A Ray actor class (a subclass of `base`, by default the hybrid worker) whose METHOD injects the
    fault, or with remote=False the plain class (a rank in the driver, workers/local_group.py); None
    when no fault is asked for or `base` has no such method (the other group of a disaggregated actor)."""
    if not text:
        return None
    from mindspeed_rl.workers.actor_hybrid_worker import ActorHybridWorkerBase

    base = base or ActorHybridWorkerBase
    spec = FaultSpec.parse(text)
    original = getattr(base, spec.method, None)
    if original is None:
        return None

    @functools.wraps(original)
    def method(self, *args, **kwargs):
        calls = self.__dict__.setdefault("_fault_calls", 0) + 1
        self._fault_calls = calls
        if self.rank_info.rank == spec.rank and calls == spec.call:
            inject(spec, self.rank_info.rank)
        return original(self, *args, **kwargs)

    faulty = type(f"FaultInjecting{base.__name__}", (base,), {spec.method: method})
    if not remote:
        return faulty
    import ray

    return ray.remote(faulty)
