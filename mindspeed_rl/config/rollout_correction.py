"""`rl_config.rollout_correction`: verl's rollout-correction keys as of its 97eac9048 (2026-01-14), its
RolloutCorrectionConfig and rollout_corr_helper (algorithms/rollout_correction.py: the formulas). The names verl used
before (518bada21) are still read, each mapped to what it meant and said in one deprecation line at start."""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar, Optional

from mindspeed_rl.errors import ConfigError

IS_LEVELS = ("token", "sequence")
# verl's SUPPORTED_ROLLOUT_RS_OPTIONS: <level>_k<estimator>; k1 = -log r (ratio bounds "lower_upper"),
# k2 = 0.5 (log r)^2, k3 = r - 1 - log r (upper bounds); seq_max has no k1.
RS_OPTIONS = ("token_k1", "token_k2", "token_k3", "seq_sum_k1", "seq_sum_k2", "seq_sum_k3", "seq_mean_k1",
              "seq_mean_k2", "seq_mean_k3", "seq_max_k2", "seq_max_k3")
# verl's rollout_rs levels before 97eac9048 and the k1 option that keeps the same tokens: r_t, prod_t r_t and
# exp(mean_t log r_t) within [lower, upper] are -log r_t, sum_t -log r_t and mean_t -log r_t within
# [log(1 / upper), log(1 / lower)].
LEGACY_RS_LEVELS = {"token": "token_k1", "sequence": "seq_sum_k1", "geometric": "seq_mean_k1"}
LOSS_TYPES = ("ppo_clip", "reinforce")
RENAMED = "verl's name before 97eac9048 (2026-01-14)"
OLD_KEY = "verl's key before 97eac9048 (2026-01-14)"
BYPASS_WHY = ("verl's bypass mode (the rollout's log-probs as the old policy's, the IS weights and the rejection "
              "computed inside the loss from the current policy, per micro-batch) is not implemented here; use a "
              "decoupled setting (bypass_mode: false): the old-log-prob pass, then the correction before the "
              "advantages")


