"""`msprobe_config`: MindSpeed-RL's precision-debugging section (their config_cls/mindstudio_config.py MsprobeConfig,
docs/zh/features/msprobe.md): MindStudio's msprobe dumps the configurations, each update's key data and the stages'
module statistics under `dump_path`.

`msprobe: true` works as theirs (workers/stage_probe.py; msprobe is the `mindstudio-probe` package, which `make venv`
installs): `configurations_dump` writes <dump_path>/configurations.json at start,
`key_data_dump` each update micro-batch's six loss tensors, and the stage switches msprobe's statistics of every
module's inputs and outputs for debugger steps [step_start, step_end]. As in theirs, colocated (integrated) runs only:
a disaggregated actor is refused.

`msprobe: false` (their default) is a no-effect claim: MindSpeed-RL then returns from MsProbe.config_init before reading
any other key (mindspeed_rl/utils/utils.py), so no key of the section computes a value, holds a byte of memory or
writes a file, there or here. The section is then checked key by key (names, types, ranges, so that a typo is caught),
dropped before the schema and listed once in the start line's no-effect list, as config/no_effect.py's keys are
(`runtime.strict_keys: true` makes it an error).
"""

import importlib.util
import os
from dataclasses import dataclass, fields
from typing import Any, ClassVar

from mindspeed_rl.config.checks import require_non_negative
from mindspeed_rl.errors import ConfigError

_PREFIX = "msprobe_config"


@dataclass(kw_only=True)
class MsprobeConfig:
    """`msprobe_config`: their keys and defaults (their `role` is set by their code, not by the YAML)."""

    SECTION_KEY: ClassVar[str] = _PREFIX

    msprobe: bool = False
    dump_path: str = "./msprobe_dump"
    key_data_dump: bool = False
    configurations_dump: bool = False
    actor_train_dump: bool = False
    actor_infer_dump: bool = False
    # Response tokens [start, end] whose key data the inference dump keeps.
    token_range_start: int = 0
    token_range_end: int = 0
    reference_dump: bool = False
    critic_train_dump: bool = False
    # Iterations [start, end] dumped.
    step_start: int = 0
    step_end: int = 0

    def __post_init__(self) -> None:
        require_non_negative(_PREFIX, self, "token_range_start", "token_range_end", "step_start", "step_end")
        if self.token_range_end < self.token_range_start:
            raise ConfigError(f"{_PREFIX}.token_range_end", f"must be >= token_range_start={self.token_range_start}, "
                                                            f"got {self.token_range_end}")
        if self.step_end < self.step_start:
            raise ConfigError(f"{_PREFIX}.step_end", f"must be >= step_start={self.step_start}, got {self.step_end}")
        if self.msprobe and importlib.util.find_spec("msprobe") is None:
            raise ConfigError(f"{_PREFIX}.msprobe", "true needs MindStudio's msprobe (pip install mindstudio-probe, "
                                                    "which `make venv` installs)")
        # The ranks run elsewhere (Ray's working directory): a relative path is the driver's.
        self.dump_path = os.path.abspath(self.dump_path)


SECTION_NOTICE = (f"{_PREFIX} (msprobe is false: MindStudio's precision dumps are off, and MindSpeed-RL then reads no "
                  "other key of the section either)")


def drop_msprobe_section(tree: dict[str, Any], *, strict: bool) -> tuple[list[str], list[ConfigError]]:
    """Check `msprobe_config`: with msprobe true left for the schema (GRPOConfig.msprobe_config); else removed from
    the tree with its notice; or its errors."""
    section = tree.pop(_PREFIX, None)
    if section is None:
        return [], []
    if not isinstance(section, dict):
        return [], [ConfigError(_PREFIX, f"expected a mapping (MsprobeConfig), got {section!r}")]
    errors = _key_errors(section)
    if not errors:
        try:
            MsprobeConfig(**section)
        except ConfigError as error:
            errors.append(error)
    if errors:
        return [], errors
    if section.get("msprobe"):
        tree[_PREFIX] = section
        return [], []
    if strict:
        return [], [ConfigError(_PREFIX, "no effect on this engine (msprobe is false); remove it or set "
                                         "runtime.strict_keys=false")]
    return [SECTION_NOTICE], []


def _key_errors(section: dict[str, Any]) -> list[ConfigError]:
    """Unknown keys and values of the wrong type (bool for the switches, int for the ranges, str for the path)."""
    types = {field.name: field.type for field in fields(MsprobeConfig)}
    errors = []
    for key, value in section.items():
        expected = types.get(key)
        if expected is None:
            errors.append(ConfigError(f"{_PREFIX}.{key}", f"unknown key (valid keys of {_PREFIX}: {', '.join(types)})"))
        # bool is an int to Python, not to the YAML: `step_start: true` is a mistake.
        elif not isinstance(value, expected) or (expected is int and isinstance(value, bool)):
            errors.append(ConfigError(f"{_PREFIX}.{key}", f"expected {expected.__name__}, got {value!r}"))
    return errors


def check_msprobe_run(config) -> None:
    """msprobe on with a disaggregated actor: refused, as MindSpeed-RL collects in colocated (integrated) mode only."""
    settings = config.msprobe_config
    if settings is not None and settings.msprobe and config.disaggregated:
        raise ConfigError(f"{_PREFIX}.msprobe", "true with a disaggregated actor (actor_train and actor_infer on "
                                                "devices of their own): msprobe collects in colocated (integrated) "
                                                "runs only, as in MindSpeed-RL")
