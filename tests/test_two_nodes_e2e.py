"""End to end on two Ray nodes: the CLI joins a cluster (`runtime.ray_address`, `+num_gpus_per_node=1`) whose
ranks land on two nodes with distinct addresses, and loses one of them mid-iteration.

* Colocated, Megatron TP2 across the node boundary, vLLM TP1 x DP2 (one engine per node): 2 iterations with
  a checkpoint at iteration 1; the ranks report different node addresses.
* A resume from that checkpoint reaches the first run's iteration 2 exactly (every metric but timing and
  memory); during its iteration 3 node 1's raylet is SIGKILLed: the driver names the node and its rank in one
  line, exits 1 within 60 s, and node 1 keeps no process and no /dev/shm segment of the job.
* Node 1 back, a run with `runtime.max_restarts=1` loses it in iteration 2: the two ranks no longer fit the head, so
  the restart waits for node 1 (started again by the test), then resumes from its iteration-1 checkpoint into the
  first run's metrics.
* Disaggregated: training on one node, vLLM on the other, 2 iterations with the weight push between them: each
  push moves exactly the model's bytes (counted from the checkpoint file), every range verified, vLLM's log-probs
  equal Megatron's (what tests/test_disaggregated_e2e.py checked on one node, before the suite's time budget moved
  it here).

Runs where: a two-node Ray cluster on this machine (tests/two_nodes.py): node 1 in network, mount, UTS and PID
namespaces of its own (its address over a veth pair, its own /dev/shm and hostname); where namespaces cannot be
made (not root; or MINDSPEED_RL_TWO_NODES=loopback), two raylets on 127.0.0.2 and 127.0.0.3 sharing everything
else, and the /dev/shm check is skipped; skipped where neither works. Each node has 1 logical CPU, so a job of
2 one-CPU slots must use both. The cluster's start and three CLI runs one after the other: 4.8-6.5 min measured
on this 2-core machine while other test runs loaded it (load average 12-32); not measured idle.
"""
import contextlib
import json
import os
import re
import signal
import time

import pytest
from safetensors.torch import load_file

from cli_runner import run_cli
from run_watch import launch
from two_nodes import ClusterUnavailable, two_nodes

pytestmark = pytest.mark.multinode  # `make test-multinode` (.ci/run runs it after `make test`)

COLOCATED = "grpo_tiny_cpu_tp2_infer_dp2"
# Wall-clock and memory figures differ between any two runs; everything else must be equal.
VOLATILE_PREFIXES = ("timing/", "memory/", "offload/")
VOLATILE_SUFFIXES = ("_tps", "seconds")
SETTLE_SECONDS = 10.0
INIT_LINE = re.compile(r"\[init\] (?:(actor_train|actor_infer) )?rank (\d+) \(host ([^,]+), pid (\d+)\) on node (\S+)")


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    # MINDSPEED_RL_TWO_NODES=loopback runs the fallback where namespaces would work.
    netns = os.environ.get("MINDSPEED_RL_TWO_NODES", "netns") != "loopback"
    with contextlib.ExitStack() as stack:
        try:
            running = stack.enter_context(two_nodes(tmp_path_factory.mktemp("cluster"), netns=netns))
        except ClusterUnavailable as error:
            pytest.skip(str(error))
        yield running


def _on(cluster, assets, *overrides: str) -> tuple[str, ...]:
    return (f"runtime.ray_address={cluster.address}", "+num_gpus_per_node=1", f"synthetic_data.data_dir={assets}",
            *overrides)


def _ranks_by_node(stdout: str) -> dict[str, list[str]]:
    """node address -> the ranks the workers reported there (`[init] rank R (host H, pid P) on node IP`)."""
    nodes: dict[str, list[str]] = {}
    for role, rank, _, _, ip in INIT_LINE.findall(stdout):
        nodes.setdefault(ip, []).append(f"{role + ' ' if role else ''}rank {rank}")
    return nodes


