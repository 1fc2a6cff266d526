"""MindSpeed's no-op layers (`actor_config.noop_layers`, with `actor_config.num_layers` the padded count), read as the
uneven pipeline stages they amount to.

MindSpeed pads a model whose layer count does not split evenly over the pipeline stages with identity layers:
Qwen3-235B-A22B's 94 layers become 96 with `noop_layers: "5,95"`, 6 per stage at PP16. An identity layer computes
nothing, so the same model is the 94 real layers split as the padded layout splits them: here stages of
5, 6, ..., 6, 5 layers, which `actor_config.num_layer_list` builds (models/pipeline_stages.py). The translation
happens before the schema, so everything downstream (Megatron's layout, the push's plan, checkpoints, the
planner) sees only real layers.
"""
from __future__ import annotations

from typing import Any

from mindspeed_rl.errors import ConfigError

_KEY = "actor_config.noop_layers"


def lift_noop_layers(tree: dict[str, Any]) -> list[ConfigError]:
    """Replace actor_config.noop_layers and the padded actor_config.num_layers with actor_config.num_layer_list."""
    actor = tree.get("actor_config")
    if not isinstance(actor, dict) or actor.get("noop_layers") in (None, ""):
        return []
    raw = actor.pop("noop_layers")
    padded = actor.pop("num_layers", None)
    try:
        noop = sorted({int(index) for index in str(raw).replace(" ", "").strip("[]").split(",")})
    except ValueError:
        return [ConfigError(_KEY, f"expected comma-separated layer indices such as \"5,95\", got {raw!r}")]
    real = _model_layers(tree, actor)
    if real is None:
        return [ConfigError(_KEY, "needs the selected model block's num_layers (the real layer count)")]
    padded = real + len(noop) if padded is None else padded
    if not isinstance(padded, int) or padded != real + len(noop):
        return [ConfigError("actor_config.num_layers", f"with {len(noop)} no-op layers ({raw}) it must be the model's "
                                                       f"{real} layers + {len(noop)} = {real + len(noop)}, got {padded!r}")]
    if noop[0] < 0 or noop[-1] >= padded:
        return [ConfigError(_KEY, f"layer indices must be in [0, {padded}), got {raw!r}")]
    pp = actor.get("pipeline_model_parallel_size") or 1
    if pp == 1:
        return []  # one stage: the identities are simply not built
    if padded % pp:
        return [ConfigError(_KEY, f"the padded {padded} layers must split evenly over pipeline_model_parallel_size={pp}")]
    if actor.get("num_layer_list") is not None:
        return [ConfigError(_KEY, "give either noop_layers (with num_layers) or num_layer_list, not both")]
    per_stage = padded // pp
    counts = [sum(1 for layer in range(s * per_stage, (s + 1) * per_stage) if layer not in noop) for s in range(pp)]
    if 0 in counts:
        return [ConfigError(_KEY, f"pipeline stage {counts.index(0)} would hold no real layer ({raw} at {per_stage} "
                                  "layers per stage)")]
    actor["num_layer_list"] = ",".join(str(count) for count in counts)
    return []


def _model_layers(tree: dict[str, Any], actor: dict[str, Any]) -> int | None:
    blocks = tree.get("model")
    name = actor.get("model") or (tree.get("megatron_training") or {}).get("model")
    block = blocks.get(name) if isinstance(blocks, dict) else None
    layers = block.get("num_layers") if isinstance(block, dict) else None
    return layers if isinstance(layers, int) else None
