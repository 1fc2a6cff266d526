"""End to end: `python cli/train_dapo.py` on a CPU-only host runs the DAPO demo (dapo_tiny_math_cpu, its default
there): no reference model anywhere (the resources table, the phases, the ledger), clip-higher, overlong
shaping, dynamic sampling and the held-out evaluation in the metrics; and each entry point refuses the other's
recipes. Runs where: subprocesses, one rank in the CLI's process; ~1 min on 2 cores."""
import json

from cli_runner import REPO, run_cli


def test_the_dapo_demo_runs_without_a_reference_and_with_each_dapo_step(tmp_path):
    import subprocess
    import sys

    run_dir = tmp_path / "run"
    done = subprocess.run([sys.executable, "cli/train_dapo.py", "megatron_training.train_iters=2",
                           "rl_config.eval_interval=2", f"synthetic_data.data_dir={tmp_path / 'assets'}",
                           f"hydra.run.dir={run_dir}"], cwd=REPO, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "[init] Megatron actor built (no reference: init_kl_coef is 0)" in done.stdout
    table = [line for line in done.stdout.splitlines() if line.startswith("  0 ")]
    assert table == ["  0       actor_train, actor_infer"]  # no reference role
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["iteration"] for r in records] == [0, 1, 2]  # the evaluation before training, then two updates
    assert records[0]["eval/updates"] == 0 and records[2]["eval/updates"] == 2 and "eval/updates" not in records[1]
    for r in records[1:]:
        assert not any(key.startswith("memory/ref_logprob/") for key in r)  # no reference phase
        assert r["actor/kl_loss"] == 0.0
        assert r["dynamic_sampling/kept_prompts"] == 8  # filter_groups_train_batch_size
        assert r["dynamic_sampling/generated_prompts"] == 16 * r["dynamic_sampling/rollouts"]
        assert -1.0 <= r["reward/overlong_penalty/mean"] <= 0.0
        assert r["rollout/logprob_max_abs_diff"] < 1e-4


def test_each_entry_point_refuses_the_other_stage(tmp_path):
    done = run_cli(tmp_path, "dapo_tiny_math_cpu", timeout=120)
    assert done.returncode == 2
    assert done.stderr.splitlines()[-1] == ("config error: megatron_training.stage: is ray_dapo: run the recipe with "
                                            "cli/train_dapo.py, as its authors did (this is cli/train_grpo.py)")
    done = run_cli(tmp_path, "grpo_tiny_cpu", timeout=120, script="cli/train_dapo.py")
    assert done.returncode == 2
    assert done.stderr.splitlines()[-1].startswith("config error: megatron_training.stage: is ray_grpo: run the "
                                                   "recipe with cli/train_grpo.py")