@dataclass(kw_only=True)
class RolloutCorrectionConfig:
    """`rl_config.rollout_correction`: verl's keys (null: off). `preset` (ours) fills them as verl's factory method of
    that name does."""

    SECTION_KEY: ClassVar[str] = "rl_config.rollout_correction"
    preset: Optional[str] = None
    rollout_is: Optional[str] = None
    rollout_is_threshold: float = 2.0
    rollout_is_batch_normalize: bool = False
    # One option or a comma list (all must pass); thresholds one per option or one for all (verl's grammar).
    rollout_rs: Optional[str] = None
    rollout_rs_threshold: Optional[str] = None
    bypass_mode: bool = False  # true: refused (BYPASS_WHY)
    loss_type: str = "ppo_clip"  # bypass mode's loss; reinforce refused (bypass mode only)
    # Deprecated (verl removed them in 97eac9048): see _apply_legacy_names.
    rollout_rs_threshold_lower: Optional[float] = None
    rollout_token_veto_threshold: Optional[float] = None

    def __post_init__(self) -> None:
        self.deprecations: list[str] = []  # not a key: the lines launch prints at start (config/tolerated.py)
        if self.preset is not None:
            self._apply_preset()
        self._apply_legacy_names()
        self._check()

    def _key(self, name: str) -> str:
        return f"{self.SECTION_KEY}.{name}"

    def _apply_preset(self) -> None:
        if self.preset in BYPASS_PRESETS:
            raise ConfigError(self._key("preset"), f"{self.preset} is one of verl's bypass-mode presets: {BYPASS_WHY}")
        if self.preset not in PRESETS:
            raise ConfigError(self._key("preset"), f"must be one of {', '.join(PRESETS)}, got {self.preset!r}")
        for name, value in PRESETS[self.preset].items():
            setattr(self, name, value)

    def _apply_legacy_names(self) -> None:
        """verl's keys before 97eac9048, each read as what it meant, with one deprecation line each: rollout_rs
        token / sequence / geometric with rollout_rs_threshold (upper) and rollout_rs_threshold_lower (1 / upper
        unless given) become the k1 option keeping the same tokens and its "lower_upper" string; the veto stays as
        it was (verl has no option that rejects a sequence for one low ratio only)."""
        legacy = self.rollout_rs in LEGACY_RS_LEVELS
        if legacy or self.rollout_rs_threshold_lower is not None:
            self._map_legacy_bounds(legacy)
        veto = self.rollout_token_veto_threshold
        if veto is not None:
            if not veto > 0:
                raise ConfigError(self._key("rollout_token_veto_threshold"), f"must be > 0, got {veto}")
            self.deprecations.append(
                f"{self._key('rollout_token_veto_threshold')}: {OLD_KEY}, which it no longer has; applied as it "
                f"was: a sequence with any token whose r_t < {veto} leaves the loss mask (verl's nearest option, "
                f"rollout_rs=seq_max_k2, bounds |log r_t| both ways)")

    def _map_legacy_bounds(self, legacy: bool) -> None:
        option = LEGACY_RS_LEVELS.get(self.rollout_rs, self.rollout_rs)
        key = self._key("rollout_rs_threshold_lower" if not legacy else "rollout_rs")
        if option not in ("token_k1", "seq_sum_k1", "seq_mean_k1"):
            raise ConfigError(key, f"{OLD_KEY}: a lower ratio bound for one k1 option (token_k1, seq_sum_k1, "
                                   f"seq_mean_k1), got rollout_rs={self.rollout_rs!r}; write the bounds into "
                                   f"rollout_rs_threshold as \"lower_upper\"")
        upper, lower = _number(self.rollout_rs_threshold), self.rollout_rs_threshold_lower
        if upper is None or not upper > 0 or (lower is not None and not lower > 0):
            raise ConfigError(self._key("rollout_rs_threshold"), f"with verl's older rejection keys, a number > 0 "
                                                                 f"(and rollout_rs_threshold_lower > 0 if given), got "
                                                                 f"{self.rollout_rs_threshold!r} and {lower!r}")
        lower = 1.0 / upper if lower is None else lower
        was = f"{self.rollout_rs!r} is {RENAMED}" if legacy else OLD_KEY
        self.rollout_rs, self.rollout_rs_threshold = option, f"{1.0 / upper!r}_{1.0 / lower!r}"
        self.rollout_rs_threshold_lower = None
        self.deprecations.append(
            f"{key}: {was}; read as rollout_rs={option}, rollout_rs_threshold="
            f"'{self.rollout_rs_threshold}' (the same rule: its ratio within [{lower!r}, {upper!r}] is kept)")

    def _check(self) -> None:
        if self.rollout_is is not None and self.rollout_is not in IS_LEVELS:
            raise ConfigError(self._key("rollout_is"),
                              f"must be null or one of {', '.join(IS_LEVELS)}, got {self.rollout_is!r}")
        if not self.rollout_is_threshold > 0:
            raise ConfigError(self._key("rollout_is_threshold"), f"must be > 0, got {self.rollout_is_threshold}")
        if self.rollout_rs is not None:
            rs_thresholds(self.rs_options, self.rollout_rs_threshold, key=self._key("rollout_rs_threshold"))
        if self.bypass_mode:
            raise ConfigError(self._key("bypass_mode"), f"true: {BYPASS_WHY}")
        if self.loss_type not in LOSS_TYPES:
            raise ConfigError(self._key("loss_type"), f"must be one of {', '.join(LOSS_TYPES)}, got {self.loss_type!r}")
        if self.loss_type == "reinforce":
            raise ConfigError(self._key("loss_type"), "reinforce is verl's bypass-mode loss (-A w log pi, no clip), "
                                                      "read only with bypass_mode, which is not implemented here; "
                                                      "decoupled mode trains with the PPO-clip loss (ppo_clip)")

    @property
    def enabled(self) -> bool:
        return any(value is not None for value in (self.rollout_is, self.rollout_rs, self.rollout_token_veto_threshold))

    @property
    def rs_options(self) -> list[str]:
        """rollout_rs's options in order, duplicates dropped (verl's). ConfigError for an unknown one."""
        options = list(dict.fromkeys(part.strip() for part in (self.rollout_rs or "").split(",") if part.strip()))
        unknown = [option for option in options if option not in RS_OPTIONS]
        if not options or unknown:
            raise ConfigError(self._key("rollout_rs"), f"must be null or a comma list of {', '.join(RS_OPTIONS)} "
                                                       f"(or, deprecated, {', '.join(LEGACY_RS_LEVELS)}), got "
                                                       f"{self.rollout_rs!r}")
        return options


