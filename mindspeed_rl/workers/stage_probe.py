"""MindSpeed-RL's `msprobe_config` on a rank (config/msprobe.py): MindStudio's msprobe driven as their `MsProbe` class
drives it (mindspeed_rl/utils/utils.py there), with their stage tags, switches and paths.

- Stage dumps (`actor_train_dump`, `actor_infer_dump`, `reference_dump`, `critic_train_dump`): msprobe's
  PrecisionDebugger, task "statistics" at level L0 (each module's inputs and outputs, forward and backward: max, min,
  mean, L2 norm), around the RPCs of the switched-on stages, for debugger steps [step_start, step_end], written by
  msprobe under <dump_path>/<tag>/step<k>/... . The inference dump keeps response tokens [token_range_start,
  token_range_end], as theirs.
- Key data (`key_data_dump`): msprobe's SingleSave of each update micro-batch's old_log_prob, log_prob,
  ref_log_prob, advantages, loss and kl_loss (their actor loss functions' six), under <dump_path>/data/<key>/step<k>/
  rank<r>/micro_step<m>/.
- Configurations (`configurations_dump`): the run's configuration as <dump_path>/configurations.json, written by the
  driver at start (`write_configurations`).
- One step per update, as theirs (`MsProbe.step()` after actor_update; after critic_update on a critic's own ranks).

The rank's forwarder (workers/rank_worker.py) enters `around(rpc)` for every part RPC, as it does the profiler's.
msprobe patches Megatron's and triton's functions when imported: it is imported only when `msprobe` is true.
"""
from __future__ import annotations

import contextlib
import json
import os
from dataclasses import asdict
from pathlib import Path
from typing import Callable, Iterator, Optional

# Their tags -> (the RPC here, the switch that turns it on, the part and attribute path of the model to hook).
TAGS: dict[str, tuple[str, str, tuple[str, ...]]] = {
    "actor_generate_sequences": ("generate_sequences", "actor_infer_dump", ("inference engine", "inference_model",
                                                                            "model")),
    "actor_compute_log_prob": ("compute_log_prob", "actor_train_dump", ("training engine", "model")),
    "actor_update": ("update", "actor_train_dump", ("training engine", "model")),
    "reference_compute_log_prob": ("compute_ref_log_prob", "reference_dump", ("reference", "reference", "model")),
    "critic_compute_values": ("compute_values", "critic_train_dump", ("critic", "critic", "model")),
    "critic_update": ("update_critic", "critic_train_dump", ("critic", "critic", "model")),
}
# Their actor loss functions' key data, in their names.
KEY_DATA = ("old_log_prob", "log_prob", "ref_log_prob", "advantages", "loss", "kl_loss")


class StageProbe:
    def __init__(self, settings, *, parts: dict, steps_on: str):
        """`parts`: the rank's parts by name (filled as they are built); `steps_on`: the RPC after which a step ends on
        this rank (the actor's update, or a critic's alone)."""
        from msprobe.core import SingleSave
        from msprobe.core.common.runtime import Runtime
        from msprobe.pytorch import PrecisionDebugger

        # msprobe 26.2 declares Runtime.current_rank by annotation only: a hook that fires before a start in the step
        # range has set it (a stage outside [step_start, step_end]) reads a missing attribute.
        if not hasattr(Runtime, "current_rank"):
            Runtime.current_rank = None

        self.settings, self.parts, self.steps_on = settings, parts, steps_on
        self.saver = SingleSave(settings.dump_path) if settings.key_data_dump else None
        switches = {"actor_train_dump": settings.actor_train_dump, "actor_infer_dump": settings.actor_infer_dump,
                    "reference_dump": settings.reference_dump, "critic_train_dump": settings.critic_train_dump}
        self.debugger = None
        if any(switches.values()):
            self.debugger = PrecisionDebugger(task="statistics", level="L0", dump_path=settings.dump_path,
                                              step=[f"{settings.step_start}-{settings.step_end}"])
        self.tag_of = {rpc: tag for tag, (rpc, switch, _) in TAGS.items() if switches[switch]}
        self.hooked: list = []

    @contextlib.contextmanager
    def around(self, rpc: str) -> Iterator[None]:
        """The RPC under the debugger when its stage is switched on and its model is on this rank; the step ends
        after the step's RPC."""
        tag, model = self.tag_of.get(rpc), None
        if tag is not None and self.debugger is not None:
            model = _model_of(self.parts, TAGS[tag][2])
        if model is None:
            yield
        else:
            self._start(tag, model)
            try:
                yield
            finally:
                self.debugger.stop()
                self.debugger.service.reset_status()
        if rpc == self.steps_on:
            self.step()

    def _start(self, tag: str, model) -> None:
        # msprobe sets a model up at its first start in the step range; later starts only switch the dump on (their
        # first_start flag, cleared by msprobe once it has set the model up).
        service = self.debugger.service
        service.first_start = model not in self.hooked
        service.config.dump_path = os.path.join(self.settings.dump_path, tag)
        if tag == "actor_generate_sequences":
            self.debugger.start(model=model, token_range=[self.settings.token_range_start,
                                                          self.settings.token_range_end])
        else:
            self.debugger.start(model=model)
        if not service.first_start and model not in self.hooked:
            self.hooked.append(model)

    def save_key_data(self, data: dict) -> None:
        """One micro-batch's key data (None values left out), when key_data_dump is on."""
        if self.saver is not None:
            self.saver.save({key: value.detach() for key, value in data.items() if value is not None})

    def step(self) -> None:
        if self.saver is not None:
            self.saver.step()
        if self.debugger is not None:
            self.debugger.step()


def _model_of(parts: dict, path: tuple[str, ...]):
    """The module at `path` (part name, then attributes), or None where this rank does not hold it (a reference that
    is the actor's backbone under LoRA is dumped as the actor)."""
    value = parts.get(path[0])
    for attribute in path[1:]:
        value = getattr(value, attribute, None)
    return value


def probe_of(config, parts: dict, part_names: tuple[str, ...]) -> Optional[StageProbe]:
    """The rank's probe when msprobe_config.msprobe is on, else None."""
    settings = config.msprobe_config
    if settings is None or not settings.msprobe:
        return None
    return StageProbe(settings, parts=parts, steps_on="update" if "training engine" in part_names else "update_critic")


def key_data_saver(probe: Optional[StageProbe]) -> Optional[Callable[[dict], None]]:
    return probe.save_key_data if probe is not None and probe.saver is not None else None


def write_configurations(config) -> None:
    """Their `configurations_dump`: the run's configuration as <dump_path>/configurations.json (their sections by
    their names where they have them), written atomically by the driver at start."""
    from mindspeed_rl.atomic_files import write_text_atomic

    settings = config.msprobe_config
    if settings is None or not settings.msprobe or not settings.configurations_dump:
        return
    tree = asdict(config)
    sections = {"actor": tree.pop("actor_config"), "rl": tree.pop("rl_config"), "generate": tree.pop("generate_config"),
                **tree}
    write_text_atomic(Path(settings.dump_path) / "configurations.json",
                      json.dumps(sections, indent=1, sort_keys=True, default=str))

