"""Where the ranks go: Ray placement groups with one bundle per device slot, packed per node.

With `num_gpus_per_node` (ROLL's key) the slots are cut into nodes of that many and each node is
one STRICT_PACK placement group, so the ranks of a node share it as the device_mapping says (rank r
on node r // num_gpus_per_node). Without it, one PACK group holds every slot (one machine, or
whatever Ray packs). The accelerator is a Ray resource: `GPU`, or the custom `NPU` resource that
`ray start --resources='{"NPU": 8}'` declares; on CPU a slot is CPU only, so every layout runs here.
"""
from __future__ import annotations

import time
from dataclasses import dataclass

import ray
from ray.util.placement_group import PlacementGroup, placement_group, remove_placement_group

from mindspeed_rl import interrupts
from mindspeed_rl.config import ConfigError



def slot_bundle(device: str, cpus_per_slot: float) -> dict[str, float]:
    if device == "cuda":
        return {"GPU": 1, "CPU": cpus_per_slot}
    if device == "npu":
        return {"NPU": 1, "CPU": cpus_per_slot}
    return {"CPU": cpus_per_slot}


def node_slices(world_size: int, num_gpus_per_node: int | None) -> list[range]:
    """The ranks of each node, in order: [0, per_node), [per_node, 2 per_node), ..."""
    per_node = num_gpus_per_node or world_size
    return [range(start, min(start + per_node, world_size)) for start in range(0, world_size, per_node)]


@dataclass(frozen=True)
class Placement:
    groups: list[PlacementGroup]
    # rank -> (group index, bundle index)
    slots: list[tuple[int, int]]

    def strategy_for(self, rank: int):
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        group, bundle = self.slots[rank]
        return PlacementGroupSchedulingStrategy(self.groups[group], placement_group_bundle_index=bundle)

    def remove(self) -> None:
        for group in self.groups:
            try:
                remove_placement_group(group)
            except Exception:  # already gone with the cluster
                pass


def place_ranks(world_size: int, *, device: str, cpus_per_slot: float, num_gpus_per_node: int | None,
                timeout_seconds: float) -> Placement:
    """Reserve the slots; a request the cluster cannot satisfy fails in `timeout_seconds` naming the resource."""
    nodes = node_slices(world_size, num_gpus_per_node)
    strategy = "STRICT_PACK" if num_gpus_per_node else "PACK"
    groups, slots = [], []
    with interrupts.shielded():
        for index, ranks in enumerate(nodes):
            groups.append(placement_group([slot_bundle(device, cpus_per_slot)] * len(ranks), strategy=strategy))
            slots += [(index, bundle) for bundle in range(len(ranks))]
    placement = Placement(groups=groups, slots=slots)
    try:
        _wait_until_ready(placement, world_size, device, cpus_per_slot, timeout_seconds)
    except BaseException:
        placement.remove()
        raise
    return placement


def _wait_until_ready(placement: Placement, world_size: int, device: str, cpus_per_slot: float,
                      timeout_seconds: float) -> None:
    """Ray waits forever for resources that never come; a run says which is missing instead."""
    end = time.monotonic() + timeout_seconds
    pending = [group.ready() for group in placement.groups]
    while pending and time.monotonic() < end:
        with interrupts.shielded():
            ready, pending = ray.wait(pending, num_returns=len(pending), timeout=interrupts.RAY_WAIT_SLICE_SECONDS)
    if not pending:
        return
    needed = {resource: amount * world_size for resource, amount in slot_bundle(device, cpus_per_slot).items()}
    available = ray.cluster_resources()
    missing = {r: f"{amount:g} needed, {available.get(r, 0):g} in the cluster" for r, amount in needed.items()
               if available.get(r, 0) < amount}
    bundles = [len(group.bundle_specs) for group in placement.groups]
    detail = "; ".join(f"{r}: {text}" for r, text in missing.items()) or \
        f"the cluster has {dict(available)} but no node fits a group of {max(bundles)} slot(s) of {slot_bundle(device, cpus_per_slot)}"
    raise ConfigError("rl_config.actor_resource.num_npus",
                      f"Ray could not place {world_size} rank(s) within {timeout_seconds:.0f} s "
                      f"(runtime.placement_timeout_seconds): {detail}")
