"""`profiler_config`: MindSpeed-RL's profiler section (their config_cls/mindstudio_config.py ProfilerConfig, their
docs/zh/features/profiler.md), run here with torch.profiler around the RPCs of the chosen stages
(workers/stage_profiler.py).

Their keys and defaults, key by key here:
- profile: the switch; nothing else is read while it is false.
- stage: all, or one or a list of STAGES; each names the RPC it profiles (STAGE_RPCS).
- profile_step_start / profile_step_end: iterations [start, end), 1-based, end excluded (as theirs).
- profile_ranks: all, or a list of global ranks.
- profile_save_path: traces land in <path>/rank<r>/<stage>_iter<k>.{json,txt}.
- profile_with_cpu -> ProfilerActivity.CPU; profile_with_npu -> the device's activity (CUDA on a GPU, NPU through
  torch_npu on an NPU; none on CPU); profile_with_memory -> profile_memory; profile_record_shapes -> record_shapes;
  profile_with_module -> with_stack (Python call stacks).
- mstx: their lightweight markers -> a torch.profiler.record_function range named by the stage (and an NVTX range
  on CUDA) around each profiled RPC.
- profile_level, profile_export_type db, profile_analysis: Ascend-profiler choices with no torch counterpart; listed
  at start as having no effect (`notices`) when profile is on and they ask for something.
"""

from dataclasses import dataclass, field
from typing import Any, ClassVar, Optional

from mindspeed_rl.errors import ConfigError

# Their stage names -> the RPC (declared by a part, workers/parts/) each profiles.
STAGE_RPCS = {
    "actor_generate": "generate_sequences",
    "actor_compute_log_prob": "compute_log_prob",
    "reference_compute_log_prob": "compute_ref_log_prob",
    "critic_compute_values": "compute_values",
    "actor_update": "update",
    "critic_update": "update_critic",
}
STAGES = tuple(STAGE_RPCS)
EXPORT_TYPES = ("text", "db")
LEVELS = ("level_none", "level0", "level1", "level2")
_PREFIX = "profiler_config.integrated"


@dataclass(kw_only=True)
class IntegratedProfilerConfig:
    """`profiler_config.integrated`: their keys, their defaults (profile_save_path: their docs' ./profiler_data)."""

    SECTION_KEY: ClassVar[str] = _PREFIX

    profile: bool = False
    mstx: bool = False
    # A stage name, "all", or a list of stage names (Any: OmegaConf has no str-or-list type).
    stage: Any = "all"
    profile_save_path: str = "./profiler_data"
    profile_export_type: str = "text"
    profile_step_start: int = 1
    profile_step_end: int = 2
    profile_level: str = "level0"
    profile_with_memory: bool = False
    profile_record_shapes: bool = False
    profile_with_cpu: bool = True
    profile_with_npu: bool = True
    profile_with_module: bool = False
    profile_analysis: bool = False
    # "all" or a list of global ranks.
    profile_ranks: Any = "all"

    def __post_init__(self) -> None:
        self.stages  # noqa: B018 -- validates stage
        self.ranks  # noqa: B018 -- validates profile_ranks
        if self.profile_export_type not in EXPORT_TYPES:
            raise ConfigError(f"{_PREFIX}.profile_export_type",
                              f"must be one of {', '.join(EXPORT_TYPES)}, got {self.profile_export_type!r}")
        if self.profile_level not in LEVELS:
            raise ConfigError(f"{_PREFIX}.profile_level",
                              f"must be one of {', '.join(LEVELS)}, got {self.profile_level!r}")
        if self.profile_step_start < 1:
            raise ConfigError(f"{_PREFIX}.profile_step_start", f"must be >= 1 (iterations count from 1), "
                                                               f"got {self.profile_step_start}")
        if self.profile_step_end <= self.profile_step_start:
            raise ConfigError(f"{_PREFIX}.profile_step_end",
                              f"must be > profile_step_start={self.profile_step_start} (iterations [start, end), end "
                              f"excluded), got {self.profile_step_end}")
        # Their class's default is "" (their docs' ./profiler_data is what recipes write): only a profile needs it.
        if self.profile and not self.profile_save_path:
            raise ConfigError(f"{_PREFIX}.profile_save_path", "must name a directory when profile is true, got ''")

    @property
    def stages(self) -> tuple[str, ...]:
        """The stage names profiled ("all": every one)."""
        names = [self.stage] if isinstance(self.stage, str) else list(self.stage or [])
        if names == ["all"]:
            return STAGES
        bad = [name for name in names if name not in STAGES]
        if bad or not names:
            raise ConfigError(f"{_PREFIX}.stage", f"must be all, one of {', '.join(STAGES)} or a list of them, "
                                                  f"got {self.stage!r}")
        return tuple(dict.fromkeys(names))

    @property
    def ranks(self) -> Optional[frozenset[int]]:
        """The global ranks profiled; None: all."""
        if self.profile_ranks == "all":
            return None
        values = [self.profile_ranks] if isinstance(self.profile_ranks, int) else self.profile_ranks
        if isinstance(values, str) or not all(isinstance(v, int) and not isinstance(v, bool) and v >= 0
                                              for v in values or []) or not values:
            raise ConfigError(f"{_PREFIX}.profile_ranks", f"must be all or a list of ranks (integers >= 0), "
                                                          f"got {self.profile_ranks!r}")
        return frozenset(values)

    def notices(self) -> list[str]:
        """`key (why)` for each key asking for something the torch profiler does not do (printed at start)."""
        if not self.profile:
            return []
        found = []
        if self.profile_export_type == "db":
            found.append(f"{_PREFIX}.profile_export_type (db is the Ascend profiler's database; here the Chrome trace "
                         "JSON and the text table are written)")
        if self.profile_level != "level0":
            found.append(f"{_PREFIX}.profile_level (the Ascend profiler's detail levels; torch.profiler records every "
                         "op of the chosen activities at one level)")
        if self.profile_analysis:
            found.append(f"{_PREFIX}.profile_analysis (torch.profiler's traces need no offline parse: the table is "
                         "written with each trace)")
        return found


@dataclass(kw_only=True)
class ProfilerConfig:
    """`profiler_config`: only MindSpeed-RL's `integrated` worker has one (the only mode here too)."""

    SECTION_KEY: ClassVar[str] = "profiler_config"

    integrated: IntegratedProfilerConfig = field(default_factory=IntegratedProfilerConfig)

    @property
    def enabled(self) -> bool:
        return self.integrated.profile
