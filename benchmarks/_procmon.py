"""Watching a launched command: its process tree's memory, the machine's other load, its stdout lines.

Used by bench_vs_trl.py and profile_demo.py. ``Launched`` starts a command, timestamps every stdout line
(wall clock) and samples, every ``interval`` seconds, the summed RSS and PSS of the process and all its
descendants (Ray's gcs_server, raylet, agents and workers are descendants of our driver), the 1-minute
load average, and the CPU seconds the whole machine spent against those its tree spent, so that the load of
other processes during any window is known ("foreign" cores busy).
"""
from __future__ import annotations

import os
import subprocess
import threading
import time

import psutil


def _system_busy_seconds() -> float:
    with open("/proc/stat") as handle:
        fields = [float(x) for x in handle.readline().split()[1:]]
    idle = fields[3] + fields[4]  # idle + iowait
    return (sum(fields[:8]) - idle) / os.sysconf("SC_CLK_TCK")


def _short_name(proc: psutil.Process) -> str:
    """ray::ActorHybridWorker, raylet, gcs_server, dashboard.py, log_monitor.py, train_grpo.py, ..."""
    try:
        cmd = proc.cmdline()
    except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
        return "?"
    if not cmd:
        return proc.name()
    if cmd[0].startswith("ray::"):
        return cmd[0].split(".")[0]
    for part in cmd[:3]:
        if part.endswith(".py"):
            return os.path.basename(part)
    return os.path.basename(cmd[0])


class Launched:
    def __init__(self, argv: list[str], *, cwd: str, env: dict | None = None, interval: float = 0.2,
                 log_path: str | None = None, echo: bool = False):
        self.samples: list[dict] = []  # t, rss, pss, procs, load1, busy, tree_cpu
        self.lines: list[tuple[float, str]] = []
        self._cpu_by_pid: dict[int, float] = {}
        self._names: dict[int, str] = {}
        self._interval = interval
        self._echo = echo
        self._log = open(log_path, "w") if log_path else None
        self.launched_at = time.time()
        self.proc = subprocess.Popen(argv, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                     text=True, bufsize=1, start_new_session=True)
        self._stop = threading.Event()
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._sampler = threading.Thread(target=self._sample_loop, daemon=True)
        self._reader.start()
        self._sampler.start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            now = time.time()
            self.lines.append((now, line.rstrip("\n")))
            if self._log:
                self._log.write(f"{now - self.launched_at:9.3f} {line}")
            if self._echo:
                print(f"    | {line}", end="", flush=True)

    def _sample_loop(self) -> None:
        tick = 0
        while not self._stop.is_set():
            self._sample(with_pss=tick % 5 == 0)
            tick += 1
            self._stop.wait(self._interval)

    def _sample(self, *, with_pss: bool) -> None:
        try:
            root = psutil.Process(self.proc.pid)
            procs = [root] + root.children(recursive=True)
        except psutil.NoSuchProcess:
            return
        rss = pss = 0
        rss_by_pid = {}
        for p in procs:
            try:
                if with_pss:
                    info = p.memory_full_info()
                    rss += info.rss
                    pss += info.pss
                else:
                    info = p.memory_info()
                    rss += info.rss
                rss_by_pid[p.pid] = info.rss
                times = p.cpu_times()
                self._cpu_by_pid[p.pid] = times.user + times.system
                if with_pss or p.pid not in self._names:  # Ray renames a worker once it hosts an actor
                    name = _short_name(p)
                    if name != "?" or p.pid not in self._names:
                        self._names[p.pid] = name
            except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
                continue
        self.samples.append(dict(t=time.time(), rss=rss, pss=pss if with_pss else None, procs=len(procs),
                                 load1=os.getloadavg()[0], busy=_system_busy_seconds(),
                                 tree_cpu=sum(self._cpu_by_pid.values()), per_pid=dict(self._cpu_by_pid),
                                 rss_by_pid=rss_by_pid))

    def wait(self, timeout: float | None = None) -> int:
        try:
            code = self.proc.wait(timeout=timeout)
        finally:
            self._stop.set()
            self._sampler.join()
            self._reader.join(timeout=5)
            if self._log:
                self._log.close()
        return code

    def kill(self) -> None:
        """The whole session of the command (it was started in a new one), children included."""
        try:
            os.killpg(self.proc.pid, 9)
        except ProcessLookupError:
            pass

    # -- summaries -------------------------------------------------------------------------------
    def peak_memory(self) -> dict:
        if not self.samples:
            return {}
        rss = max(self.samples, key=lambda s: s["rss"])
        pss_samples = [s for s in self.samples if s["pss"] is not None]
        pss = max(pss_samples, key=lambda s: s["pss"]) if pss_samples else None
        by_name: dict[str, float] = {}
        for pid, nbytes in rss.get("rss_by_pid", {}).items():
            name = self._names.get(pid, str(pid))
            by_name[name] = by_name.get(name, 0.0) + nbytes / 2**20
        return {"peak_rss_sum_mib": rss["rss"] / 2**20, "processes_at_peak_rss": rss["procs"],
                "rss_mib_by_process_at_peak": {k: round(v) for k, v in sorted(by_name.items(), key=lambda kv: -kv[1])},
                "peak_pss_sum_mib": pss["pss"] / 2**20 if pss else None,
                "max_processes": max(s["procs"] for s in self.samples)}

    def load(self, start: float | None = None, end: float | None = None) -> dict:
        """Load during [start, end] (wall clock; default the whole run): the load average seen, and the cores
        that processes outside this command's tree kept busy on average (the machine's CPU seconds minus the
        tree's, over the window)."""
        window = [s for s in self.samples if (start is None or s["t"] >= start) and (end is None or s["t"] <= end)]
        if len(window) < 2:
            return {}
        first, last = window[0], window[-1]
        wall = last["t"] - first["t"]
        busy = last["busy"] - first["busy"]
        own = last["tree_cpu"] - first["tree_cpu"]
        by_process: dict[str, float] = {}
        for pid, cpu in last["per_pid"].items():
            spent = cpu - first["per_pid"].get(pid, 0.0)
            name = self._names.get(pid, str(pid))
            by_process[name] = by_process.get(name, 0.0) + spent
        return {"seconds": wall, "load1_min": min(s["load1"] for s in window),
                "load1_max": max(s["load1"] for s in window),
                "own_cores_busy": own / wall if wall > 0 else None,
                "foreign_cores_busy": max(0.0, busy - own) / wall if wall > 0 else None,
                "cpu_seconds_by_process": {k: round(v, 3) for k, v in sorted(by_process.items(), key=lambda kv: -kv[1])}}

    def foreign_cores(self, start: float, end: float) -> float | None:
        """Cores kept busy by processes outside the tree between the samples that bracket [start, end]."""
        before = [x for x in self.samples if x["t"] <= start]
        after = [x for x in self.samples if x["t"] >= end]
        if not before or not after:
            return None
        a, b = before[-1], after[0]
        wall = b["t"] - a["t"]
        if wall <= 0:
            return None
        return max(0.0, (b["busy"] - a["busy"]) - (b["tree_cpu"] - a["tree_cpu"])) / wall

    def first_line(self, prefix: str, contains: str = "") -> float | None:
        for t, line in self.lines:
            if prefix in line and contains in line:
                return t
        return None
