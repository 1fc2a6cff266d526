"""A rank holds parts (workers/rank_worker.py): the training engine, the inference engine, the reference, the reward
model, the critic. Each part is an object built with the rank's one `RankContext` (verl's WorkerDict keeps one instance
per role); the rank forwards the RPCs its parts declare. Each part declares, on its own class:

- its RPCs: methods decorated with `@phase_rpc` (their residency row, their console name, whether they change the
  training weights) or `@part_rpc` (no row: bridge set-up and the like);
- `STATES`: the state groups it registers with the offloader (rows of memory/residency.py); the rank's residency
  policy is derived from the union of its parts' states (`ResidencyPolicy.for_states`), the planner's from the run's;
- `PUSH_END`: its end of the weight push ("source": it holds the training weights; "destination": vLLM's);
- `STAGE`: built before the sharding manager settles the device (Megatron engines) or after (vLLM, which sizes its
  KV cache by what is free);
- `CHECKPOINT`: the RPCs that save and load its trained state in a run's checkpoint, and where its LR schedule's
  state goes in trainer_state.json (None: nothing of it is saved);
- `BORROWS`: the parts (by NAME) whose engines it may use instead of building its own (the reference under LoRA's
  shared backbone runs the training engine with its adapters off); the rank hands it those parts, built first;
- `build()`: builds its engine(s).

A role is a tuple of parts (workers/roles.py). Routing a call to a rank group, the calls after which the inference
weights are stale, the console's phase names and the architecture page's parts table all derive from these
declarations; nothing keeps a second list of RPC names.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, ClassVar

if TYPE_CHECKING:
    from mindspeed_rl.config import GRPOConfig
    from mindspeed_rl.parallel.layout import ParallelLayout
    from mindspeed_rl.parallel.megatron_state import RankGroups
    from mindspeed_rl.workers.rank_process import RankInfo

MEGATRON, VLLM = "megatron", "vllm"  # STAGE values
SOURCE, DESTINATION = "source", "destination"  # PUSH_END values


@dataclass(frozen=True)
class Checkpointed:
    """A part's share of a run's checkpoint: `save(dir, with_optimizer=, with_rng=)` returns its scheduler state,
    `load(dir, load_optimizer=, load_rng=, scheduler_state=)` restores it; `state_key` names that state in
    trainer_state.json."""

    save: str
    load: str
    state_key: str


@dataclass(frozen=True, kw_only=True)
class RankContext:
    """What every part of a rank is built with, the same object for all of them: the config, where the rank sits (its
    layout and, on a training rank, the parallel groups Megatron made from it), the device, and the rank's mechanisms
    (the offloader its states register with, the sharding manager that moves them, the ledger that counts them)."""

    config: "GRPOConfig"
    rank_info: "RankInfo"
    role: str
    part_names: tuple[str, ...]  # the rank's composition, in its role's order
    model_dir: str
    ref_model_dir: str
    accelerator: Any
    layout: "ParallelLayout"
    groups: "RankGroups | None"  # None on a rank without a training layout (vLLM makes its own groups)
    offloader: Any
    sharding_manager: Any
    ledger: Any
    progress: Callable[[str], None]  # one `[init]` line per start-up step (rank 0 speaks for all)
    hf_checkpoint: Callable[[str], tuple]  # (spec, state) of an HF directory, read once per initialize
    model_options: Callable[[], Any]  # the config's model knobs with this device's kernels, made once
    # msprobe_config's key-data dump of each update micro-batch (workers/stage_probe.py); None when it is off.
    key_data: Callable[[dict], None] | None = None


class Part:
    NAME: ClassVar[str] = ""
    STATES: ClassVar[frozenset[str]] = frozenset()
    STAGE: ClassVar[str] = MEGATRON
    PUSH_END: ClassVar[str | None] = None
    CHECKPOINT: ClassVar[Checkpointed | None] = None
    BORROWS: ClassVar[tuple[str, ...]] = ()

    def __init__(self, context: RankContext, borrowed: dict[str, "Part"] | None = None):
        self.context = context
        self.borrowed = borrowed or {}

    # What `@phase_rpc` and the parts' own code read, from the one context.
    @property
    def config(self) -> "GRPOConfig":
        return self.context.config

    @property
    def ledger(self):
        return self.context.ledger

    @property
    def sharding_manager(self):
        return self.context.sharding_manager

    def build(self) -> None:
        raise NotImplementedError


def part_rpc(method: Callable) -> Callable:
    """An RPC of a part that runs in no residency row (it moves no state and computes nothing on the device)."""
    method.rpc = True
    return method


def declared_rpcs(part: type) -> dict[str, Callable]:
    """The RPCs `part` declares on its own class, by name."""
    return {name: fn for name, fn in vars(part).items() if callable(fn) and (hasattr(fn, "phase") or hasattr(fn, "rpc"))}


def part_declaring(parts, method: str) -> type | None:
    """Which of `parts` declares RPC `method` (None: the rank base's own, e.g. offload_states)."""
    return next((part for part in parts if method in declared_rpcs(part)), None)
