"""EPLB's expert map (`generate_config.expert_map_path`), read as vllm-ascend reads it, and the bytes of the redundant
experts it places.

The file (MindSpeed-RL's cli/eplb_generate_map_ds.py writes it, as ours does from the counts of
generate_config.eplb_token_collects: planner/eplb_map_builder.py; vllm-ascend's ExpertLoadBalancer reads it):
    {"moe_layer_count": L, "layer_list": [{"layer_id": l, "device_count": D,
                                           "device_list": [{"device_id": d, "device_expert": [e, ...]}, ...]}, ...]}
one entry per MoE layer (in model order), one per expert-parallel rank (vLLM's EP = TP x DP: rank dp_rank x TP +
tp_rank), each the logical experts whose weights that rank holds. vllm-ascend stacks the lists into one tensor, so
every rank of every layer has the same number of slots; a rank allocates one fused slot per distinct expert it lists
(its `local_num_experts`). Slots beyond num_experts / EP on a rank are its redundant experts: with expert
parallelism a vLLM expert is whole on its rank, 3 x hidden x moe_intermediate_size elements (w13 and w2).

Planned for, not run: this engine's vLLM places experts evenly whatever the map says, so the planner applies the map
only when it plans for an accelerator (MindSpeed-RL's vllm-ascend on the user's devices), and the run's own
prediction (`predict_run`) does not.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mindspeed_rl.errors import ConfigError
from mindspeed_rl.planner.arch import Architecture

KEY = "generate_config.expert_map_path"


@dataclass(frozen=True)
class ExpertMap:
    path: str
    # [MoE layer][EP rank] -> the logical experts that rank holds (redundant copies included)
    placement: tuple[tuple[tuple[int, ...], ...], ...]

    @property
    def device_count(self) -> int:
        return len(self.placement[0])

    @property
    def redundant_experts(self) -> int:
        """Slots over all ranks of a layer beyond the logical experts (vllm-ascend's global_redundant_expert_num)."""
        return len(self.placement[0][0]) * self.device_count - len({e for rank in self.placement[0] for e in rank})

    def experts_per_rank(self) -> tuple[tuple[int, ...], ...]:
        """[MoE layer][EP rank] -> the distinct experts the rank allocates."""
        return tuple(tuple(len(set(rank)) for rank in layer) for layer in self.placement)


def read_expert_map(path: str) -> ExpertMap:
    """The map at `path` (relative to the current directory, where the run starts). Raises ConfigError naming KEY when
    it is missing, not JSON or not of vllm-ascend's shape."""
    file = Path(path)
    if not file.is_file():
        raise ConfigError(KEY, f"{path} does not exist (EPLB's expert map, MindSpeed-RL's cli/eplb_generate_map_ds.py "
                               "writes it from the rollouts' expert loads; null plans experts evenly)")
    try:
        data = json.loads(file.read_text(encoding="utf-8"))
        placement = tuple(_layer(entry) for entry in data["layer_list"])
        declared = int(data["moe_layer_count"])
    except (OSError, ValueError, KeyError, TypeError) as error:
        raise ConfigError(KEY, f"{path}: not an expert map of vllm-ascend's format (moe_layer_count, layer_list of "
                               f"device_list of device_expert lists) ({error!r})") from None
    if declared != len(placement) or not placement:
        raise ConfigError(KEY, f"{path}: moe_layer_count is {declared} but layer_list has {len(placement)} layers")
    shapes = {(len(layer), len(rank)) for layer in placement for rank in layer}
    if len(shapes) != 1:
        raise ConfigError(KEY, f"{path}: every layer needs the same device count and every device the same number of "
                               f"experts (vllm-ascend stacks them into one tensor), got (devices, experts) {sorted(shapes)}")
    return ExpertMap(str(path), placement)


def expert_map_document(placement: list[list[list[int]]]) -> dict[str, Any]:
    """[MoE layer][EP rank] -> experts as the file MindSpeed-RL's cli/eplb_generate_map_ds.py writes."""
    return {"moe_layer_count": len(placement),
            "layer_list": [{"layer_id": layer, "device_count": len(ranks),
                            "device_list": [{"device_id": rank, "device_expert": [int(e) for e in experts]}
                                            for rank, experts in enumerate(ranks)]}
                           for layer, ranks in enumerate(placement)]}


def write_expert_map(path: str | Path, placement: list[list[list[int]]]) -> ExpertMap:
    """Write the map whole (a temporary file renamed over `path`) and read it back as a run will."""
    from mindspeed_rl.atomic_files import write_text_atomic

    write_text_atomic(Path(path), json.dumps(expert_map_document(placement), indent=4) + "\n")
    return read_expert_map(str(path))


def _layer(entry: dict[str, Any]) -> tuple[tuple[int, ...], ...]:
    devices = sorted(entry["device_list"], key=lambda device: int(device["device_id"]))
    if [int(device["device_id"]) for device in devices] != list(range(len(devices))):
        raise ValueError(f"layer {entry.get('layer_id')}: device_id must be 0..{len(devices) - 1}")
    return tuple(tuple(int(e) for e in device["device_expert"]) for device in devices)


def expert_slots(expert_map: ExpertMap, arch: Architecture, *, ep_size: int,
                 expert_parallel: bool) -> tuple[tuple[int, ...], ...]:
    """`expert_map.experts_per_rank()` once the map is checked against the model and vLLM's expert-parallel size."""
    where = expert_map.path
    if not arch.is_moe:
        raise ConfigError(KEY, f"{where}: an expert map for a model without experts")
    if not expert_parallel:
        raise ConfigError(KEY, f"{where}: EPLB places whole experts on expert-parallel ranks; it needs "
                               "generate_config.infer_expert_parallel_size > 1")
    moe_layers = sum(arch.is_moe_layer(layer) for layer in range(arch.num_layers))
    if len(expert_map.placement) != moe_layers:
        raise ConfigError(KEY, f"{where}: {len(expert_map.placement)} MoE layers, the model has {moe_layers}")
    if expert_map.device_count != ep_size:
        raise ConfigError(KEY, f"{where}: {expert_map.device_count} devices per layer, vLLM's expert parallelism "
                               f"here is infer TP x DP = {ep_size} ranks")
    for index, layer in enumerate(expert_map.placement):
        placed = {e for rank in layer for e in rank}
        if placed != set(range(arch.num_experts)):
            raise ConfigError(KEY, f"{where}: MoE layer {index} must place each of the {arch.num_experts} experts at "
                                   f"least once and no other, got {len(placed)} distinct ids from {min(placed)} to "
                                   f"{max(placed)}")
    return expert_map.experts_per_rank()


def vllm_expert_numel(arch: Architecture) -> int:
    """One whole vLLM expert under expert parallelism: w13 (gate and up, 2 F x H) and w2 (H x F)."""
    return 3 * arch.hidden_size * arch.moe_intermediate_size


def redundant_expert_numel(arch: Architecture, slots: tuple[tuple[int, ...], ...], layers: range, ep_rank: int,
                           ep_size: int) -> int:
    """Elements EP rank `ep_rank` holds beyond its even share (num_experts / EP per MoE layer) over the MoE layers of
    its vLLM stage (`layers`, global indices): the map's MoE layers are counted in model order."""
    moe_layers = [layer for layer in range(arch.num_layers) if arch.is_moe_layer(layer)]
    even = arch.num_experts // ep_size
    return sum((slots[moe_layers.index(layer)][ep_rank] - even) * vllm_expert_numel(arch)
               for layer in layers if arch.is_moe_layer(layer))
