"""The rank processes as operating-system processes: their environment, finding and ending them, and the
shared-memory segments they leave behind. Used by every rank group (in-process, Ray, disaggregated) and
by the ranks themselves (each reports the segments it maps)."""
from __future__ import annotations

import contextlib
import os
import signal
import socket
import time

from mindspeed_rl.engines.vllm_cpu_process import remove_cpu_shm_segments


def free_port(host: str = "127.0.0.1") -> int:
    """A port free now on `host` of this machine ("": every interface, as a rendezvous server listens)."""
    with socket.socket() as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


def rank_env_vars(threads_per_rank: int) -> dict[str, str]:
    """The environment of a rank process (a Ray runtime_env, or this process for an in-process rank)."""
    return {
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
        # torch records every collective with its Python and C++ traceback (~3.2 KB) in a ring of 2000 by default:
        # ~6.4 MB per process that fills for the first ~1000 demo iterations (benchmarks/bench_soak.py). The last
        # 256 still say which collective a hung rank is in.
        "TORCH_FR_BUFFER_SIZE": os.environ.get("TORCH_FR_BUFFER_SIZE", "256"),
    }


def wait_for_exit(pids: list[int], *, timeout_seconds: float) -> None:
    """Ray's kill is asynchronous; wait for the local processes, then SIGKILL what is left."""
    end = time.monotonic() + timeout_seconds
    alive = list(pids)
    while alive and time.monotonic() < end:
        alive = [pid for pid in alive if is_running(pid)]
        if alive:
            time.sleep(0.1)
    sigkill_rank_processes(alive)


def sigkill_rank_processes(pids: list[int]) -> None:
    for pid in pids:
        try:
            # Not a reused pid: a rank ("ray::...") or one of the Python children it started.
            cmdline = open(f"/proc/{pid}/cmdline", "rb").read()
        except OSError:
            continue
        if b"ray::" in cmdline or b"python" in cmdline:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, signal.SIGKILL)


def descendants(pids: list[int]) -> list[int]:
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


# Set in every rank process of a group (its run key) and so inherited by whatever the rank starts: a rank killed
# outright orphans its children (Megatron's checkpoint writer's Manager, Python's resource tracker), which its pid
# no longer leads to.
RANK_GROUP_ENV_VAR = "MINDSPEED_RL_RANK_GROUP"


def processes_of_group(run_key: str) -> list[int]:
    """The live local processes whose environment carries `run_key` (RANK_GROUP_ENV_VAR)."""
    tag = f"{RANK_GROUP_ENV_VAR}={run_key}".encode()
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit() and int(entry) != os.getpid():
            with contextlib.suppress(OSError):
                with open(f"/proc/{entry}/environ", "rb") as handle:
                    if tag in handle.read().split(b"\0"):
                        found.append(int(entry))
    return found


def is_running(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as handle:
            return handle.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (FileNotFoundError, ProcessLookupError, IndexError):
        return False


def mapped_shm_segments(pids: list[int]) -> set[str]:
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
    for name in names:
        with contextlib.suppress(OSError):
            os.unlink(os.path.join("/dev/shm", name))
    remove_cpu_shm_segments(master_port)
