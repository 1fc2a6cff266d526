"""PPO with a colocated critic end to end through `cli/train_ppo.py` (subprocesses, real vLLM + Megatron):
- 1 rank: a run resumed from its iteration-2 checkpoint reaches the uninterrupted run's iteration 3 exactly:
  metrics (the adaptive KL coefficient included), the critic's weights and Adam states;
- disaggregated roles with the critic on a device of its own (actor_train with the reference on device 0, vLLM on
  device 1, the critic on device 2: three rank groups) train as the colocated run does: the same rewards, values and
  value losses; the critic's own rank killed in its update stops the run naming it;
- one-step off-policy with the mismatch ledger and the critic on a device of its own runs, the ledger re-scoring each
  stale rollout on whichever group holds vLLM;
- the GRPO entry point refuses a PPO recipe, naming the one to use.
Five roles on 2 ranks (TP2, a reward model too): tests/test_reward_model_e2e.py.

Runs where: five CLI runs, ~3 min on 2 cores."""

import json

import pytest
import torch

from cli_runner import run_cli

PPO = "cli/train_ppo.py"
ONE_RANK = ("rl_config.actor_resource.num_npus=1", "rl_config.critic_resource.num_npus=1")
ADAPTIVE_KL = ("rl_config.use_kl_in_reward=true", "rl_config.kl_ctrl_type=adaptive", "rl_config.kl_target=0.01",
               "rl_config.kl_horizon=100", "rl_config.init_kl_coef=0.05")
COMMON = (*ONE_RANK, *ADAPTIVE_KL, "megatron_training.train_iters=3")
VOLATILE_PREFIXES = ("timing/", "memory/", "offload/")
VOLATILE_SUFFIXES = ("_tps", "seconds")


def _records(run_dir, *, all_keys: bool = False) -> list[dict]:
    records = [json.loads(line) for line in (run_dir / "run" / "metrics.jsonl").read_text().splitlines()]
    if all_keys:
        return records
    return [{k: v for k, v in r.items() if not k.startswith(VOLATILE_PREFIXES) and not k.endswith(VOLATILE_SUFFIXES)}
            for r in records]


@pytest.fixture(scope="module")
def colocated_one_rank(tmp_path_factory):
    """Three iterations with the critic taking turns on the one training rank, adaptive KL in the reward, a checkpoint
    after the second: what the resumed run and the other placements match."""
    run_dir = tmp_path_factory.mktemp("together")
    done = run_cli(run_dir, "ppo_tiny_cpu", *COMMON, "megatron_training.save_interval=2",
                   f"actor_config.save={run_dir / 'save'}", script=PPO)
    assert done.returncode == 0, done.stderr[-3000:]
    return run_dir


def test_a_resumed_run_matches_the_uninterrupted_one_with_the_critic(world, tmp_path, colocated_one_rank):
    full = colocated_one_rank
    checkpoint = full / "save" / "iter_0000002"
    assert (checkpoint / "critic" / "model").is_dir() and (checkpoint / "critic" / "optimizer").is_dir()
    assert "critic_scheduler" in json.loads((checkpoint / "trainer_state.json").read_text())

    resumed = tmp_path / "resumed"
    done = run_cli(resumed, "ppo_tiny_cpu", *COMMON, f"actor_config.load={checkpoint}", "actor_config.finetune=false",
                   f"actor_config.save={resumed / 'save'}", script=PPO)
    assert done.returncode == 0, done.stderr[-3000:]
    expected, got = _records(full)[2], _records(resumed)[-1]
    assert got["iteration"] == 3
    assert expected["critic/kl_coef"] != 0.05  # the controller moved it before the save
    assert got == expected
    from megatron.core import dist_checkpointing

    for part in ("model", "optimizer"):
        want = dist_checkpointing.load_plain_tensors(str(full / "save" / "iter_0000003" / "critic" / part))
        have = dist_checkpointing.load_plain_tensors(str(resumed / "save" / "iter_0000003" / "critic" / part))
        assert sorted(want) == sorted(have)
        assert all(torch.equal(want[k], have[k]) for k in want if isinstance(want[k], torch.Tensor)), part


