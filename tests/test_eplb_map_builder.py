"""cli/eplb_generate_map_ds.py and planner/eplb_map_builder.py: expert loads -> EPLB's redundant-expert map, against
placements worked out by hand from DeepSeek's policy (steps in the comments), and the file read back as a run reads it.

Runs where: in-process (numpy, the CLI's main); ~1 s.
"""
import importlib.util
import json
from pathlib import Path

import numpy as np
import pytest

from mindspeed_rl.engines.eplb_counts import counts_document
from mindspeed_rl.planner.eplb_map_builder import EplbShape, balanced_packing, build_placement, replicate_experts
from mindspeed_rl.planner.expert_map import read_expert_map

REPO = Path(__file__).resolve().parents[1]


def cli_main(argv: list[str]) -> int:
    """`python cli/eplb_generate_map_ds.py ARGV`, in this process (the e2e test runs it as a subprocess)."""
    spec = importlib.util.spec_from_file_location("eplb_generate_map_ds", REPO / "cli" / "eplb_generate_map_ds.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.main(argv)


def test_global_policy_replicates_the_heaviest_packs_evenly_and_deduplicates():
    """4 experts loads 40 10 30 20, 6 slots on 2 devices, one group on one node (the global policy).
    Replicas: one of each, then the highest load per copy: 40 (expert 0 -> 20 each), then 30 (expert 2 -> 15 each):
    slots hold experts 0 1 2 3 0 2 carrying 20 10 15 20 20 15. Packing, heaviest first (ties by slot) onto the
    lighter device (ties: the first): slot0 20 -> d0, slot3 20 -> d1, slot4 20 -> d0 (40), slot2 15 -> d1 (35),
    slot5 15 -> d1 (50, full), slot1 10 -> d0 (50): d0 = [0, 0, 1], d1 = [3, 2, 2], 50 tokens each.
    De-duplication: d0's second 0 becomes the closest load to 40 not on d0 (2: 30; 3 is 20): [0, 2, 1];
    d1's second 2 becomes the closest to 30 not on d1 (0: 40; 1 is 10): [3, 2, 0]."""
    shape = EplbShape(num_replicas=6, num_groups=1, num_nodes=1, num_gpus=2)
    assert build_placement(np.array([[40, 10, 30, 20]]), shape) == [[[0, 2, 1], [3, 2, 0]]]


def test_hierarchical_policy_packs_groups_onto_nodes_first():
    """8 experts in 4 groups of 2 (loads 5 1 | 8 2 | 3 3 | 9 1: groups 6 10 6 10), 2 nodes of 2 devices, 12 slots.
    Groups onto nodes, 2 each: g1 -> n0, g3 -> n1, g0 -> n0, g2 -> n1, so n0 holds experts 2 3 0 1 and n1 6 7 4 5.
    n0 (loads 8 2 5 1, 6 slots): copies of 2 (8 -> 4 each) then 0 (5 -> 2.5): per copy 4 2 2.5 1 4 2.5; packed
    4 -> d0, 4 -> d1, 2.5 -> d0, 2.5 -> d1, 2 -> d0 (full), 1 -> d1: d0 = [2, 0, 3], d1 = [2, 0, 1].
    n1 (loads 9 1 3 3): expert 6 twice more (9 -> 4.5 -> 3 each): per copy 3 1 3 3 3 3; the 3s in slot order
    alternate d2 d3 d2 d3 d2: d2 = [6, 5, 6], d3 = [4, 6, 7] (slot 1's 1 last). d2's second 6 becomes the load
    closest to 9 not there: expert 2 (8)."""
    shape = EplbShape(num_replicas=12, num_groups=4, num_nodes=2, num_gpus=4)
    placement = build_placement(np.array([[5, 1, 8, 2, 3, 3, 9, 1]]), shape)
    assert placement == [[[2, 0, 3], [2, 0, 1], [6, 5, 2], [4, 6, 7]]]


def test_groups_not_dividing_over_nodes_fall_back_to_the_global_policy():
    loads = np.array([[40, 10, 30, 20]])
    hierarchical_shape = EplbShape(num_replicas=6, num_groups=3, num_nodes=2, num_gpus=2)
    assert hierarchical_shape.policy() == (1, 1)
    assert build_placement(loads, hierarchical_shape) == build_placement(
        loads, EplbShape(num_replicas=6, num_groups=1, num_nodes=1, num_gpus=2))


def test_packing_and_replication_helpers():
    pack, rank = balanced_packing(np.array([3.0, 3.0, 1.0, 5.0]), 2)
    # Heaviest first: 5 -> p0, 3 (item 0) -> p1, 3 (item 1) -> p1 (3 < 5; now full), 1 -> p0.
    assert pack.tolist() == [1, 1, 0, 0] and rank.tolist() == [0, 1, 1, 0]
    slots, copies = replicate_experts(np.array([6.0, 1.0, 3.0]), 5)
    # Expert 0 (6) gets a copy (3 each), then ties with expert 2 (3): the first wins.
    assert slots.tolist() == [0, 1, 2, 0, 0] and copies.tolist() == [3, 1, 1]


@pytest.mark.parametrize("kwargs, message", [
    (dict(num_replicas=9, num_groups=1, num_nodes=1, num_gpus=2), "multiple of --num_gpus"),
    (dict(num_replicas=8, num_groups=1, num_nodes=3, num_gpus=4), "multiple of --num_nodes"),
    (dict(num_replicas=0, num_groups=1, num_nodes=1, num_gpus=2), "--num_replicas must be positive"),
])
def test_inconsistent_arguments_are_refused(kwargs, message):
    with pytest.raises(ValueError, match=message):
        EplbShape(**kwargs)


def test_a_map_that_cannot_hold_the_experts_is_refused():
    with pytest.raises(ValueError, match="at least the 4 experts"):
        build_placement(np.ones((1, 4)), EplbShape(num_replicas=2, num_groups=1, num_nodes=1, num_gpus=2))
    with pytest.raises(ValueError, match="would hold an expert twice"):
        build_placement(np.ones((1, 4)), EplbShape(num_replicas=10, num_groups=1, num_nodes=1, num_gpus=2))


def test_the_cli_reads_every_ranks_counts_and_writes_a_map_the_run_reads(tmp_path, capsys):
    """Two ranks' files add up (layer 0: 70 10 10 10, placed evenly 80 | 20 tokens); a stray JSON file in the folder
    is not read; the map comes back through read_expert_map with 2 MoE layers x 2 devices x 3 experts.
    Layer 0 by hand: expert 0 gets two more copies (70 / 3 each); 23.3 -> d0, 23.3 -> d1, 23.3 -> d0, then the 10s
    d1 d1 (full) d0: d0 = [0, 0, 3] whose second 0 becomes expert 1 (the first load closest to 70), d1 = [0, 1, 2]:
    35 + 5 + 10 = 50 tokens on each device."""
    folder = tmp_path / "counts"
    folder.mkdir()
    (folder / "eplb_token_collects_0.json").write_text(counts_document({0: {0: 50, 1: 10, 2: 0, 3: 10},
                                                                        1: {0: 1, 1: 1, 2: 1, 3: 1}}))
    (folder / "eplb_token_collects_1.json").write_text(counts_document({0: {0: 20, 1: 0, 2: 10, 3: 0},
                                                                        1: {0: 1, 1: 1, 2: 1, 3: 1}}))
    (folder / "notes.json").write_text(json.dumps({"not": "counts"}))
    output = tmp_path / "expert_map.json"
    assert cli_main(["--json_folder", str(folder), "--num_replicas", "6", "--num_groups", "1", "--num_nodes", "1",
                     "--num_gpus", "2", "--output_path", str(output)]) == 0, capsys.readouterr().err
    expert_map = read_expert_map(str(output))
    assert expert_map.placement[0] == ((0, 1, 3), (0, 1, 2))
    assert len(expert_map.placement) == 2 and expert_map.experts_per_rank() == ((3, 3), (3, 3))
    assert "MoE layer 0: heaviest device / mean 1.600 evenly, 1.000 with the map" in capsys.readouterr().out


def test_the_cli_says_a_bad_folder_in_one_line(tmp_path, capsys):
    assert cli_main(["--json_folder", str(tmp_path), "--num_replicas", "6", "--num_groups", "1", "--num_nodes", "1",
                 "--num_gpus", "2", "--output_path", str(tmp_path / "map.json")]) == 2
    assert capsys.readouterr().err.startswith("config error: eplb_generate_map_ds: no eplb_token_collects_<rank>.json")
    assert not (tmp_path / "map.json").exists()