def _records(path):
    return [{k: v for k, v in json.loads(line).items()
             if not k.startswith(VOLATILE_PREFIXES) and not k.endswith(VOLATILE_SUFFIXES)}
            for line in path.read_text().splitlines()]


@pytest.fixture(scope="module")
def first_run(cluster, tmp_path_factory):
    tmp_path = tmp_path_factory.mktemp("colocated")
    save = tmp_path / "save"
    done = run_cli(tmp_path, COLOCATED, *_on(cluster, tmp_path / "assets", "megatron_training.train_iters=2",
                                             "megatron_training.save_interval=1", f"actor_config.save={save}"))
    assert done.returncode == 0, done.stderr[-3000:]
    return tmp_path, done


def test_colocated_ranks_span_both_nodes(cluster, first_run):
    tmp_path, done = first_run
    nodes = _ranks_by_node(done.stdout)
    assert sorted(nodes) == sorted(node.ip for node in cluster.nodes), done.stdout[-3000:]
    assert all(len(ranks) == 1 for ranks in nodes.values()), nodes
    assert "2 node(s) of num_gpus_per_node=1" in done.stdout
    assert [r["iteration"] for r in _records(tmp_path / "run" / "metrics.jsonl")] == [1, 2]
    assert (tmp_path / "save" / "iter_0000001").is_dir()


def test_disaggregated_training_and_inference_on_different_nodes(cluster, tmp_path):
    done = run_cli(tmp_path, "grpo_tiny_cpu_disaggregated",
                   *_on(cluster, tmp_path / "assets", "megatron_training.train_iters=2"))
    assert done.returncode == 0, done.stderr[-3000:]
    nodes = _ranks_by_node(done.stdout)
    assert sorted(nodes) == sorted(node.ip for node in cluster.nodes), done.stdout[-3000:]
    assert sorted(rank for ranks in nodes.values() for rank in ranks) == ["actor_infer rank 0", "actor_train rank 0"]
    assert "[resources] disaggregated: actor_train on device(s) 0, actor_infer on device(s) 1" in done.stdout
    metrics = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [m["iteration"] for m in metrics] == [1, 2]
    # Infer TP1 holds every HF tensor once and nothing is local in this mode: each push moves exactly the model's
    # parameter bytes, counted from the checkpoint file (not from the plan).
    model_bytes = sum(t.numel() * t.element_size() for t in load_file(str(next((tmp_path / "assets").rglob(
        "*.safetensors")))).values())
    for m in metrics:  # the push crossed the nodes whole, verified, and vLLM samples with the trained weights
        assert m["resharding/bytes_received_all_ranks"] == m["resharding/planned_bytes_received_all_ranks"] == model_bytes
        assert m["resharding/bytes_sent_all_ranks"] == model_bytes
        assert m["resharding/ranges_verified"] > 0
        assert m["rollout/logprob_max_abs_diff"] < 1e-4
    assert metrics[-1]["actor/kl_loss"] > 0  # the second push carried updated weights