def _number(value) -> Optional[float]:
    try:
        return float(value)
    except (TypeError, ValueError):
        return None


def rs_thresholds(options: list[str], spec, *, key: str = RolloutCorrectionConfig.SECTION_KEY + ".rollout_rs_threshold"
                  ) -> dict[str, tuple[Optional[float], float]]:
    """verl's _parse_rollout_rs_thresholds: {option: (lower, upper)} from one spec per option or one for all,
    comma-separated. k1 options: "lower_upper" ratio bounds, or one number (the upper; the lower its reciprocal);
    k2/k3 options: one upper bound, no lower. Every bound > 0. ConfigError naming `key` otherwise."""
    if spec is None:
        raise ConfigError(key, f"must be given when rollout_rs is set ({', '.join(options)})")
    specs = [str(spec)] if isinstance(spec, (int, float)) else [part.strip() for part in str(spec).split(",")
                                                                  if part.strip()]
    if len(specs) not in (1, len(options)):
        raise ConfigError(key, f"one threshold for all options or one per option ({len(options)}), got {spec!r}")
    specs = specs * len(options) if len(specs) == 1 else specs
    return {option: _bounds(option, text, key) for option, text in zip(options, specs)}


def _bounds(option: str, text: str, key: str) -> tuple[Optional[float], float]:
    if option.endswith("k1"):
        lower_text, upper_text = text.split("_", 1) if "_" in text else (None, text)
        upper = _number(upper_text)
        lower = (1.0 / upper if upper else None) if lower_text is None else _number(lower_text)
    else:
        if "_" in text:
            raise ConfigError(key, f"{option} takes one upper bound without '_', got {text!r}")
        lower, upper = None, _number(text)
    k1 = option.endswith("k1")
    if upper is None or not math.isfinite(upper) or upper <= 0 or (k1 and not (lower or 0) > 0):
        form = '"lower_upper" or one number (the upper; the lower 1 / upper)' if k1 else "one number (the upper)"
        raise ConfigError(key, f"{option}: bounds must be numbers > 0, {form}, got {text!r}")
    return lower, upper


# verl's RolloutCorrectionConfig factory methods at 97eac9048, with their default arguments (decoupled mode: the old
# policy's log-probs from their own pass). Each sets the keys it names; the others stay as given.
PRESETS: dict[str, dict] = {
    "disabled": dict(rollout_is=None, rollout_rs=None),
    "decoupled_token_is": dict(rollout_is="token", rollout_is_threshold=2.0, rollout_rs=None),
    "decoupled_seq_is": dict(rollout_is="sequence", rollout_is_threshold=2.0, rollout_rs=None),
    "decoupled_seq_is_rs": dict(rollout_is="sequence", rollout_is_threshold=2.0, rollout_rs="seq_sum_k1",
                                rollout_rs_threshold="0.5_2.0"),
    "decoupled_geo_rs": dict(rollout_is=None, rollout_rs="seq_mean_k1", rollout_rs_threshold="0.999_1.001"),
    "decoupled_geo_rs_seq_tis": dict(rollout_is="sequence", rollout_is_threshold=2.0, rollout_rs="seq_mean_k1",
                                     rollout_rs_threshold="0.999_1.001"),
    "decoupled_geo_rs_token_tis": dict(rollout_is="token", rollout_is_threshold=2.0, rollout_rs="seq_mean_k1",
                                       rollout_rs_threshold="0.999_1.001"),
    "decoupled_k3_rs": dict(rollout_is=None, rollout_rs="seq_mean_k3", rollout_rs_threshold="0.01"),
    "decoupled_k3_rs_seq_tis": dict(rollout_is="sequence", rollout_is_threshold=2.0, rollout_rs="seq_mean_k3",
                                    rollout_rs_threshold="0.01"),
    "decoupled_k3_rs_token_tis": dict(rollout_is="token", rollout_is_threshold=2.0, rollout_rs="seq_mean_k3",
                                      rollout_rs_threshold="0.01"),
}
# verl's bypass-mode factory methods: refused by name (BYPASS_WHY).
BYPASS_PRESETS = ("bypass_ppo_clip", "bypass_ppo_clip_geo_rs", "bypass_ppo_clip_k3_rs", "bypass_pg_is",
                  "bypass_pg_geo_rs", "bypass_pg_geo_rs_seq_tis", "bypass_pg_geo_rs_token_tis")
