"""EPLB expert maps in vllm-ascend's format (planner/expert_map.py) for the tests and the planner's documented figures.

`round_robin_placement(moe_layers, experts, ep, slots)`: rank r of every layer holds `slots` consecutive experts
starting at r x experts / ep (mod experts), so each rank keeps its even share and `slots - experts / ep` redundant
copies of its neighbours' experts. `write_expert_map(path, placement)` writes the file MindSpeed-RL's
cli/eplb_generate_map_ds.py writes; e.g. the 671B figure of docs/planner.md:
    python -c "from tests.eplb_maps import *; write_expert_map('/tmp/ds_map.json', round_robin_placement(58, 256, 256, 2))"
"""
from __future__ import annotations

import json
from pathlib import Path

Placement = list[list[list[int]]]  # [MoE layer][EP rank] -> logical experts


def round_robin_placement(moe_layers: int, experts: int, ep: int, slots: int) -> Placement:
    share = experts // ep
    return [[[(rank * share + i) % experts for i in range(slots)] for rank in range(ep)] for _ in range(moe_layers)]


def expert_map_document(placement: Placement) -> dict:
    return {"moe_layer_count": len(placement),
            "layer_list": [{"layer_id": layer, "device_count": len(ranks),
                            "device_list": [{"device_id": rank, "device_expert": experts}
                                            for rank, experts in enumerate(ranks)]}
                           for layer, ranks in enumerate(placement)]}


def write_expert_map(path: str | Path, placement: Placement) -> Path:
    Path(path).write_text(json.dumps(expert_map_document(placement), indent=1) + "\n", encoding="utf-8")
    return Path(path)