def test_a_resume_matches_and_then_losing_node_1_ends_the_run_naming_it(cluster, first_run, tmp_path):
    """It leaves the cluster with one node; the next test starts node 1 again."""
    first, _ = first_run
    node1 = cluster.nodes[1]
    shm_before = node1.shm_entries()
    # Rank 0 sleeps in the update of iteration 3 (the resumed run's second): the run is mid-iteration when
    # node 1 goes, whichever rank is there.
    run = launch(tmp_path, COLOCATED, *_on(cluster, first / "assets", "megatron_training.train_iters=3",
                                           f"actor_config.load={first / 'save' / 'iter_0000001'}",
                                           "actor_config.finetune=false"),
                 env={"MINDSPEED_RL_INJECT_FAULT": "update:0:2:sleep",
                      "MINDSPEED_RL_INJECT_FAULT_LOG": str(tmp_path / "faults.log")})
    run.wait_for(f"[checkpoint] loaded {first / 'save' / 'iter_0000001'} (resuming")
    run.wait_for_file_line(tmp_path / "faults.log", "[fault] rank 0: sleep in update")
    os.kill(node1.raylet_pid(), signal.SIGKILL)
    killed = time.monotonic()
    code, ended = run.finish(timeout=120)
    stdout, stderr = run.stdout_text(), run.stderr_text()
    got = _records(tmp_path / "run" / "metrics.jsonl")
    assert [r["iteration"] for r in got] == [2]
    assert got == _records(first / "run" / "metrics.jsonl")[1:]

    lines = [line for line in stderr.splitlines() if line.strip()]
    print(f"\n[two nodes] {cluster.mode}: {_ranks_by_node(stdout)}; exit {ended - killed:.1f} s after the kill: "
          f"{lines[-1]}")
    lost = _ranks_by_node(stdout)[node1.ip]
    assert code == 1
    assert lines[-1].startswith(f"worker failure during iteration 3: node {node1.ip} was lost "
                                f"({', '.join(lost)} ran there): {lost[0]} (host {node1.hostname}, pid "), lines[-1]
    assert "Traceback" not in stderr
    assert ended - killed < 60
    # Nothing of the job is left on node 1: its processes end with their raylet (give them a moment), and no
    # shm segment of theirs stays (node 1's /dev/shm is its own only in namespaces).
    end = time.monotonic() + SETTLE_SECONDS
    while node1.job_pids() and time.monotonic() < end:
        time.sleep(0.2)
    assert not node1.job_pids(), node1.job_pids()
    if cluster.mode == "netns":
        assert node1.shm_entries() - shm_before == set()


def test_a_run_that_loses_node_1_waits_for_it_and_resumes_into_the_first_run(cluster, first_run, tmp_path):
    """After the test above (node 1 gone): node 1 comes back; a run with runtime.max_restarts=1 loses it again in its
    iteration 2, the layout (one CPU per node, two ranks) no longer fits the head alone, so the restart waits until
    node 1 returns, then resumes from the iteration-1 checkpoint: both iterations equal the first run's."""
    first, _ = first_run
    node1 = cluster.restart_node1()
    run = launch(tmp_path, COLOCATED, *_on(cluster, first / "assets", "megatron_training.train_iters=2",
                                           "megatron_training.save_interval=1", f"actor_config.save={tmp_path / 'save'}",
                                           "runtime.max_restarts=1", "runtime.restart_wait_seconds=300"),
                 env={"MINDSPEED_RL_INJECT_FAULT": "update:0:2:sleep:x1",
                      "MINDSPEED_RL_INJECT_FAULT_LOG": str(tmp_path / "faults.log")})
    run.wait_for_file_line(tmp_path / "faults.log", "[fault] rank 0: sleep in update")
    os.kill(node1.raylet_pid(), signal.SIGKILL)
    killed = time.monotonic()
    run.wait_for(f"[restart] 1 of 1 after worker failure during iteration 2: node {node1.ip} was lost", timeout=120)
    cluster.restart_node1()
    back = time.monotonic()
    resumed = run.wait_for("[restart] 1: resuming at iteration 2", timeout=400)
    code, _ = run.finish(timeout=300)
    assert code == 0, run.stderr_text()[-3000:]
    print(f"\n[two nodes] restart: node 1 back {back - killed:.1f} s after the kill, iteration 2 resumed "
          f"{resumed - back:.1f} s later")
    assert f"; resuming from iteration 2 ({tmp_path / 'save' / 'iter_0000001'})" in run.stdout_text()

    def without_restarts(records):
        return [{k: v for k, v in record.items() if k != "restarts"} for record in records]

    assert without_restarts(_records(tmp_path / "run" / "metrics.jsonl")) == \
        without_restarts(_records(first / "run" / "metrics.jsonl"))