def _assert_trains_as(records: list[dict], expected: list[dict]) -> None:
    assert [r["iteration"] for r in records] == [r["iteration"] for r in expected[:len(records)]]
    for got, want in zip(records, expected):
        for key in ("reward/mean", "critic/values/mean", "critic/returns/mean", "critic/vf_loss", "actor/pg_loss"):
            assert got[key] == pytest.approx(want[key], rel=1e-5, abs=1e-7), key


def test_disaggregated_roles_and_a_critic_of_its_own_train_as_colocated_until_the_critics_rank_dies(
        tmp_path, colocated_one_rank):
    """Three rank groups: actor_train (with the reference) on device 0, actor_infer on 1, the critic on 2
    (ppo_tiny_cpu_critic_devices made disaggregated). The critic's states stay on its device; the run trains as the
    colocated one does; the critic's rank killed in its third update (beside the
    actor's), the run stops naming it."""
    fault = {"MINDSPEED_RL_INJECT_FAULT": "critic/update_critic:0:3:kill"}
    done = run_cli(tmp_path, "ppo_tiny_cpu_critic_devices", *ADAPTIVE_KL, "megatron_training.train_iters=3",
                   "rl_config.use_integrated_worker=false", "actor_infer.device_mapping='list(range(1,2))'",
                   "critic.device_mapping='list(range(2,3))'", script=PPO, env=fault)
    assert done.returncode == 1, done.stderr[-3000:]
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith("worker failure during iteration 3: critic rank 0 (host "), last
    assert "failed in update_critic" in last and "Traceback" not in done.stderr
    records = _records(tmp_path, all_keys=True)
    _assert_trains_as(records, _records(colocated_one_rank))
    for record in records:
        for phase in ("critic_values", "after_critic_values", "critic_update", "after_critic_update"):
            assert record[f"memory/{phase}/critic_params_bytes"] > 0, phase  # resident on its device
        measured = [k for k in record if k.startswith("memory/") and k.endswith("_bytes") and "predicted" not in k]
        assert not [k for k in measured if "/critic" in k and not k.startswith(("memory/critic", "memory/after_critic"))]
    # Adam's moments exist from the first step on, and stay there (a colocated critic's leave after its update): the
    # critic's device holds all three of its states when it computes values (the planner's row, test_planner).
    assert records[1]["memory/critic_values/critic_optimizer_states_bytes"] > 0


def test_one_step_off_policy_with_the_ledger_and_a_critic_of_its_own_runs(tmp_path):
    """The command of issue 52, which ended in `AttributeError: 'ActorWithOwnCritic' object has no attribute
    'start_score'`: three rank groups, the next rollout during each update, the stale rollout re-scored by vLLM under
    the weights that train it."""
    done = run_cli(tmp_path, "ppo_tiny_cpu_disaggregated", "async_generation_ratio=1", "rl_config.mismatch_ledger=true",
                   "critic.device_mapping=[2]", "megatron_training.train_iters=2", script=PPO)
    assert done.returncode == 0, done.stderr[-3000:]
    records = _records(tmp_path, all_keys=True)
    assert [r["iteration"] for r in records] == [1, 2]
    assert [r["rollout/staleness"] for r in records] == [0, 1]
    assert records[0]["mismatch/staleness"] == 0.0 and "timing/rescore" not in records[0]  # on-policy: no re-score
    assert records[1]["mismatch/staleness"] > 0 and records[1]["timing/rescore"] > 0
    for record in records:
        causes = ("staleness", "push", "numerics", "routing")
        assert record["mismatch/total"] == pytest.approx(sum(record[f"mismatch/{c}"] for c in causes))


def test_the_grpo_entry_point_refuses_a_ppo_recipe(tmp_path):
    done = run_cli(tmp_path, "ppo_tiny_cpu", *ONE_RANK)
    assert done.returncode == 2
    assert "cli/train_ppo.py" in done.stderr and "Traceback" not in done.stderr
