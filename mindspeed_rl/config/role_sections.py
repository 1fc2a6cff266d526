"""The role sections of the resource config (ROLL's `actor_train`, `actor_infer`, `reference`, `critic`, `teacher`,
`rewards.<name>`) and ROLL's arithmetic of one role's devices and workers. config/resources.py places them together
(the module doc there says how)."""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, ClassVar, Optional

from mindspeed_rl.config.device_mapping import parse_device_mapping
from mindspeed_rl.errors import ConfigError



@dataclass(frozen=True, kw_only=True)
class RoleResources:
    """One role as placed: its devices (none for a CPU-only role) and its worker count."""

    key: str                     # the config section: "actor_infer", "rewards.code_sandbox"
    devices: tuple[int, ...]     # global device indices; () for CPU-only workers
    num_gpus_per_worker: int     # 0 for CPU-only workers
    world_size: int              # workers (Ray actors / ranks)
    source: str                  # the key the devices come from

    @property
    def cpu_only(self) -> bool:
        return not self.devices

    def worker_devices(self) -> list[tuple[int, ...]]:
        size = self.num_gpus_per_worker
        return [self.devices[i * size:(i + 1) * size] for i in range(self.world_size)] if size else []


def role_resources(key: str, *, device_mapping: Any = None, num_gpus_per_worker: Optional[int] = None,
                   world_size: Optional[int] = None, gpus_per_worker: Optional[int] = None,
                   gpus_per_worker_desc: str = "", cpu_allowed: bool = False) -> RoleResources:
    """ROLL's arithmetic for one role (``WorkerConfig.__post_init__``), with its checks.

    ``gpus_per_worker`` is the value the role must have (training 1, vLLM TP x PP), described by
    ``gpus_per_worker_desc``; None lets ``num_gpus_per_worker`` choose (default 1)."""
    if device_mapping is not None:
        devices = parse_device_mapping(device_mapping, f"{key}.device_mapping")
        if gpus_per_worker is not None:
            if num_gpus_per_worker is not None and num_gpus_per_worker != gpus_per_worker:
                raise ConfigError(f"{key}.num_gpus_per_worker",
                                  f"must be {gpus_per_worker_desc} (or left out), got {num_gpus_per_worker}")
            size = gpus_per_worker
        else:
            size = 1 if num_gpus_per_worker is None else num_gpus_per_worker
        if size < 1:
            raise ConfigError(f"{key}.num_gpus_per_worker", f"must be >= 1 for a role with a device_mapping (0 is for "
                                                            f"CPU-only roles, which give world_size alone), got {size}")
        if len(devices) % size != 0:
            raise ConfigError(f"{key}.device_mapping",
                              f"lists {len(devices)} devices, not divisible by num_gpus_per_worker={size} "
                              f"(world_size = len(device_mapping) // num_gpus_per_worker)")
        workers = len(devices) // size
        if world_size is not None and world_size != workers:
            raise ConfigError(f"{key}.world_size",
                              f"must equal len(device_mapping) // num_gpus_per_worker = {len(devices)} // {size} = "
                              f"{workers} (or be left out), got {world_size}")
        return RoleResources(key=key, devices=devices, num_gpus_per_worker=size, world_size=workers,
                             source=f"{key}.device_mapping")
    if world_size is not None:
        if not cpu_allowed:
            raise ConfigError(f"{key}.device_mapping", f"missing: {key} runs on devices; world_size alone describes "
                                                       "a CPU-only role (rewards.<name>)")
        if world_size < 0:
            raise ConfigError(f"{key}.world_size", f"must be >= 0, got {world_size}")
        if num_gpus_per_worker not in (None, 0):
            raise ConfigError(f"{key}.num_gpus_per_worker", "must be 0 (or left out) for a CPU-only role (world_size "
                                                            f"without device_mapping), got {num_gpus_per_worker}")
        return RoleResources(key=key, devices=(), num_gpus_per_worker=0, world_size=world_size,
                             source=f"{key}.world_size")
    raise ConfigError(key, "needs device_mapping (devices) or world_size (CPU-only workers)")


@dataclass(kw_only=True)
class RoleResourceConfig:
    """A role that runs on devices: `actor_train`, `actor_infer` or `reference` (ROLL's names).

    Left out, a role runs on the actor's devices (integrated, as MindSpeed-RL). See the module doc."""

    SECTION_KEY: ClassVar[str] = ""
    # The number of devices per worker this role must have; None: checked where it is known.
    GPUS_PER_WORKER: ClassVar[Optional[int]] = None

    # ROLL's string (e.g. list(range(0,8))) or a YAML list of device indices; null = the actor's devices.
    device_mapping: Any = None
    # Devices per worker: 1 for training roles, TP x PP for vLLM; computed, a stated value must agree.
    num_gpus_per_worker: Optional[int] = None
    # len(device_mapping) // num_gpus_per_worker; computed, a stated value must agree.
    world_size: Optional[int] = None

    def __post_init__(self) -> None:
        key = self.SECTION_KEY
        if self.device_mapping is not None:
            # At load, so that a bad string is refused with its key before anything else runs.
            role_resources(key, device_mapping=self.device_mapping, num_gpus_per_worker=self.num_gpus_per_worker,
                           world_size=self.world_size, gpus_per_worker=self.GPUS_PER_WORKER,
                           gpus_per_worker_desc=f"{self.GPUS_PER_WORKER} (a training role has one device per worker)")
        elif self.world_size is not None:
            role_resources(key, world_size=self.world_size)  # raises: world_size alone is for CPU-only roles
        elif self.num_gpus_per_worker is not None and self.num_gpus_per_worker < 1:
            raise ConfigError(f"{key}.num_gpus_per_worker", f"must be >= 1, got {self.num_gpus_per_worker}")


