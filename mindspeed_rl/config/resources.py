"""Roles and devices, in ROLL's terms: `device_mapping`, `num_gpus_per_worker`, `world_size`, `num_gpus_per_node`.

The sections (all optional, top level, as in ROLL's YAMLs)::

    num_gpus_per_node: 8
    actor_train:   {device_mapping: list(range(0,16))}                          # 16 // 1 = 16 workers
    actor_infer:   {device_mapping: list(range(0,12)), num_gpus_per_worker: 2}  # 12 // 2 = 6 workers
    reference:     {device_mapping: list(range(0,16))}
    critic:        {device_mapping: list(range(0,16))}                          # PPO (critic_config)
    rewards:
      code_sandbox: {world_size: 8}                                             # CPU only: 8 Ray actors
      helpfulness: {model_path: /ckpt/qwen2-rm, weight: 0.5}                    # a reward model, actor's devices

* ``device_mapping`` lists global device indices. ROLL runs ``eval()`` on the string; here it is read by
  :func:`parse_device_mapping` (``ast.parse`` and a whitelist walk; nothing is ever evaluated) and may
  also be a YAML list.
* ``world_size = len(device_mapping) // num_gpus_per_worker``; the length must divide evenly. Training
  roles (``actor_train``, ``reference``) have ``num_gpus_per_worker`` 1; the vLLM role ``actor_infer``
  has ``generate_config.infer_tensor_parallel_size * infer_pipeline_parallel_size``. Both are computed;
  a stated value that disagrees is an error.
* A role with ``world_size`` and no ``device_mapping`` is CPU-only (``num_gpus_per_worker`` 0).
* MindSpeed-RL's integrated keys map onto the same model: ``rl_config.use_integrated_worker: true`` with
  ``rl_config.actor_resource.num_npus: N`` is ``actor_train = actor_infer = reference = range(N)``. A role
  section left out takes the actor's devices. ``num_npus`` and ``actor_train.device_mapping`` both given
  must agree.
* Colocated (train and infer share devices and take turns) or disaggregated (disjoint devices) follows
  from the mappings; ``rl_config.use_integrated_worker: false`` declares disaggregated, and then shared
  devices are an error.

:func:`build_resource_plan` runs all of that and gives a :class:`ResourcePlan` (per role its devices and
world size, the mode, the cluster size, a device -> roles table). config/supported.py then refuses
what the engine does not run yet: anything but colocated roles on the same devices ``0..N-1`` (or
actor_infer on the next ones), a reward model off the actor's devices, more than one reward model or rule
role.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Optional

from mindspeed_rl.config.device_mapping import format_devices
from mindspeed_rl.config.role_sections import (RewardResources, RoleResourceConfig, RoleResources,
                                               check_reward_sections, role_resources)
from mindspeed_rl.errors import ConfigError

INFER_ROLE = "actor_infer"
NUM_NPUS_KEY = "rl_config.actor_resource.num_npus"
INTEGRATED_KEY = "rl_config.use_integrated_worker"
COLOCATED, DISAGGREGATED = "colocated", "disaggregated"


# --- the plan --------------------------------------------------------------------------------------


@dataclass(frozen=True, kw_only=True)
class ResourcePlan:
    """Every role's placement, derived from the whole config."""

    roles: tuple[RoleResources, ...]   # actor_train, actor_infer, reference, then rewards.<name>
    mode: str                          # COLOCATED or DISAGGREGATED (actor_train vs actor_infer)
    num_gpus_per_node: Optional[int]

    def role(self, key: str) -> RoleResources:
        for role in self.roles:
            if role.key == key:
                return role
        raise KeyError(key)

    @property
    def world_size(self) -> int:
        """The actor's ranks (actor_train's workers)."""
        return self.role("actor_train").world_size

    @property
    def cluster_size(self) -> int:
        """Devices the plan needs: the largest index + 1 (ROLL)."""
        return max((max(role.devices) for role in self.roles if role.devices), default=0) + 1

    @property
    def num_nodes(self) -> Optional[int]:
        return math.ceil(self.cluster_size / self.num_gpus_per_node) if self.num_gpus_per_node else None

    def device_roles(self, absent: tuple[str, ...] = ()) -> dict[int, list[str]]:
        """Device index -> the roles placed on it, in plan order (less the `absent` ones)."""
        table: dict[int, list[str]] = {device: [] for device in range(self.cluster_size)}
        for role in self.roles:
            if role.key in absent:
                continue
            for device in role.devices:
                table[device].append(role.key)
        return table

    def check_cluster(self, available_devices: int, *, num_nodes: Optional[int] = None, what: str = "devices") -> None:
        """The devices the mappings name must exist: ``available_devices`` in all, and with
        num_gpus_per_node, ``num_gpus_per_node x num_nodes``. Raises ConfigError naming the mapping."""
        capacity, desc = available_devices, f"{available_devices} {what}"
        if self.num_gpus_per_node and num_nodes is not None and self.num_gpus_per_node * num_nodes < capacity:
            capacity = self.num_gpus_per_node * num_nodes
            desc = f"num_gpus_per_node={self.num_gpus_per_node} x {num_nodes} node(s) = {capacity} {what}"
        if self.cluster_size <= capacity:
            return
        highest = max((role for role in self.roles if role.devices), key=lambda role: max(role.devices))
        device = max(highest.devices)
        raise ConfigError(highest.source, f"names device {device}, beyond the cluster: it has {desc} "
                                          f"(indices 0..{capacity - 1}), the mappings need {self.cluster_size}")

    def check_ray_cluster(self, device: str) -> None:
        """check_cluster against the running Ray cluster: its devices of this kind (on CPU, the logical
        CPUs the ranks take one each of) and its live nodes."""
        import ray

        resource = {"cuda": "GPU", "npu": "NPU"}.get(device, "CPU")
        nodes = sum(1 for node in ray.nodes() if node.get("Alive"))
        self.check_cluster(int(ray.cluster_resources().get(resource, 0)), num_nodes=nodes,
                           what=f"{resource} in the Ray cluster")

    def table(self, device: str = "", absent: tuple[str, ...] = ()) -> str:
        """The device -> roles table printed at start, and each role's figures; ``device`` names the kind
        (cpu, cuda, npu); ``absent`` roles this run does not start (the reference without a KL term)."""
        train, infer = self.role("actor_train"), self.role(INFER_ROLE)
        if self.mode == COLOCATED:
            shared = format_devices(sorted(set(train.devices) & set(infer.devices)))
            head = f"colocated: actor_train and actor_infer take turns on device(s) {shared}"
        else:
            head = (f"disaggregated: actor_train on device(s) {format_devices(train.devices)}, "
                    f"actor_infer on device(s) {format_devices(infer.devices)}")
        kind = f"{device} device(s)".lstrip() + (": rank processes" if device == "cpu" else "")
        nodes = f", {self.num_nodes} node(s) of num_gpus_per_node={self.num_gpus_per_node}" if self.num_nodes else ""
        lines = [f"[resources] {head} ({self.cluster_size} {kind}{nodes})"]
        rows: list[tuple[str, str, str]] = []
        by_device = self.device_roles(absent)
        for devices, roles in _runs(by_device, self.num_gpus_per_node):
            node = ""
            if self.num_gpus_per_node:
                node = format_devices(sorted({d // self.num_gpus_per_node for d in devices}))
            rows.append((format_devices(devices), node, ", ".join(roles) or "(idle)"))
        for role in self.roles:
            if role.cpu_only:
                rows.append(("cpu-only", "", f"{role.key} ({role.world_size} worker(s))" if role.world_size
                             else f"{role.key} (in the driver)"))
        width = max(len(r[0]) for r in rows + [("device", "", "")])
        node_width = max(len(r[1]) for r in rows + [("", "node", "")]) if self.num_gpus_per_node else 0
        header = f"  {'device':<{width}}  " + (f"{'node':<{node_width}}  " if node_width else "") + "roles"
        lines.append(header)
        for devices, node, roles in rows:
            lines.append(f"  {devices:<{width}}  " + (f"{node:<{node_width}}  " if node_width else "") + roles)
        key_width = max(len(role.key) for role in self.roles)
        lines.append(f"  {'role':<{key_width}}  devices  num_gpus_per_worker  world_size  from")
        for role in (r for r in self.roles if r.key not in absent):
            lines.append(f"  {role.key:<{key_width}}  {format_devices(role.devices):<7}  "
                         f"{role.num_gpus_per_worker:<19}  {role.world_size:<10}  {role.source}")
        return "\n".join(lines)


def _runs(by_device: dict[int, list[str]], per_node: Optional[int]) -> list[tuple[list[int], list[str]]]:
    """Consecutive devices of one node that hold the same roles, grouped."""
    runs: list[tuple[list[int], list[str]]] = []
    for device, roles in sorted(by_device.items()):
        same_node = not per_node or device // per_node == (device - 1) // per_node
        if runs and runs[-1][1] == roles and runs[-1][0][-1] == device - 1 and same_node:
            runs[-1][0].append(device)
        else:
            runs.append(([device], roles))
    return runs


def actor_world_size(actor_train: Optional[RoleResourceConfig], num_npus: Optional[int]) -> tuple[int, str]:
    """The actor's ranks and the key they come from: ``actor_train.device_mapping`` (ROLL) or
    ``rl_config.actor_resource.num_npus`` (MindSpeed-RL); both given must agree."""
    mapped = actor_train is not None and actor_train.device_mapping is not None
    if not mapped:
        if num_npus is None:
            raise ConfigError(NUM_NPUS_KEY, "missing: set it (MindSpeed-RL: the actor's ranks) or "
                                            "actor_train.device_mapping (ROLL)")
        return num_npus, NUM_NPUS_KEY
    train = role_resources("actor_train", device_mapping=actor_train.device_mapping,
                           num_gpus_per_worker=actor_train.num_gpus_per_worker, world_size=actor_train.world_size,
                           gpus_per_worker=1, gpus_per_worker_desc="1")
    if num_npus is not None and num_npus != train.world_size:
        raise ConfigError("actor_train.device_mapping",
                          f"gives {train.world_size} training ranks ({format_devices(train.devices)}) but "
                          f"{NUM_NPUS_KEY}={num_npus}: both set the actor's world size; make them agree or remove one")
    return train.world_size, "actor_train.device_mapping"


def build_resource_plan(*, actor_train: Optional[RoleResourceConfig], actor_infer: Optional[RoleResourceConfig],
                        reference: Optional[RoleResourceConfig], rewards: Mapping[str, RewardResources],
                        num_gpus_per_node: Optional[int], num_npus: Optional[int], use_integrated_worker: bool,
                        infer_tensor_parallel_size: int, infer_pipeline_parallel_size: int,
                        more_roles: Mapping[str, Optional[RoleResourceConfig]] = {}) -> ResourcePlan:
    """Every role's devices and world size with the seed's checks (divisibility, vLLM's devices per
    worker, workers within a node, shared devices under a declared disaggregated layout). `more_roles`: training
    roles a run adds (PPO's critic, config/critic.py), each a section or None (the actor's devices). Pure: what the
    engine runs today is config/supported.py's business."""
    sections = {"actor_train": actor_train, "actor_infer": actor_infer, "reference": reference, **more_roles}
    mapped = [key for key, section in sections.items() if section is not None and section.device_mapping is not None]
    mapped += [f"rewards.{name}" for name, section in rewards.items() if section.device_mapping is not None]
    if not use_integrated_worker and not mapped:
        raise ConfigError(INTEGRATED_KEY, "must be true: this hybrid engine only has the integrated worker "
                                          "(reference and reward share actor_config; there is no "
                                          "ref_config/reward_config)")
    if num_gpus_per_node is not None and num_gpus_per_node < 1:
        raise ConfigError("num_gpus_per_node", f"must be >= 1, got {num_gpus_per_node}")
    world, world_key = actor_world_size(actor_train, num_npus)
    actor_devices = tuple(range(world))
    tp, pp = infer_tensor_parallel_size, infer_pipeline_parallel_size
    training = (1, "1 (a training role has one device per worker)")
    gpus_per_worker = {
        "actor_infer": (tp * pp, f"generate_config.infer_tensor_parallel_size * infer_pipeline_parallel_size = "
                                 f"{tp} * {pp} = {tp * pp} (vLLM's devices per worker)"),
    }
    roles = []
    for key, section in sections.items():
        required, desc = gpus_per_worker.get(key, training)
        if section is not None and section.device_mapping is not None:
            role = role_resources(key, device_mapping=section.device_mapping,
                                  num_gpus_per_worker=section.num_gpus_per_worker, world_size=section.world_size,
                                  gpus_per_worker=required, gpus_per_worker_desc=desc)
        else:
            # The actor's devices (MindSpeed-RL's integrated worker); a stated num_gpus_per_worker must
            # still agree (world_size alone, without device_mapping, is refused by the section).
            stated_gpus = section.num_gpus_per_worker if section is not None else None
            role = role_resources(key, device_mapping=list(actor_devices), num_gpus_per_worker=stated_gpus,
                                  gpus_per_worker=required, gpus_per_worker_desc=desc)
            role = RoleResources(key=key, devices=role.devices, num_gpus_per_worker=role.num_gpus_per_worker,
                                 world_size=role.world_size, source=world_key)
        roles.append(role)
    check_reward_sections(rewards)
    for name, section in rewards.items():
        roles.append(section.resources(f"rewards.{name}", actor_devices=roles[0].devices, actor_source=roles[0].source))
    if num_gpus_per_node:
        _check_workers_within_nodes(roles, num_gpus_per_node)
    train, infer = roles[0], roles[1]
    shared = sorted(set(train.devices) & set(infer.devices))
    if not use_integrated_worker and shared:
        raise ConfigError(f"{infer.source}",
                          f"shares devices {format_devices(shared)} with actor_train ({train.source}), but "
                          f"{INTEGRATED_KEY}=false says the roles run disaggregated, each on its own devices: make "
                          "the mappings disjoint, or set it true to colocate them")
    return ResourcePlan(roles=tuple(roles), mode=COLOCATED if shared else DISAGGREGATED,
                        num_gpus_per_node=num_gpus_per_node)


def _check_workers_within_nodes(roles: list[RoleResources], num_gpus_per_node: int) -> None:
    for role in roles:
        for index, devices in enumerate(role.worker_devices()):
            nodes = sorted({device // num_gpus_per_node for device in devices})
            if len(nodes) > 1:
                raise ConfigError(f"{role.key}.device_mapping",
                                  f"worker {index} spans nodes {nodes}: its devices {format_devices(devices)} "
                                  f"cross a node boundary (num_gpus_per_node={num_gpus_per_node}); a worker's "
                                  "devices must be on one node")
