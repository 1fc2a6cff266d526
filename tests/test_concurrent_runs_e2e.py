"""End to end: two runs started at once from one checkout, sharing the demo's asset directory but with
different asset seeds, each train on their own generated model and prompts (no shared ports, shm
names or files between them).

Runs where: two CLI subprocesses at the same time (each rank in its CLI's process); ~1.5 min on 2 cores.
"""
import json
import re
import time

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


def test_two_runs_on_one_run_directory_one_is_refused_and_the_other_writes_each_iteration_once(tmp_path):
    """Started half a second apart with the same hydra.run.dir and actor_config.save (the window that let
    two runs interleave their metrics): the second is refused at start, naming the first."""
    common = ("megatron_training.train_iters=2", f"synthetic_data.data_dir={tmp_path / 'assets'}",
              f"actor_config.save={tmp_path / 'save'}")
    runs = [launch(tmp_path, "grpo_tiny_cpu", *common)]
    time.sleep(0.5)
    runs.append(launch(tmp_path, "grpo_tiny_cpu", *common))
    codes = [run.finish(timeout=600)[0] for run in runs]
    assert sorted(codes) == [0, 2], [run.stderr_text()[-2000:] for run in runs]
    done, refused = (runs[0], runs[1]) if codes[0] == 0 else (runs[1], runs[0])  # whichever locked first ran
    assert f"is in use by another run (pid {done.process.pid} on " in refused.stderr_text()
    assert "Traceback" not in refused.stderr_text()
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["iteration"] for r in records] == [1, 2]
