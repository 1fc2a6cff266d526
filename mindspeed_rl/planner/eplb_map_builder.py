"""EPLB's redundant-expert map from the rollouts' expert loads: the placement MindSpeed-RL's cli/eplb_generate_map_ds.py
makes (DeepSeek's open EPLB policy, then its per-device de-duplication), written in vllm-ascend's format
(planner/expert_map.py reads it; `generate_config.expert_map_path`).

Per MoE layer, with loads w[e] (tokens expert e received, engines/eplb_counts.py):
1. nodes: the experts form `num_groups` consecutive groups; the groups are packed onto `num_nodes` nodes, the same
   number each, heaviest group first onto the lightest node that has room (`balanced_packing`);
2. replicas: each node's slots (num_replicas / num_nodes) start with one copy of each of its experts; every further
   slot copies the expert whose load per copy is the highest (`replicate_experts`);
3. devices: each node's copies, each carrying its expert's load / copies, are packed onto its devices the same way as
   in step 1 (num_replicas / num_gpus slots each); a device lists its copies in the order they were packed;
4. de-duplication: a device given two copies of one expert keeps the first; the second becomes the expert not on that
   device whose load is closest to it (`find_replacement`).
When num_groups is not a multiple of num_nodes the policy is global: one group, one node.

Ties go to the lower index (the first lightest pack, the first most loaded expert, a stable heaviest-first order),
which is what torch's CPU `max` and Python's `min` give theirs; loads are float64 here (theirs float32, whose rounding
above 2^24 tokens may break a near-tie the other way). Their de-duplication reads `weight.size(1)` of a one-layer
vector and fails whenever a device holds a duplicate; here it does what its docstring says.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True, kw_only=True)
class EplbShape:
    """cli/eplb_generate_map_ds.py's arguments, checked against each other and the experts."""

    num_replicas: int  # physical expert slots per MoE layer over all devices, the logical experts included
    num_groups: int
    num_nodes: int
    num_gpus: int  # devices = vLLM's expert-parallel ranks (infer TP x DP)

    def __post_init__(self) -> None:
        for name in ("num_replicas", "num_groups", "num_nodes", "num_gpus"):
            if getattr(self, name) <= 0:
                raise ValueError(f"--{name} must be positive, got {getattr(self, name)}")
        if self.num_gpus % self.num_nodes:
            raise ValueError(f"--num_gpus {self.num_gpus} must be a multiple of --num_nodes {self.num_nodes}")
        if self.num_replicas % self.num_gpus:
            raise ValueError(f"--num_replicas {self.num_replicas} must be a multiple of --num_gpus {self.num_gpus} "
                             "(every device holds the same number of experts)")

    @property
    def slots_per_gpu(self) -> int:
        return self.num_replicas // self.num_gpus

    def policy(self) -> tuple[int, int]:
        """(groups, nodes) of the policy used: hierarchical when the groups divide over the nodes, else global."""
        return (self.num_groups, self.num_nodes) if self.num_groups % self.num_nodes == 0 else (1, 1)

    def check_experts(self, num_experts: int) -> None:
        groups, nodes = self.policy()
        if num_experts % groups:
            raise ValueError(f"--num_groups {groups} must divide the {num_experts} experts")
        if self.num_replicas < num_experts:
            raise ValueError(f"--num_replicas {self.num_replicas} must be at least the {num_experts} experts")
        if self.slots_per_gpu > num_experts:
            raise ValueError(f"{self.slots_per_gpu} slots per device exceed the {num_experts} experts: a device "
                             "would hold an expert twice")


