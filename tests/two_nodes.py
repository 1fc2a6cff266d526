"""A real two-node Ray cluster on this one machine, for tests/test_two_nodes_e2e.py.

Node 0 is the Ray head in this network namespace, on the host side of a veth pair (10.77.N.1); node 1 is
a second raylet (`ray start --address=HEAD`) on the other side (10.77.N.2), inside namespaces of its own:
network (its address), mount (a private tmpfs on /dev/shm, so the nodes share no shared memory, and an
/etc/hosts where its hostname resolves to its address, as on a real machine), UTS (its own hostname) and
PID (its processes are seen from here only through /proc/<pid>/ns; one kill of its init ends them all).
Both nodes share the file system, as nodes share the checkpoint storage of a real cluster.

Where namespaces cannot be made (not root, no `ip netns`), the fallback is two raylets on distinct loopback
addresses (127.0.0.2 and 127.0.0.3) that share everything but the address: `mode` says which one runs.

`ray stop` is never used: it ends every Ray process of the machine (other runs' too). Each node's
processes are started in a session of their own and ended by it; node 1's by its PID namespace.
"""
from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
RAY = str(Path(sys.executable).with_name("ray"))
START_TIMEOUT_SECONDS = 120.0
# Ray's daemons, not a job's processes: they outlive a job and are ended with the node.
RAY_DAEMON_MARKERS = ("raylet", "gcs_server", "log_monitor", "dashboard", "DashboardAgent", "RuntimeEnvAgent",
                      "ray.util.client.server", "ray/autoscaler", "monitor.py", "ray start")
# PID 1 of node 1's namespace: mounts its /dev/shm and /etc/hosts, names the host, starts the raylet, then
# reaps orphans until it is killed (which ends every process of the namespace).
_NODE1_INIT = r"""
import os, subprocess, sys, time
hosts, hostname, cmd = sys.argv[1], sys.argv[2], sys.argv[3:]
subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1g", "ray_node_init_shm", "/dev/shm"], check=True)
subprocess.run(["mount", "--bind", hosts, "/etc/hosts"], check=True)
subprocess.run(["hostname", hostname], check=True)
code = subprocess.call(cmd)
print(f"ray start exited {code}", flush=True)
while True:
    try:
        os.wait()
    except ChildProcessError:
        if code:
            sys.exit(code)
        time.sleep(1)
"""


@dataclass
class Node:
    ip: str
    hostname: str
    session: subprocess.Popen  # `ray start` (node 0) or the namespace's init (node 1)
    # node 1 in namespaces: the inode of its PID namespace, else None (its session names its processes)
    pid_namespace: str | None = None
    launcher: subprocess.Popen | None = None  # node 1 in namespaces: `ip netns exec ... unshare`, reaped at the end

    def pids(self) -> dict[int, str]:
        """This node's live processes (pid as seen here -> command line)."""
        found = {}
        for entry in filter(str.isdigit, os.listdir("/proc")):
            with contextlib.suppress(OSError, IndexError):
                stat = Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()
                if stat[0] == "Z" or not self._owns(int(entry), int(stat[3])):
                    continue
                found[int(entry)] = Path(f"/proc/{entry}/cmdline").read_bytes().replace(b"\0", b" ").decode().strip()
        return found

    def _owns(self, pid: int, session_id: int) -> bool:
        if self.pid_namespace is not None:
            return os.readlink(f"/proc/{pid}/ns/pid") == self.pid_namespace and pid != self.session.pid
        return session_id == self.session.pid

    def job_pids(self) -> dict[int, str]:
        """Processes of a job on this node: everything but Ray's own daemons."""
        return {pid: cmd for pid, cmd in self.pids().items() if not any(m in cmd for m in RAY_DAEMON_MARKERS)}

    def raylet_pid(self) -> int:
        return next(pid for pid, cmd in self.pids().items() if "/raylet" in cmd.split(" ", 1)[0])

    def shm_entries(self) -> set[str]:
        """/dev/shm as this node sees it (node 1's private tmpfs through its init's root)."""
        root = f"/proc/{self.session.pid}/root" if self.pid_namespace else ""
        with contextlib.suppress(OSError):
            return set(os.listdir(f"{root}/dev/shm"))
        return set()


