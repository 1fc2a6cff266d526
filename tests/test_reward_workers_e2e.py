"""End to end: the CPU demo with its roles spelled out in ROLL's keys (configs/grpo_tiny_cpu_colocated_roles.yaml:
actor_train/actor_infer/reference on device 0, rewards.rule.world_size 2) runs 2 GRPO iterations through the
CLI; the rule rewards come from the 2 CPU Ray workers, and the metrics mean what the demo's mean.

Runs where: a subprocess (Ray starts one rank and two reward workers); ~45 s on 2 cores.
"""
import json

from cli_runner import run_cli


def test_demo_with_colocated_roles_and_two_reward_workers_runs_two_iterations(tmp_path):
    run_dir = tmp_path / "run"
    done = run_cli(tmp_path, "grpo_tiny_cpu_colocated_roles", "megatron_training.train_iters=2",
                   f"synthetic_data.data_dir={tmp_path / 'assets'}")
    assert done.returncode == 0, done.stderr[-3000:]
    out = done.stdout
    # The device -> roles table, printed at start.
    assert "[resources] colocated: actor_train and actor_infer take turns on device(s) 0" in out
    assert "actor_train, actor_infer, reference" in out and "rewards.rule (2 worker(s))" in out
    assert "[reward] warning" not in out
    assert len([line for line in out.splitlines() if line.startswith("[iter")]) == 2, out[-2000:]

    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["iteration"] for r in records] == [1, 2]
    for r in records:
        assert r["reward_workers/failed_samples"] == 0
        # The same meaning as the in-process demo (tests/test_train_grpo_e2e.py).
        assert 0.0 <= r["reward/mean"] <= 1.0
        assert r["arith_acc_rewards/mean"] == r["reward/mean"]  # one verifier, weight 1
        assert r["reward/mean"] >= r["reward/accuracy"]  # correct answers score 1, the rest 0 or 0.2
        assert r["rollout/logprob_max_abs_diff"] < 1e-4
        assert r["actor/optimizer_steps"] == 2
        assert r["memory/generate/train_params_bytes"] == 0 and r["memory/update/kv_cache_bytes"] == 0
        assert r["e2e_tps"] > 0 and r["timing/rollout"] > 0
