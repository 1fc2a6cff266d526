"""`msprobe_config`: MindSpeed-RL's precision-debugging section (their config_cls/mindstudio_config.py MsprobeConfig):
MindStudio's msprobe dumps key data (the actor's, the reference's and the critic's inputs and outputs per stage and
step, tensor statistics through msprobe's PrecisionDebugger) and the run's configurations under `dump_path`.

Here, audited as a no-effect claim while `msprobe: false`, their default: MindSpeed-RL then returns from
MsProbe.config_init before reading any other key (mindspeed_rl/utils/utils.py), so no key of the section computes a
value, holds a byte of memory or writes a file, there or here. The section is checked key by key (names, types,
ranges, so that a typo is caught), then dropped before the schema and listed once in the start line's no-effect list,
as config/no_effect.py's keys are (`runtime.strict_keys: true` makes it an error). `msprobe: true` is one config
error: this engine has no msprobe hooks in its workers (neither MindStudio's dump nor a statistics dump of its own),
and accepting the switch would promise dumps that never appear. For where a step's time and memory go,
`profiler_config.integrated` works (config/profiler.py).
"""

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
        if self.msprobe:
            raise ConfigError(f"{_PREFIX}.msprobe",
                              "true is not supported: this engine has no msprobe hooks (MindStudio's key-data and "
                              "configuration dumps); set it false (then the section has no effect, as in "
                              "MindSpeed-RL); profiler_config.integrated profiles the stages")


SECTION_NOTICE = (f"{_PREFIX} (msprobe is false: MindStudio's precision dumps are off, and MindSpeed-RL then reads no "
                  "other key of the section either)")


def drop_msprobe_section(tree: dict[str, Any], *, strict: bool) -> tuple[list[str], list[ConfigError]]:
    """Check `msprobe_config` and remove it from the tree: its notice (msprobe false), or its errors."""
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