@dataclass
class TwoNodes:
    mode: str  # "netns" or "loopback"
    address: str  # runtime.ray_address
    nodes: list[Node] = field(default_factory=list)
    work_dir: Path | None = None
    namespace: str | None = None  # node 1's network namespace (netns mode)
    cpus_per_node: int = 1

    def restart_node1(self) -> Node:
        """Node 1 ended (whatever of it is left) and started again at its address, as a machine that comes back:
        a new raylet joins the head."""
        old = self.nodes[1]
        _end_node(old)
        log = self.work_dir / "node1_restarted.log"
        if self.namespace:
            node = _start_node1_in_namespaces(self.namespace, old.ip, self.address, self.cpus_per_node, self.work_dir,
                                              log)
        else:
            node = _start_node1_on_loopback(old.ip, self.address, self.cpus_per_node, log)
        self.nodes[1] = node
        return node


def _run(*cmd: str) -> None:
    subprocess.run(cmd, check=True, capture_output=True, text=True, timeout=30)


def _free_subnet() -> int:
    """N of a 10.77.N.0/24 no interface of this machine uses (another run of these tests may hold one)."""
    used = subprocess.run(["ip", "-4", "-o", "addr"], capture_output=True, text=True).stdout
    return next(n for n in [os.getpid() % 200 + 1, *range(1, 255)] if f"10.77.{n}." not in used)


# Ports Ray's components take by default whatever else is asked (the dashboard agent's HTTP port, the dashboard, the
# client server, GCS): a port picked for the head must not be one of them (a run once drew 52365).
_RAY_DEFAULT_PORTS = frozenset({52365, 8265, 10001, 6379, 44217, 44227})


def _free_port(host: str) -> int:
    while True:
        with socket.socket() as sock:
            sock.bind((host, 0))
            port = sock.getsockname()[1]
        if port not in _RAY_DEFAULT_PORTS:
            return port


def _ray_env() -> dict[str, str]:
    # The same start-up allowances as the driver's (mindspeed_rl/trainer/setup.py start_ray).
    return {**os.environ, "RAY_agent_register_timeout_ms": "120000", "RAY_USAGE_STATS_ENABLED": "0",
            "RAY_ACCEL_ENV_VAR_OVERRIDE_ON_ZERO": "0", "RAY_prestart_worker_first_driver": "0"}


def _ray_start_args(num_cpus: int) -> list[str]:
    return [RAY, "start", f"--num-cpus={num_cpus}", "--num-gpus=0", "--disable-usage-stats",
            f"--object-store-memory={200 * 1024 * 1024}"]


def _start_head(ip: str, num_cpus: int, temp_dir: Path, log: Path) -> tuple[Node, str]:
    port = _free_port(ip)
    # Its own temp dir: `ray start --head` records its address there, where a plain ray.init() of another
    # run on this machine would otherwise find and join it.
    cmd = [*_ray_start_args(num_cpus), "--head", f"--node-ip-address={ip}", f"--port={port}",
           "--include-dashboard=false", f"--temp-dir={temp_dir}", f"--ray-client-server-port={_free_port(ip)}"]
    process = subprocess.Popen(cmd, stdout=log.open("w"), stderr=subprocess.STDOUT, start_new_session=True,
                               env=_ray_env(), cwd=REPO)
    if process.wait(timeout=START_TIMEOUT_SECONDS) != 0:
        raise RuntimeError(f"ray start --head failed: {log.read_text()[-2000:]}")
    return Node(ip=ip, hostname=socket.gethostname(), session=process), f"{ip}:{port}"


