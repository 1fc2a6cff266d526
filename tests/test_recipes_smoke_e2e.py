"""Each of MindSpeed-RL's 16 recipes, shrunk by overrides only (tests/recipe_smoke.py: a tiny checkpoint of its
architecture, 2 CPU devices with one of its own parallel kinds, short lengths, every feature kept), trains 2
iterations through its own entry point, saving after each, and a second run resumed from the iteration-1 checkpoint
reaches the same iteration 2: the same metrics and, bit for bit, the same weights, fp32 masters and Adam moments
(bf16 and the distributed optimizer, as every recipe sets them).

Runs where: two CLI runs per recipe (2 rank processes on one Ray cluster the module's runs join, real Megatron +
vLLM); `make test-recipes`, which .ci/run calls after `make test`."""
import json
import shutil

import pytest
import torch

from cli_runner import run_cli
from recipe_smoke import RECIPES, SHRINKS, recipe_tree, smoke_overrides, tiny_assets
from two_nodes import one_node

pytestmark = pytest.mark.recipes
ENTRY_POINTS = {"ray_grpo": "cli/train_grpo.py", "ray_dapo": "cli/train_dapo.py", "ray_ppo": "cli/train_ppo.py"}
# Wall-clock and memory figures differ between any two runs, and the first switch of a process pushes more than
# the next (LoRA: the backbone once, then only the adapters); everything else must be equal.
VOLATILE_PREFIXES = ("timing/", "memory/", "offload/", "resharding/")
VOLATILE_SUFFIXES = ("_tps", "seconds")


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    return tiny_assets(tmp_path_factory.mktemp("recipe_assets"))


@pytest.fixture(scope="module")
def ray_address(tmp_path_factory):
    """One Ray cluster the 32 runs join (runtime.ray_address) instead of each starting its own."""
    with one_node(tmp_path_factory.mktemp("recipe_ray"), num_cpus=8) as address:
        yield address


def _run(name: str, run_dir, assets, ray_address: str, **where):
    script = ENTRY_POINTS[recipe_tree(name)["megatron_training"]["stage"]]
    overrides = [*smoke_overrides(name, assets, **where), f"runtime.ray_address={ray_address}"]
    done = run_cli(run_dir, name, "--config-dir", str(RECIPES), *overrides, script=script)
    assert done.returncode == 0, f"{name}:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    return done


def _records(run_dir) -> list[dict]:
    return [{key: value for key, value in json.loads(line).items()
             if not key.startswith(VOLATILE_PREFIXES) and not key.endswith(VOLATILE_SUFFIXES)}
            for line in (run_dir / "run" / "metrics.jsonl").read_text().splitlines()]


def _plain(checkpoint) -> dict[str, torch.Tensor]:
    from megatron.core import dist_checkpointing

    tensors = {}
    for part in sorted(path for path in checkpoint.rglob("*") if (path / ".metadata").is_file()):
        for key, value in dist_checkpointing.load_plain_tensors(str(part)).items():
            if isinstance(value, torch.Tensor):
                tensors[f"{part.relative_to(checkpoint)}/{key}"] = value
    return tensors


@pytest.mark.parametrize("name", sorted(SHRINKS))
def test_their_recipe_trains_saves_and_resumes_exactly(world, tmp_path, assets, ray_address, name):
    full, resumed = tmp_path / "full", tmp_path / "resumed"
    _run(name, full, assets, ray_address, save=full / "save")
    first = full / "save" / "iter_0000001"
    _run(name, resumed, assets, ray_address, save=resumed / "save", load=first)

    assert [r["iteration"] for r in _records(resumed)] == [2]
    assert _records(resumed) == _records(full)[1:]
    want, got = _plain(full / "save" / "iter_0000002"), _plain(resumed / "save" / "iter_0000002")
    assert any(key.startswith("optimizer/") for key in want) and sorted(got) == sorted(want)
    for key, tensor in want.items():
        assert torch.equal(got[key], tensor), f"{name}: {key}"
    shutil.rmtree(tmp_path, ignore_errors=True)  # 32 checkpoints of this module add up
