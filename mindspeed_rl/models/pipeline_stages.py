"""Which layers each training pipeline stage holds: Megatron's even split, or the user's own counts.

MindSpeed-RL's `actor_config.num_layer_list` ("16,17,16,15": one count per stage) balances stages whose
work differs (the first holds the embedding, the last the output layer and the loss). The counts reach
Megatron as its `pipeline_model_parallel_layout`, and every layout computation here (the HF <-> Megatron
mapping, the weight push's plan, the planner) reads the same ranges from `stage_layer_range`.
"""
from __future__ import annotations


def parse_num_layer_list(text) -> tuple[int, ...]:
    """"16,17,16,15" -> (16, 17, 16, 15); ValueError on anything else."""
    return tuple(int(part) for part in str(text).split(","))


def stage_layer_range(num_layers: int, pp_rank: int, pp: int, stage_layers: tuple[int, ...] | None = None) -> range:
    """Global layer indices of training pipeline stage `pp_rank` of `pp`: `stage_layers[pp_rank]` layers after
    the stages before it, or the even split when `stage_layers` is None."""
    if stage_layers is None:
        if num_layers % pp:
            raise ValueError(f"PP={pp} must divide num_layers={num_layers} for even stages (or list each stage's "
                             f"layers in actor_config.num_layer_list)")
        per_stage = num_layers // pp
        return range(pp_rank * per_stage, (pp_rank + 1) * per_stage)
    if len(stage_layers) != pp or sum(stage_layers) != num_layers or min(stage_layers) < 1:
        raise ValueError(f"stage layers {list(stage_layers)} must be {pp} positive counts adding up to {num_layers}")
    start = sum(stage_layers[:pp_rank])
    return range(start, start + stage_layers[pp_rank])


def megatron_layout(stage_layers: tuple[int, ...]) -> list[list[str]]:
    """Megatron's `pipeline_model_parallel_layout` for these stages (no virtual stages): the embedding before
    the first stage's layers, the loss after the last's."""
    layout = [["decoder"] * count for count in stage_layers]
    layout[0].insert(0, "embedding")
    layout[-1].append("loss")
    return layout
