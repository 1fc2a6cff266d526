"""End to end through the CLI: a run that restarts itself (`runtime.max_restarts`) after losing a rank.

- The 2-rank demo (train PP2 -> vLLM TP2) with DAPO's dynamic sampling, 6 iterations, checkpoints every 2: rank 0 is SIGKILLed as the
  iteration-2 save starts (no checkpoint yet: the run restarts from its initial weights) and, in the second life,
  rank 1 is SIGKILLed in the update of iteration 3 (restart from iter_0000002). The run ends rc 0 with every
  iteration's metrics and the final weights and optimizer states equal to an uninterrupted run's, bit for bit (fp32
  CPU); the first life's processes are gone when the second starts, and nothing of the run is left at the end.
- One-step off-policy (the disaggregated demo, async_generation_ratio=1), 4 iterations, checkpoints every 2: the
  inference rank is SIGKILLed as the rollout of iteration 4 starts ahead (during iteration 3's update); the restart
  from iter_0000002 takes iteration 3's rollout from the checkpoint (sampled by the weights before iteration 2's
  update, which no checkpoint holds), so iterations 3-4 equal the uninterrupted run's, staleness included.
- Multi-turn tool use (the ReTool demo, one rank): a rank killed in iteration 3's update; iterations 3-4, their tool
  calls included, equal the uninterrupted run's.
- Partial rollout (the demo at partial_rollout_max_split=4, one rank): a rank killed in iteration 3's update, with
  samples carried out of iteration 2; the restart from iter_0000002 takes them from its carried_samples.json, so
  iterations 3-4 (resumed samples, token ages) equal the uninterrupted run's. Run-ahead alike (the DAPO demo at
  split 4 with async_engine, one rank): the samples its stop aborted in iteration 2 come back from the checkpoint.
- max_restarts exhausted ends as a run without restarts does (exit 1, the failure line); a failure that repeats
  at the same point after a restart stops at once, saying so.

Runs where: subprocesses (Ray, 1-2 rank processes each); ~7 min on 2 cores: `make test-restarts` (.ci/run runs
it after `make test`).
"""
import json
import os
import re

import pytest
import torch

from run_watch import launch, leftovers, shm_entries

pytestmark = pytest.mark.restarts

TWO_RANKS = "grpo_tiny_cpu_pp2_infer_tp2"
# DAPO's dynamic sampling: 8 of each rollout's 16 prompts must differ in accuracy, more rollouts drawn until they do
# (refills, each with its own sampling stream) - the sampler position and the streams must come back exactly.
DYNAMIC_SAMPLING = ("rl_config.filter_groups_enable=true", "rl_config.filter_groups_metric=acc",
                    "rl_config.filter_groups_train_batch_size=8", "rl_config.filter_groups_max_batches=-1")
SIX_ITERATIONS = ("megatron_training.train_iters=6", "megatron_training.save_interval=2", *DYNAMIC_SAMPLING)
ASYNC = ("grpo_tiny_cpu_disaggregated", "async_generation_ratio=1")
VOLATILE_PREFIXES = ("timing/", "memory/", "offload/")
VOLATILE_SUFFIXES = ("_tps", "seconds")
INIT_PID = re.compile(r"\[init\] (?:\S+ )?rank \d+ \(host [^,]+, pid (\d+)\)")


def _run(tmp_path, config: str, *overrides: str, faults: str | None = None, max_restarts: int = 0,
         script: str = "cli/train_grpo.py"):
    """The watched run; faults as MINDSPEED_RL_INJECT_FAULT, logged in tmp_path/faults.log."""
    env = {"MINDSPEED_RL_INJECT_FAULT": faults, "MINDSPEED_RL_INJECT_FAULT_LOG": str(tmp_path / "faults.log")} \
        if faults else {}
    return launch(tmp_path, config, *overrides, f"actor_config.save={tmp_path / 'save'}",
                  f"runtime.max_restarts={max_restarts}", env=env, script=script)


