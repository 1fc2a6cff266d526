"""End to end: two runs started at once from one checkout, sharing the demo's asset directory but with
different asset seeds, each train on their own generated model and prompts (no shared ports, shm
names or files between them).

Runs where: two CLI subprocesses at the same time (Ray each, 1 worker each); ~1 min on 2 cores.
"""
import json
import re

from run_watch import launch

DATA_LINE = re.compile(r"\[data\] \d+ prompts from (\S+)")


def test_two_runs_at_once_with_different_asset_seeds_use_their_own_assets(tmp_path):
    shared = tmp_path / "assets"
    runs = {seed: launch(tmp_path / f"seed{seed}", "grpo_tiny_cpu", "megatron_training.train_iters=1",
                         f"synthetic_data.data_dir={shared}", f"synthetic_data.seed={seed}")
            for seed in (1, 2)}
    used = {}
    for seed, run in runs.items():
        code, _ = run.finish(timeout=600)
        assert code == 0, run.stderr_text()[-3000:]
        used[seed] = DATA_LINE.search(run.stdout_text()).group(1)
        assert (tmp_path / f"seed{seed}" / "run" / "metrics.jsonl").is_file()
    assert used[1] != used[2]
    for seed, prompts in used.items():
        asset_dir = next(p for p in shared.iterdir() if p.is_dir() and prompts.startswith(str(p) + "/"))
        assert json.loads((asset_dir / "assets.json").read_text())["seed"] == seed
