"""Faults on purpose, for the failure tests: `MINDSPEED_RL_INJECT_FAULT=[ROLE/]METHOD:RANK:CALL:ACTION[:xTIMES]`.

The CALL-th call (1-based) of worker METHOD on rank RANK, before it runs, does ACTION:
  raise  - raises RuntimeError (a bug in a worker)
  kill   - SIGKILLs its own process (a crash, the OOM killer)
  stop   - SIGSTOPs its own process (a hang: the process is alive and does nothing)
  sleep  - sleeps for an hour (a long phase; the test sends Ctrl-C / SIGTERM meanwhile)
  full_disk - limits its own process's files to 1 MB (RLIMIT_FSIZE, SIGXFSZ ignored): from then on a write past
           it fails as on a full disk (EFBIG), whichever directory it goes to
Several faults: separated by `,`. xTIMES (runtime.max_restarts' tests): the fault fires at most TIMES times in the
whole run, counted in the fault log (which it then needs), whichever rank processes the restarts started; without it
every new process of that rank fires it again at its CALL-th call.
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
    times: int | None = None  # at most this many times in the run (counted in the fault log); None: no limit

    @classmethod
    def parse(cls, text: str) -> "FaultSpec":
        parts = text.split(":")
        times = parts.pop() if len(parts) == 5 and parts[4][:1] == "x" and parts[4][1:].isdigit() else None
        if len(parts) != 4 or parts[3] not in ACTIONS or not parts[1].isdigit() or not parts[2].isdigit():
            raise ValueError(f"{FAULT_ENV_VAR}={text!r}: expected [ROLE/]METHOD:RANK:CALL:ACTION[:xTIMES] with "
                             f"ACTION in {ACTIONS}")
        if times is not None and not os.environ.get(FAULT_LOG_ENV_VAR):
            raise ValueError(f"{FAULT_ENV_VAR}={text!r}: xTIMES counts in {FAULT_LOG_ENV_VAR}, which is not set")
        role, _, method = parts[0].rpartition("/")
        return cls(method=method, rank=int(parts[1]), call=int(parts[2]), action=parts[3], role=role,
                   times=int(times[1:]) if times else None)

    def line(self, rank: int) -> str:
        return f"[fault] rank {rank}: {self.action} in {self.method}"

    def spent(self, rank: int) -> bool:
        """Fired `times` times already in this run (the fault log says so)."""
        if self.times is None:
            return False
        log = os.environ[FAULT_LOG_ENV_VAR]
        fired = open(log).read().splitlines().count(self.line(rank)) if os.path.exists(log) else 0
        return fired >= self.times


def parse_faults(text: str) -> list[FaultSpec]:
    return [FaultSpec.parse(part) for part in text.split(",") if part]


def inject(spec: FaultSpec, rank: int) -> None:
    line = spec.line(rank)
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
    """`base`, or where faults are asked for that this class has (their method, their role), a subclass whose
    METHODs inject them."""
    methods = {}
    for spec in parse_faults(text or ""):
        original = methods.get(spec.method) or getattr(base, spec.method, None)
        if original is not None and spec.role in ("", getattr(base, "ROLE", "")):
            methods[spec.method] = _injecting(original, spec)
    return type(f"FaultInjecting{base.__name__}", (base,), methods) if methods else base


def _injecting(original, spec: FaultSpec):
    counter = f"_fault_calls_{spec.method}_{spec.call}_{spec.action}"

    @functools.wraps(original)
    def method(self, *args, **kwargs):
        calls = self.__dict__.setdefault(counter, 0) + 1
        setattr(self, counter, calls)
        rank = self.rank_info.rank
        if rank == spec.rank and calls == spec.call and not spec.spent(rank):
            inject(spec, rank)
        return original(self, *args, **kwargs)

    return method
