"""`rl_config.rollout_correction`: verl's rollout-correction keys (algorithms/rollout_correction.py: the formulas)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, Optional

from mindspeed_rl.errors import ConfigError

IS_LEVELS = ("token", "sequence")
RS_LEVELS = ("token", "sequence", "geometric")


@dataclass(kw_only=True)
class RolloutCorrectionConfig:
    """`rl_config.rollout_correction`: verl's keys (null: off). `preset` fills them by verl's preset names."""

    SECTION_KEY: ClassVar[str] = "rl_config.rollout_correction"
    preset: Optional[str] = None
    rollout_is: Optional[str] = None
    rollout_is_threshold: float = 2.0
    rollout_is_batch_normalize: bool = False
    rollout_rs: Optional[str] = None
    rollout_rs_threshold: Optional[float] = None
    rollout_rs_threshold_lower: Optional[float] = None
    rollout_token_veto_threshold: Optional[float] = None

    def __post_init__(self) -> None:
        key = self.SECTION_KEY
        if self.preset is not None:
            if self.preset not in PRESETS:
                raise ConfigError(f"{key}.preset", f"must be one of {', '.join(PRESETS)}, got {self.preset!r}")
            for name, value in PRESETS[self.preset].items():
                setattr(self, name, value)
        if self.rollout_is is not None and self.rollout_is not in IS_LEVELS:
            raise ConfigError(f"{key}.rollout_is",
                              f"must be null or one of {', '.join(IS_LEVELS)}, got {self.rollout_is!r}")
        if self.rollout_rs is not None and self.rollout_rs not in RS_LEVELS:
            raise ConfigError(f"{key}.rollout_rs",
                              f"must be null or one of {', '.join(RS_LEVELS)}, got {self.rollout_rs!r}")
        if not self.rollout_is_threshold > 0:
            raise ConfigError(f"{key}.rollout_is_threshold", f"must be > 0, got {self.rollout_is_threshold}")
        if self.rollout_rs is not None and not (self.rollout_rs_threshold or 0) > 0:
            raise ConfigError(f"{key}.rollout_rs_threshold", f"must be > 0 when rollout_rs is set, got "
                                                            f"{self.rollout_rs_threshold}")
        if self.rollout_token_veto_threshold is not None and not self.rollout_token_veto_threshold > 0:
            raise ConfigError(f"{key}.rollout_token_veto_threshold",
                              f"must be > 0, got {self.rollout_token_veto_threshold}")

    @property
    def enabled(self) -> bool:
        return any(value is not None for value in (self.rollout_is, self.rollout_rs, self.rollout_token_veto_threshold))

    @property
    def rs_bounds(self) -> tuple[float, float]:
        upper = float(self.rollout_rs_threshold)
        return (1.0 / upper if self.rollout_rs_threshold_lower is None else self.rollout_rs_threshold_lower), upper


# verl's RolloutCorrectionConfig presets (decoupled mode: the old policy's log-probs from their own pass).
PRESETS: dict[str, dict] = {
    "disabled": dict(rollout_is=None, rollout_rs=None, rollout_token_veto_threshold=None),
    "decoupled_token_is": dict(rollout_is="token", rollout_is_threshold=2.0, rollout_rs=None),
    "decoupled_seq_is": dict(rollout_is="sequence", rollout_is_threshold=2.0, rollout_rs=None),
    "decoupled_seq_is_rs": dict(rollout_is="sequence", rollout_is_threshold=2.0, rollout_rs="sequence",
                                rollout_rs_threshold=2.0, rollout_rs_threshold_lower=None),
    "decoupled_geo_rs": dict(rollout_is=None, rollout_rs="geometric", rollout_rs_threshold=1.001,
                             rollout_rs_threshold_lower=None, rollout_token_veto_threshold=1e-4),
}