def _make_network(subnet: int, tag: str) -> tuple[str, str, str]:
    """(namespace, host-side veth, node-1-side veth) with 10.77.N.1 here and 10.77.N.2 in the namespace."""
    namespace, here, there = f"msrl2n-{tag}", f"msrl{tag}a", f"msrl{tag}b"  # interface names: 15 chars at most
    _run("ip", "netns", "add", namespace)
    try:
        _run("ip", "link", "add", here, "type", "veth", "peer", "name", there)
        _run("ip", "link", "set", there, "netns", namespace)
        _run("ip", "addr", "add", f"10.77.{subnet}.1/24", "dev", here)
        _run("ip", "link", "set", here, "up")
        inside = ("ip", "netns", "exec", namespace)
        _run(*inside, "ip", "addr", "add", f"10.77.{subnet}.2/24", "dev", there)
        _run(*inside, "ip", "link", "set", there, "up")
        _run(*inside, "ip", "link", "set", "lo", "up")
        # Node 0's other addresses (what its hostname resolves to) are reachable from node 1, as on a real network.
        _run(*inside, "ip", "route", "add", "default", "via", f"10.77.{subnet}.1")
    except BaseException:
        _remove_network(namespace, here)
        raise
    return namespace, here, there


def _remove_network(namespace: str, veth: str) -> None:
    # Deleting one end of a veth pair deletes both; deleting the namespace would too.
    subprocess.run(["ip", "link", "del", veth], capture_output=True, timeout=30)
    subprocess.run(["ip", "netns", "del", namespace], capture_output=True, timeout=30)


def _start_node1_in_namespaces(namespace: str, ip: str, head: str, num_cpus: int, work_dir: Path,
                               log: Path) -> Node:
    hostname = f"node1-{namespace.rsplit('-', 1)[1]}"
    hosts = work_dir / "node1_hosts"
    hosts.write_text(f"127.0.0.1 localhost\n{ip} {hostname}\n")
    cmd = ["ip", "netns", "exec", namespace, "unshare", "--mount", "--uts", "--pid", "--fork", "--mount-proc",
           sys.executable, "-c", _NODE1_INIT, str(hosts), hostname,
           *_ray_start_args(num_cpus), f"--address={head}", f"--node-ip-address={ip}"]
    process = subprocess.Popen(cmd, stdout=log.open("w"), stderr=subprocess.STDOUT, start_new_session=True,
                               env=_ray_env(), cwd=REPO)
    node = Node(ip=ip, hostname=hostname, session=process)
    end = time.monotonic() + START_TIMEOUT_SECONDS
    # The namespace's init is unshare's child: wait until it runs, then for `ray start` to have returned.
    while time.monotonic() < end and process.poll() is None:
        init = _child_of(process.pid)
        if init and "ray start exited 0" in log.read_text():
            node.session, node.launcher = _PidHandle(init), process
            node.pid_namespace = os.readlink(f"/proc/{init}/ns/pid")
            return node
        time.sleep(0.2)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(process.pid, signal.SIGKILL)  # unshare and the namespace's init: the namespace goes with it
    raise RuntimeError(f"node 1 did not start: {log.read_text()[-2000:]}")


def _start_node1_on_loopback(ip: str, head: str, num_cpus: int, log: Path) -> Node:
    cmd = [*_ray_start_args(num_cpus), f"--address={head}", f"--node-ip-address={ip}"]
    process = subprocess.Popen(cmd, stdout=log.open("w"), stderr=subprocess.STDOUT, start_new_session=True,
                               env=_ray_env(), cwd=REPO)
    if process.wait(timeout=START_TIMEOUT_SECONDS) != 0:
        raise RuntimeError(f"ray start (node 1) failed: {log.read_text()[-2000:]}")
    return Node(ip=ip, hostname=socket.gethostname(), session=process)


class _PidHandle:
    """The little of Popen that Node uses, for a process this one did not start (node 1's init)."""

    def __init__(self, pid: int):
        self.pid = pid


def _child_of(pid: int) -> int | None:
    with contextlib.suppress(OSError, ValueError):
        children = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
        return int(children[0]) if children else None
    return None