@dataclass(kw_only=True)
class ActorTrainResources(RoleResourceConfig):
    """`actor_train`: the Megatron ranks. Its device count is the actor's world size."""

    SECTION_KEY: ClassVar[str] = "actor_train"
    GPUS_PER_WORKER: ClassVar[Optional[int]] = 1


@dataclass(kw_only=True)
class ActorInferResources(RoleResourceConfig):
    """`actor_infer`: the vLLM engines, each on infer TP x PP devices."""

    SECTION_KEY: ClassVar[str] = "actor_infer"


@dataclass(kw_only=True)
class ReferenceResources(RoleResourceConfig):
    """`reference`: the reference model's forward ranks."""

    SECTION_KEY: ClassVar[str] = "reference"
    GPUS_PER_WORKER: ClassVar[Optional[int]] = 1


@dataclass(kw_only=True)
class CriticResources(RoleResourceConfig):
    """`critic` (ROLL's role; PPO with critic_config): the value model's training ranks: actor_train's (taking turns
    with the actor) or devices of its own after every other role's (a group of its own, training beside the actor)."""

    SECTION_KEY: ClassVar[str] = "critic"
    GPUS_PER_WORKER: ClassVar[Optional[int]] = 1


@dataclass(kw_only=True)
class TeacherResources(RoleResourceConfig):
    """`teacher` (ROLL's role; on-policy distillation): the teacher's forward ranks: actor_train's (taking turns,
    in the actor's layout) or devices of its own after every other role's (a group of its own, in its own layout)."""

    SECTION_KEY: ClassVar[str] = "teacher"
    GPUS_PER_WORKER: ClassVar[Optional[int]] = 1


@dataclass(kw_only=True)
class RewardResources:
    """`rewards.<name>`: a reward role. Either CPU workers running the rule verifiers of
    `rl_config.verifier_function` (weights `rl_config.verifier_weight`), `world_size` Ray actors; or, with
    `model_path`, a reward model (a Qwen2 sequence-classification checkpoint) run with Megatron on the actor's
    devices and ranks, co-resident and time-shared like the reference, its score added to the rule total
    times `weight`."""

    # CPU-only Ray actors that score a batch in parallel; 0 = in the driver process.
    world_size: Optional[int] = None
    # A reward model's devices: actor_train's (colocated) or left out, which means the same.
    device_mapping: Any = None
    num_gpus_per_worker: Optional[int] = None
    # An HF Qwen2ForSequenceClassification directory (num_labels=1), or `synthetic` for the demo's generated
    # one (needs synthetic_data.enabled). null: a rule-reward role.
    model_path: Optional[str] = None
    # The reward model's weight: reward = rule verifiers' weighted total + weight * score. Default 1.0.
    weight: Optional[float] = None

    @property
    def is_model(self) -> bool:
        return self.model_path is not None

    @property
    def model_weight(self) -> float:
        return 1.0 if self.weight is None else float(self.weight)

    def resources(self, key: str, actor_devices: tuple[int, ...] = (), actor_source: str = "") -> RoleResources:
        if self.is_model and self.device_mapping is None and self.world_size is None:
            # A reward model left without devices runs on the actor's, as the reference does.
            return RoleResources(key=key, devices=actor_devices, num_gpus_per_worker=1, world_size=len(actor_devices),
                                 source=actor_source or key)
        return role_resources(key, device_mapping=self.device_mapping, num_gpus_per_worker=self.num_gpus_per_worker,
                              world_size=self.world_size, cpu_allowed=True)


def check_reward_sections(rewards: Mapping[str, RewardResources]) -> None:
    """Each rewards.<name> section on its own: a reward model runs on devices and has a path; a weight belongs
    to a reward model. Raises ConfigError naming the key."""
    for name, section in rewards.items():
        key = f"rewards.{name}"
        if section.is_model:
            if not isinstance(section.model_path, str) or not section.model_path.strip():
                raise ConfigError(f"{key}.model_path", f"must name a checkpoint directory (or `synthetic`), got "
                                                       f"{section.model_path!r}")
            if section.device_mapping is None and section.world_size is not None:
                raise ConfigError(f"{key}.world_size",
                                  f"a reward model (model_path) runs on devices, but world_size={section.world_size} "
                                  "without device_mapping makes a CPU-only role: remove world_size (the model then "
                                  "runs on actor_train's devices) or give device_mapping")
            if section.num_gpus_per_worker not in (None, 1):
                raise ConfigError(f"{key}.num_gpus_per_worker", "must be 1 (or left out) for a reward model: it is a "
                                                                f"Megatron role, got {section.num_gpus_per_worker}")
        elif section.weight is not None:
            raise ConfigError(f"{key}.weight", "weights a reward model's score, but the section has no model_path; "
                                               "rule verifiers are weighted by rl_config.verifier_weight")
        if section.weight is not None and (isinstance(section.weight, bool) or not math.isfinite(section.weight)):
            raise ConfigError(f"{key}.weight", f"must be a finite number, got {section.weight!r}")