def balanced_packing(loads: np.ndarray, num_packs: int) -> tuple[np.ndarray, np.ndarray]:
    """Items -> (pack, rank in pack), len(loads) / num_packs items per pack: heaviest first onto the lightest pack
    with room (the first of equals). One item per pack: item i is pack i's."""
    items = len(loads)
    if items % num_packs:
        raise ValueError(f"{items} items do not divide into {num_packs} packs")
    per_pack = items // num_packs
    if per_pack == 1:
        return np.arange(items), np.zeros(items, dtype=np.int64)
    pack_of, rank_of = np.full(items, -1, dtype=np.int64), np.full(items, -1, dtype=np.int64)
    pack_load, pack_size = np.zeros(num_packs), np.zeros(num_packs, dtype=np.int64)
    for item in np.argsort(-loads, kind="stable"):
        open_packs = np.flatnonzero(pack_size < per_pack)
        pack = open_packs[np.argmin(pack_load[open_packs])]
        pack_of[item], rank_of[item] = pack, pack_size[pack]
        pack_load[pack] += loads[item]
        pack_size[pack] += 1
    return pack_of, rank_of


def replicate_experts(loads: np.ndarray, num_slots: int) -> tuple[np.ndarray, np.ndarray]:
    """Slots -> logical expert (one copy of each first, then the highest load per copy) and copies per expert."""
    experts = len(loads)
    slot_expert = np.concatenate([np.arange(experts), np.zeros(num_slots - experts, dtype=np.int64)])
    copies = np.ones(experts, dtype=np.int64)
    for slot in range(experts, num_slots):
        chosen = int(np.argmax(loads / copies))
        slot_expert[slot] = chosen
        copies[chosen] += 1
    return slot_expert, copies


def place_layer(loads: np.ndarray, shape: EplbShape) -> list[list[int]]:
    """One MoE layer's loads -> [device] -> the logical experts of its slots (steps 1-3)."""
    groups, nodes = shape.policy()
    experts = len(loads)
    group_size, groups_per_node, experts_per_node = experts // groups, groups // nodes, experts // nodes
    group_node, group_rank = balanced_packing(loads.reshape(groups, group_size).sum(1), nodes)
    # node_order[k]: the logical expert in node-major position k (node n owns positions n x experts_per_node ...).
    position = ((group_node * groups_per_node + group_rank) * group_size)[:, None] + np.arange(group_size)
    node_order = np.empty(experts, dtype=np.int64)
    node_order[position.reshape(-1)] = np.arange(experts)
    gpus_per_node, slots_per_node = shape.num_gpus // nodes, shape.num_replicas // nodes
    placement: list[list[int]] = []
    for node in range(nodes):
        members = node_order[node * experts_per_node:(node + 1) * experts_per_node]
        slot_member, copies = replicate_experts(loads[members], slots_per_node)
        device, rank = balanced_packing((loads[members] / copies)[slot_member], gpus_per_node)
        for local in range(gpus_per_node):
            slots = np.flatnonzero(device == local)
            placement.append([int(members[slot_member[s]]) for s in slots[np.argsort(rank[slots])]])
    return placement


def find_replacement(device_experts: list[int], expert: int, loads: np.ndarray) -> int:
    """The expert not on the device whose load is closest to `expert`'s (the first of equals). (Theirs also skips
    experts already tried, a set that stays empty: every candidate is off the device.)"""
    candidates = [e for e in range(len(loads)) if e not in device_experts]
    if not candidates:
        raise ValueError(f"no replacement for a second copy of expert {expert}: every expert is on the device")
    return min(candidates, key=lambda e: abs(loads[e] - loads[expert]))


def deduplicate(device_experts: list[int], loads: np.ndarray) -> list[int]:
    """Step 4 on one device: the second copy of an expert becomes the closest-loaded expert not there."""
    out = list(device_experts)
    seen: set[int] = set()
    for slot, expert in enumerate(out):
        if expert in seen:
            out[slot] = find_replacement(out, expert, loads)
        seen.add(out[slot])
    return out


def build_placement(loads: np.ndarray, shape: EplbShape) -> list[list[list[int]]]:
    """[MoE layers, experts] loads -> [MoE layer][device] -> logical experts (vllm-ascend's map, planner/expert_map)."""
    if loads.ndim != 2 or loads.shape[1] == 0:
        raise ValueError(f"loads must be [MoE layers, experts], got shape {loads.shape}")
    shape.check_experts(loads.shape[1])
    weights = loads.astype(np.float64)
    return [[deduplicate(device, weights[layer]) for device in place_layer(weights[layer], shape)]
            for layer in range(len(weights))]
