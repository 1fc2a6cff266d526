"""End to end: three runs started at once from one checkout (module fixture):
- A and B share the demo's asset directory with different asset seeds: each trains on its own generated model
  and prompts (no shared ports, shm names or files between them);
- C starts half a second after A with A's hydra.run.dir and actor_config.save (the window that let two runs
  interleave their metrics): whichever of A and C locks first runs, the other is refused at start naming it,
  and the run directory holds each iteration once.

Runs where (`make test-failures`, which .ci/run calls): three CLI subprocesses at the same time (each rank in its
CLI's process); ~1 min on 2 cores.
"""
import json
import re
import time

import pytest

from run_watch import launch

pytestmark = pytest.mark.failures  # `make test-failures`, beside `make test`'s 25-minute budget

DATA_LINE = re.compile(r"\[data\] \d+ prompts from (\S+)")


@pytest.fixture(scope="module")
def three_runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("concurrent")
    shared = root / "assets"
    common = ("megatron_training.train_iters=2", f"synthetic_data.data_dir={shared}")
    same_dir = (f"actor_config.save={root / 'a' / 'save'}", "synthetic_data.seed=1")
    a = launch(root / "a", "grpo_tiny_cpu", *common, *same_dir)
    b = launch(root / "b", "grpo_tiny_cpu", *common, "synthetic_data.seed=2")
    time.sleep(0.5)
    c = launch(root / "a", "grpo_tiny_cpu", *common, *same_dir)
    codes = {name: run.finish(timeout=600)[0] for name, run in (("a", a), ("b", b), ("c", c))}
    return root, {"a": a, "b": b, "c": c}, codes


def test_two_runs_on_one_run_directory_one_is_refused_and_the_other_writes_each_iteration_once(three_runs):
    root, runs, codes = three_runs
    assert sorted((codes["a"], codes["c"])) == [0, 2], [runs[n].stderr_text()[-2000:] for n in "ac"]
    done, refused = (runs["a"], runs["c"]) if codes["a"] == 0 else (runs["c"], runs["a"])  # whichever locked first
    assert f"is in use by another run (pid {done.process.pid} on " in refused.stderr_text()
    assert "Traceback" not in refused.stderr_text()
    records = [json.loads(line) for line in (root / "a" / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["iteration"] for r in records] == [1, 2]


def test_two_runs_at_once_with_different_asset_seeds_use_their_own_assets(three_runs):
    root, runs, codes = three_runs
    assert codes["b"] == 0, runs["b"].stderr_text()[-3000:]
    done = runs["a"] if codes["a"] == 0 else runs["c"]
    used = {1: DATA_LINE.search(done.stdout_text()).group(1), 2: DATA_LINE.search(runs["b"].stdout_text()).group(1)}
    assert used[1] != used[2]
    for seed, prompts in used.items():
        asset_dir = next(p for p in (root / "assets").iterdir() if p.is_dir() and prompts.startswith(str(p) + "/"))
        assert json.loads((asset_dir / "assets.json").read_text())["seed"] == seed
    assert (root / "b" / "run" / "metrics.jsonl").is_file()