def _records(run_dir):
    return [{k: v for k, v in json.loads(line).items()
             if not k.startswith(VOLATILE_PREFIXES) and not k.endswith(VOLATILE_SUFFIXES) and k != "restarts"}
            for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def _restarts(run_dir) -> list[int]:
    return [json.loads(line)["restarts"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def _assert_same_checkpoint(want_dir, have_dir) -> None:
    from megatron.core import dist_checkpointing

    for part in ("model", "optimizer"):
        want = dist_checkpointing.load_plain_tensors(str(want_dir / part))
        have = dist_checkpointing.load_plain_tensors(str(have_dir / part))
        assert sorted(want) == sorted(have)
        for key, value in want.items():
            if isinstance(value, torch.Tensor):
                assert torch.equal(value, have[key]), f"{part}: {key}"


def _finished(run) -> int:
    code, _ = run.finish(timeout=600)
    assert "Traceback" not in run.stderr_text(), run.stderr_text()[-3000:]
    return code


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    tmp_path = tmp_path_factory.mktemp("restarts") / "uninterrupted"
    tmp_path.mkdir()
    run = _run(tmp_path, TWO_RANKS, *SIX_ITERATIONS)
    assert _finished(run) == 0, run.stderr_text()[-3000:]
    return tmp_path


def test_a_killed_save_and_a_killed_rank_restart_into_the_uninterrupted_run(world, uninterrupted):
    tmp_path = uninterrupted.parent / "restarted"
    tmp_path.mkdir()
    shm_before = shm_entries()
    run = _run(tmp_path, TWO_RANKS, *SIX_ITERATIONS, faults="save_checkpoint:0:1:kill:x1,update:1:3:kill:x1",
               max_restarts=2)
    run.wait_for("[restart] 1 of 2 after worker failure during iteration 2: rank 0 (host ")
    first_life = {int(pid) for pid in INIT_PID.findall(run.stdout_text())}
    run.wait_for("[restart] 1: resuming at iteration 1")
    assert len(first_life) == 2 and not any(os.path.exists(f"/proc/{pid}") for pid in first_life), first_life
    killed_in_update = run.wait_for_file_line(tmp_path / "faults.log", "[fault] rank 1: kill in update")
    resumed = run.wait_for("[restart] 2: resuming at iteration 3")
    assert _finished(run) == 0, run.stderr_text()[-3000:]
    print(f"\n[restarts] {resumed - killed_in_update:.1f} s from the kill in iteration 3 to resuming it")

    stdout = run.stdout_text()
    assert "last checkpoint: none; resuming from iteration 1 (the initial weights)" in stdout
    assert f"; resuming from iteration 3 ({tmp_path / 'save' / 'iter_0000002'})" in stdout
    assert "2 restart(s) from a checkpoint (runtime.max_restarts)" in stdout
    expected = _records(uninterrupted / "run")
    assert any(r["dynamic_sampling/rollouts"] > 1 for r in expected[2:]), expected  # a refill after the restart
    assert _records(tmp_path / "run") == expected
    assert _restarts(tmp_path / "run") == [1, 1, 2, 2, 2, 2]
    _assert_same_checkpoint(uninterrupted / "save" / "iter_0000006", tmp_path / "save" / "iter_0000006")
    processes, shm = leftovers(run, shm_before)
    assert not processes and not shm, (processes, shm)


def test_a_rollout_started_ahead_survives_a_restart(world, tmp_path_factory):
    root = tmp_path_factory.mktemp("restarts_async")
    runs = {}
    for name, faults in (("uninterrupted", None), ("restarted", "actor_infer/generate_sequences:0:4:kill:x1")):
        (root / name).mkdir()
        run = _run(root / name, *ASYNC, "megatron_training.train_iters=4", "megatron_training.save_interval=2",
                   faults=faults, max_restarts=1 if faults else 0)
        assert _finished(run) == 0, run.stderr_text()[-3000:]
        runs[name] = run
    assert "[restart] 1 of 1 after worker failure during iteration 4: actor_infer rank 0" in \
        runs["restarted"].stdout_text()
    assert (root / "restarted" / "save" / "iter_0000002" / "rollout_ahead.pt").is_file()
    expected = _records(root / "uninterrupted" / "run")
    assert [r["rollout/staleness"] for r in expected] == [0, 1, 1, 1]
    assert _records(root / "restarted" / "run") == expected
    _assert_same_checkpoint(root / "uninterrupted" / "save" / "iter_0000004",
                            root / "restarted" / "save" / "iter_0000004")


def test_multi_turn_tool_use_restarts_into_the_uninterrupted_run(tmp_path_factory):
    # The ReTool demo (the model's code run by the code interpreter between turns), one rank: both runs through Ray.
    root = tmp_path_factory.mktemp("restarts_multi_turn")
    for name, faults in (("uninterrupted", None), ("restarted", "update:0:3:kill:x1")):
        (root / name).mkdir()
        run = _run(root / name, "dapo_tiny_retool_cpu", "megatron_training.train_iters=4",
                   "megatron_training.save_interval=2", "runtime.local_single_rank=false", faults=faults,
                   max_restarts=1 if faults else 0, script="cli/train_dapo.py")
        assert _finished(run) == 0, run.stderr_text()[-3000:]
    expected = _records(root / "uninterrupted" / "run")
    assert all(r["tool_call_num/mean"] > 0 for r in expected[2:]), expected  # the code interpreter ran
    assert _records(root / "restarted" / "run") == expected
    assert _restarts(root / "restarted" / "run") == [0, 0, 1, 1]


PARTIAL = ("rl_config.partial_rollout_max_split=4", "megatron_training.global_batch_size=8",
           "rl_config.mini_batch_size=8", "rl_config.n_samples_per_prompt=8", "megatron_training.train_iters=4",
           "megatron_training.save_interval=2", "runtime.local_single_rank=false")


def test_samples_carried_in_a_partial_rollout_survive_a_restart(tmp_path_factory):
    _carried_samples_survive_a_restart(tmp_path_factory.mktemp("restarts_partial"), "grpo_tiny_cpu", PARTIAL)


# Run-ahead on the DAPO demo (its responses end at different lengths): the samples its stop aborted are carried.
RUN_AHEAD = ("rl_config.partial_rollout_max_split=4", "rl_config.async_engine=true", "megatron_training.train_iters=4",
             "megatron_training.save_interval=2", "rl_config.eval_before_train=false", "rl_config.eval_interval=100",
             "runtime.local_single_rank=false")


def test_samples_a_run_ahead_rollout_aborted_survive_a_restart(tmp_path_factory):
    _carried_samples_survive_a_restart(tmp_path_factory.mktemp("restarts_run_ahead"), "dapo_tiny_math_cpu", RUN_AHEAD,
                                       script="cli/train_dapo.py")


def _carried_samples_survive_a_restart(root, config: str, overrides: tuple, *, script: str = "cli/train_grpo.py"):
    """A rank killed in iteration 3's update, with samples carried from iteration 2: the run restarts from its
    iteration-2 checkpoint and writes the uninterrupted run's records."""
    for name, faults in (("uninterrupted", None), ("restarted", "update:0:3:kill:x1")):
        (root / name).mkdir()
        run = _run(root / name, config, *overrides, f"synthetic_data.data_dir={root / 'assets'}",
                   faults=faults, max_restarts=1 if faults else 0, script=script)
        assert _finished(run) == 0, run.stderr_text()[-3000:]
    assert (root / "restarted" / "save" / "iter_0000002" / "carried_samples.json").is_file()
    expected = _records(root / "uninterrupted" / "run")
    assert any(r["rollout/resumed_samples"] > 0 for r in expected[2:]), expected  # carried across the restart
    assert _records(root / "restarted" / "run") == expected
    assert _restarts(root / "restarted" / "run") == [0, 0, 1, 1]


def test_restarts_exhausted_end_the_run_as_without_them(tmp_path):
    # The kill comes back in the second life at its third update: iteration 5.
    run = _run(tmp_path, "grpo_tiny_cpu", "megatron_training.train_iters=6", "megatron_training.save_interval=2",
               faults="update:0:3:kill:x2", max_restarts=1)
    assert _finished(run) == 1
    assert "[restart] none left: all 1 of runtime.max_restarts used" in run.stdout_text()
    last = [line for line in run.stderr_text().splitlines() if line.strip()][-1]
    assert last.startswith("worker failure during iteration 5: rank 0 (host "), last
    assert last.endswith(f"failed in update: the worker process died (killed, or crashed outside Python); "
                         f"last checkpoint: {tmp_path / 'save' / 'iter_0000004'}"), last
    assert [r["iteration"] for r in _records(tmp_path / "run")] == [1, 2, 3, 4]


def test_a_failure_repeated_at_the_same_point_is_not_restarted_again(tmp_path):
    run = _run(tmp_path, "grpo_tiny_cpu", "megatron_training.train_iters=2", faults="update:0:1:raise",
               max_restarts=3)
    assert _finished(run) == 1
    assert run.stdout_text().count("[restart] 1 of 3 after") == 1 and "[restart] 2 of 3" not in run.stdout_text()
    last = [line for line in run.stderr_text().splitlines() if line.strip()][-1]
    assert last.startswith("worker failure during iteration 1: rank 0 (host "), last
    assert "failed in update: RuntimeError: injected fault in update on rank 0" in last, last
    assert last.endswith("last checkpoint: none; it failed the same way before restart 1, at the same point: not "
                         "restarting again"), last
