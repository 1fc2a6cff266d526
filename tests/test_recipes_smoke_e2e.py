"""Each of MindSpeed-RL's 17 recipes, DPO's too, shrunk by overrides only (tests/recipe_smoke.py: a tiny checkpoint of
its architecture, 2 CPU devices with one of its own parallel kinds, short lengths, every feature kept), trains 2
iterations through its own entry point, saving after each, and a second run resumed from the iteration-1 checkpoint
reaches the same iteration 2: the same metrics and, bit for bit, the same weights, fp32 masters and Adam moments
(bf16 and the distributed optimizer, as every recipe sets them).

EPLB as their users make it (docs/zh/features/EPLB.md): grpo_deepseek_r1_671b_A3's first run also collects its
rollouts' expert loads (generate_config.eplb_token_collects), cli/eplb_generate_map_ds.py makes the map from them, and
grpo_deepseek_r1_671b_A3_eplb (the same tiny model and layouts) runs with that map.

Runs where: two CLI runs per recipe (2 rank processes on one Ray cluster the module's runs join, real Megatron +
vLLM); `make test-recipes`, which .ci/run calls after `make test`."""
import json
import shutil
import subprocess
import sys

import pytest
import torch

from cli_runner import REPO, run_cli
from recipe_smoke import RECIPES, SHRINKS, recipe_tree, smoke_overrides, tiny_assets
from two_nodes import one_node

pytestmark = pytest.mark.recipes
ENTRY_POINTS = {"ray_grpo": "cli/train_grpo.py", "ray_dapo": "cli/train_dapo.py", "ray_ppo": "cli/train_ppo.py",
                "dpo": "cli/train_dpo.py"}
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


def _run(name: str, run_dir, assets, ray_address: str, *extra: str, **where):
    script = ENTRY_POINTS[recipe_tree(name)["megatron_training"]["stage"]]
    overrides = [*smoke_overrides(name, assets, **where), *extra, f"runtime.ray_address={ray_address}"]
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
def test_their_recipe_trains_saves_and_resumes_exactly(world, tmp_path, assets, ray_address, eplb_counts, name):
    full, resumed = tmp_path / "full", tmp_path / "resumed"
    both = _expert_map_made_from(eplb_counts, assets, ray_address) if name == EPLB_USING else ()
    _run(name, full, assets, ray_address, *both, *(_collecting(eplb_counts) if name == EPLB_COLLECTING else ()),
         save=full / "save")
    if name == EPLB_COLLECTING:
        _assert_every_token_reached_top_k_experts_per_layer(eplb_counts)
    first = full / "save" / "iter_0000001"
    _run(name, resumed, assets, ray_address, *both, save=resumed / "save", load=first)

    assert [r["iteration"] for r in _records(resumed)] == [2]
    assert _records(resumed) == _records(full)[1:]
    want, got = _plain(full / "save" / "iter_0000002"), _plain(resumed / "save" / "iter_0000002")
    assert any(key.startswith("optimizer/") for key in want) and sorted(got) == sorted(want)
    for key, tensor in want.items():
        assert torch.equal(got[key], tensor), f"{name}: {key}"
    shutil.rmtree(tmp_path, ignore_errors=True)  # 32 checkpoints of this module add up


EPLB_COLLECTING, EPLB_USING = "grpo_deepseek_r1_671b_A3", "grpo_deepseek_r1_671b_A3_eplb"
TOP_K = 4  # the tiny DeepSeek-V3's experts per token; its experts form 4 groups (recipe_smoke._deepseek_v3)


@pytest.fixture(scope="module")
def eplb_counts(tmp_path_factory):
    """Where EPLB_COLLECTING's first run writes its ranks' expert loads (the recipes run in name order: it comes first)."""
    return tmp_path_factory.mktemp("eplb_token_collects")


def _collecting(counts) -> tuple[str, ...]:
    return ("generate_config.eplb_token_collects=true", f"generate_config.eplb_token_save_path={counts}")


def _assert_every_token_reached_top_k_experts_per_layer(counts) -> None:
    from mindspeed_rl.engines.eplb_counts import aggregate_counts

    per_layer = aggregate_counts(counts).sum(axis=1).tolist()  # every MoE layer routes the same tokens
    assert len(per_layer) == 2 and per_layer[0] > 0 and len(set(per_layer)) == 1 and per_layer[0] % TOP_K == 0, per_layer


def _expert_map_made_from(counts, assets, ray_address: str) -> tuple[str]:
    """The map cli/eplb_generate_map_ds.py makes from EPLB_COLLECTING's loads (collected here when that recipe did not
    run first, e.g. under -k): 8 experts and 2 redundant copies on 2 devices, 5 slots each."""
    from mindspeed_rl.engines.eplb_counts import counts_files
    from mindspeed_rl.planner.expert_map import read_expert_map

    if not counts_files(counts):
        scratch = counts / "collecting_run"
        _run(EPLB_COLLECTING, scratch, assets, ray_address, *_collecting(counts), save=scratch / "save", train_iters=1)
    expert_map = counts / "expert_map.json"
    made = subprocess.run([sys.executable, "cli/eplb_generate_map_ds.py", "--json_folder", str(counts),
                           "--num_replicas", "10", "--num_groups", "4", "--num_nodes", "1", "--num_gpus", "2",
                           "--output_path", str(expert_map)], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert made.returncode == 0, made.stdout + made.stderr
    assert read_expert_map(str(expert_map)).experts_per_rank() == ((5, 5), (5, 5))
    return (f"generate_config.expert_map_path={expert_map}",)