def _end_node(node: Node, grace_seconds: float = 5.0) -> None:
    """SIGTERM every process of the node (Ray's daemons clean up on it), SIGKILL what is left after the grace."""
    if node.pid_namespace is not None:
        # Killing a PID namespace's init kills every process in it (the kernel's doing, nothing escapes).
        with contextlib.suppress(ProcessLookupError):
            os.kill(node.session.pid, signal.SIGKILL)
        _wait_until(lambda: not node.pids(), grace_seconds)
        with contextlib.suppress(subprocess.TimeoutExpired):
            node.launcher.wait(timeout=grace_seconds)
        return
    for signum in (signal.SIGTERM, signal.SIGKILL):
        for pid in node.pids():
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signum)
        if _wait_until(lambda: not node.pids(), grace_seconds):
            return


def _wait_until(condition, timeout_seconds: float) -> bool:
    end = time.monotonic() + timeout_seconds
    while not condition():
        if time.monotonic() > end:
            return False
        time.sleep(0.1)
    return True


def netns_available() -> bool:
    return os.geteuid() == 0 and shutil.which("ip") is not None and shutil.which("unshare") is not None


class ClusterUnavailable(Exception):
    """Neither namespaces nor two loopback addresses give this machine two nodes."""


@contextlib.contextmanager
def two_nodes(work_dir: Path, *, cpus_per_node: int = 1, netns: bool = True):
    """A running two-node cluster (TwoNodes); both nodes, the namespaces and the veth pair are gone after,
    whatever happened. `cpus_per_node` logical CPUs each: with 1, a job of 2 one-CPU slots must use both.
    `netns=False` takes the loopback fallback even where namespaces work."""
    work_dir.mkdir(parents=True, exist_ok=True)
    # Ray's socket paths must stay under 108 characters: a short temp dir, not the test's.
    ray_dir = Path(tempfile.mkdtemp(prefix="msrl2n", dir="/tmp"))
    cluster, network = None, None
    try:
        if netns and netns_available():
            try:
                subnet, tag = _free_subnet(), f"{os.getpid() % 100000}"
                network = _make_network(subnet, tag)
            except (subprocess.SubprocessError, OSError):
                network = None
        # Not 127.0.0.1 for the head: Ray registers a node given that address under the machine's own address.
        head_ip, node1_ip = (f"10.77.{subnet}.1", f"10.77.{subnet}.2") if network else ("127.0.0.2", "127.0.0.3")
        head, address = _start_head(head_ip, cpus_per_node, ray_dir, work_dir / "node0.log")
        cluster = TwoNodes(mode="netns" if network else "loopback", address=address, nodes=[head], work_dir=work_dir,
                           namespace=network[0] if network else None, cpus_per_node=cpus_per_node)
        if network:
            cluster.nodes.append(_start_node1_in_namespaces(network[0], node1_ip, address, cpus_per_node, work_dir,
                                                            work_dir / "node1.log"))
        else:
            try:
                cluster.nodes.append(_start_node1_on_loopback(node1_ip, address, cpus_per_node,
                                                              work_dir / "node1.log"))
            except (RuntimeError, subprocess.SubprocessError) as error:
                raise ClusterUnavailable(f"no namespaces, and no second raylet on {node1_ip}: {error}") from None
        yield cluster
    finally:
        for node in reversed(cluster.nodes if cluster else []):
            _end_node(node)
        if network:
            _remove_network(network[0], network[1])
        shutil.rmtree(ray_dir, ignore_errors=True)


@contextlib.contextmanager
def one_node(work_dir: Path, *, num_cpus: int):
    """A one-node Ray cluster of its own for a module's CLI runs: each joins it (`runtime.ray_address=` the yielded
    address) instead of starting Ray itself, as a user's runs join their cluster. Ended, every process of it, after.
    Its head listens on 127.0.0.1's neighbour (Ray registers a node given 127.0.0.1 under the machine's address)."""
    work_dir.mkdir(parents=True, exist_ok=True)
    ray_dir = Path(tempfile.mkdtemp(prefix="msrl1n", dir="/tmp"))  # socket paths under 108 characters
    head = None
    try:
        head, address = _start_head("127.0.0.2", num_cpus, ray_dir, work_dir / "head.log")
        yield address
    finally:
        if head is not None:
            _end_node(head)
        shutil.rmtree(ray_dir, ignore_errors=True)
