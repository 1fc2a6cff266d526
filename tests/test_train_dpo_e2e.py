"""End to end: `python cli/train_dpo.py` on a CPU-only host runs the DPO demo (dpo_tiny_cpu, its default there): the
policy and its reference on one rank, no vLLM, held-out preference accuracy rising by at least 0.1 from the first
evaluation to the last, the reward margin in every record; and the entry points refuse each other's recipes. Runs
where: a subprocess, one rank in the CLI's process; ~1 min on 2 cores."""
import json
import subprocess
import sys

from cli_runner import REPO, run_cli


def test_the_dpo_demo_raises_held_out_preference_accuracy(tmp_path):
    run_dir = tmp_path / "run"
    # The demo's assets are the shared cache's (data/tiny, made once, never rewritten: data/asset_cache.py).
    done = subprocess.run([sys.executable, "cli/train_dpo.py", f"hydra.run.dir={run_dir}"], cwd=REPO,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "[init] Megatron reference built" in done.stdout and "vLLM" not in done.stdout.replace("no vLLM", "")
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["iteration"] for r in records] == list(range(1, 21))
    assert all("dpo/reward_margin" in r and "dpo/chosen_reward" in r and "actor/grad_norm" in r for r in records)
    evaluations = [r for r in records if "eval/dpo/accuracy" in r]
    assert [r["iteration"] for r in evaluations] == list(range(2, 21, 2))
    first, last = evaluations[0], evaluations[-1]
    assert last["eval/dpo/accuracy"] - first["eval/dpo/accuracy"] >= 0.1, (first, last)
    assert last["eval/dpo/reward_margin"] > first["eval/dpo/reward_margin"]
    # The policy starts as its reference: no margin at the first update.
    assert records[-1]["dpo/reward_margin"] > records[0]["dpo/reward_margin"] == 0.0


def test_train_dpo_refuses_a_grpo_recipe_and_train_grpo_a_dpo_one(tmp_path):
    done = run_cli(tmp_path, "grpo_tiny_cpu", timeout=120, script="cli/train_dpo.py")
    assert done.returncode == 2
    assert done.stderr.splitlines()[-1].startswith("config error: megatron_training.stage: is ray_grpo: run the "
                                                   "recipe with cli/train_grpo.py")
    done = run_cli(tmp_path, "dpo_tiny_cpu", timeout=120)
    assert done.returncode == 2
    assert done.stderr.splitlines()[-1] == ("config error: megatron_training.stage: is dpo: run the recipe with "
                                            "cli/train_dpo.py, as its authors did (this is cli/train_grpo.py)")
