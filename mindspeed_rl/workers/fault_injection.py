"""Faults on purpose, for the failure tests: `MINDSPEED_RL_INJECT_FAULT=[ROLE/]METHOD:RANK:CALL:ACTION`.

The CALL-th call (1-based) of worker METHOD on rank RANK, before it runs, does ACTION:
  raise  - raises RuntimeError (a bug in a worker)
  kill   - SIGKILLs its own process (a crash, the OOM killer)
  stop   - SIGSTOPs its own process (a hang: the process is alive and does nothing)
  sleep  - sleeps for an hour (a long phase; the test sends Ctrl-C / SIGTERM meanwhile)
  full_disk - limits its own process's files to 1 MB (RLIMIT_FSIZE, SIGXFSZ ignored): from then on a write past
           it fails as on a full disk (EFBIG), whichever directory it goes to
ROLE (`actor_train`, `actor_infer`, `critic`) picks one group (of a disaggregated actor, or a critic on devices of its
own), the groups sharing the method names; without it every group's ranks qualify.
A one-rank run's rank is the driver process itself (workers/local_group.py): `kill` and `stop` hit the
driver too, which is why the tests of those actions run 2 ranks or set runtime.local_single_rank=false.
Each action first prints `[fault] rank R: ACTION in METHOD`, and appends it to the file named by
`MINDSPEED_RL_INJECT_FAULT_LOG` when set: Ray forwards a worker's output to the driver a little later,
after a driver that fails fast may be gone, so a test watches the file. Unset (the normal case), the
rank group factory (workers/start.py) uses the production worker classes unchanged.
"""
from __future__ import annotations

import functools
import os
import signal
import time
from dataclasses import dataclass

FAULT_ENV_VAR = "MINDSPEED_RL_INJECT_FAULT"
FAULT_LOG_ENV_VAR = "MINDSPEED_RL_INJECT_FAULT_LOG"
ACTIONS = ("raise", "kill", "stop", "sleep", "full_disk")
FULL_DISK_BYTES = 1_000_000


@dataclass(frozen=True, kw_only=True)
class FaultSpec:
    method: str
    rank: int
    call: int
    action: str
    role: str = ""  # "": any group

    @classmethod
    def parse(cls, text: str) -> "FaultSpec":
        parts = text.split(":")
        if len(parts) != 4 or parts[3] not in ACTIONS or not parts[1].isdigit() or not parts[2].isdigit():
            raise ValueError(f"{FAULT_ENV_VAR}={text!r}: expected [ROLE/]METHOD:RANK:CALL:ACTION with ACTION in "
                             f"{ACTIONS}")
        role, _, method = parts[0].rpartition("/")
        return cls(method=method, rank=int(parts[1]), call=int(parts[2]), action=parts[3], role=role)


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
    if spec.action == "full_disk":
        import resource

        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # else the kernel kills the writer at the limit
        resource.setrlimit(resource.RLIMIT_FSIZE, (FULL_DISK_BYTES, resource.getrlimit(resource.RLIMIT_FSIZE)[1]))


def worker_class_with_faults(text: str | None, base: type) -> type:
    """`base`, or where a fault is asked for that this class has (its method, its role), a subclass whose
    METHOD injects it."""
    if not text:
        return base
    spec = FaultSpec.parse(text)
    original = getattr(base, spec.method, None)
    if original is None or spec.role not in ("", getattr(base, "ROLE", "")):
        return base

    @functools.wraps(original)
    def method(self, *args, **kwargs):
        calls = self.__dict__.setdefault("_fault_calls", 0) + 1
        self._fault_calls = calls
        if self.rank_info.rank == spec.rank and calls == spec.call:
            inject(spec, self.rank_info.rank)
        return original(self, *args, **kwargs)

    return type(f"FaultInjecting{base.__name__}", (base,), {spec.method: method})
