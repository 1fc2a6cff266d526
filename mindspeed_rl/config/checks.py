"""Field checks shared by the config sections; each raises a ConfigError naming the full key."""

from collections.abc import Collection
from typing import Any, Optional

from mindspeed_rl.errors import ConfigError


def full_key(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix else name


def require_positive(prefix: str, section: Any, *names: str) -> None:
    """Each named field is > 0; None passes because it means "unset, use the engine's default"."""
    for name in names:
        value = getattr(section, name)
        if value is not None and value <= 0:
            raise ConfigError(full_key(prefix, name), f"must be > 0, got {value}")


def require_non_negative(prefix: str, section: Any, *names: str) -> None:
    for name in names:
        value = getattr(section, name)
        if value is not None and value < 0:
            raise ConfigError(full_key(prefix, name), f"must be >= 0, got {value}")


def require_choice(prefix: str, section: Any, name: str, choices: Collection[str]) -> None:
    value = getattr(section, name)
    if value not in choices:
        raise ConfigError(full_key(prefix, name), f"must be one of {', '.join(choices)}, got {value!r}")


def require_in_range(
    prefix: str,
    section: Any,
    name: str,
    low: float,
    high: float,
    *,
    low_open: bool = False,
    high_open: bool = False,
) -> None:
    value = getattr(section, name)
    above_low = value > low if low_open else value >= low
    below_high = value < high if high_open else value <= high
    if not (above_low and below_high):
        interval = f"{'(' if low_open else '['}{low}, {high}{')' if high_open else ']'}"
        raise ConfigError(full_key(prefix, name), f"must be in {interval}, got {value}")


def require_divides(key: str, divisor: int, dividend: int, dividend_desc: str) -> None:
    """``divisor`` (the value at ``key``) divides ``dividend``, described as e.g. ``rl_config.x=16``."""
    if dividend % divisor != 0:
        raise ConfigError(key, f"must divide {dividend_desc}, got {divisor}")


def require_equal(key: str, value: Optional[object], expected: object, expected_desc: str) -> None:
    if value != expected:
        raise ConfigError(key, f"must equal {expected_desc}, got {value}")


def require_only(prefix: str, section: Any, name: str, accepted: object, reason: str) -> None:
    """A key kept for MindSpeed-RL YAMLs whose only working value is ``accepted``; None (unset) passes.

    Validation is the key's whole effect: any other value would be accepted and then ignored.
    """
    value = getattr(section, name)
    if value is not None and value != accepted:
        raise ConfigError(full_key(prefix, name), f"must be {_yaml_repr(accepted)}: {reason}; got {_yaml_repr(value)}")


def _yaml_repr(value: object) -> str:
    """Values as the user writes them in YAML (true/null, not True/None)."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    return repr(value) if isinstance(value, str) else str(value)
