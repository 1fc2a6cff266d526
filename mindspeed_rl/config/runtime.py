"""Our additions to the MindSpeed-RL tree: `runtime` (device, threads, logging) and `synthetic_data`."""

from dataclasses import dataclass
from typing import ClassVar

from mindspeed_rl.config.checks import require_choice, require_non_negative, require_positive
from mindspeed_rl.config.errors import ConfigError

DEVICES = ("auto", "cpu", "cuda", "npu")


@dataclass(kw_only=True)
class RuntimeConfig:
    """`runtime`: where and how the process runs, independent of the algorithm."""

    SECTION_KEY: ClassVar[str] = "runtime"

    # auto picks npu, then cuda, then cpu, whichever is present.
    device: str = "auto"
    # torch intra-op threads per rank; 0 = all cores (torch's default). Set it when ranks share a host.
    num_threads_per_rank: int = 0
    # Iterations between metric log lines.
    log_interval: int = 1
    # Record the device-memory ledger per phase and plot it at the end.
    memory_timeline: bool = True
    # Written in the Hydra run directory.
    metrics_file: str = "metrics.jsonl"

    def __post_init__(self) -> None:
        require_choice(self.SECTION_KEY, self, "device", DEVICES)
        require_non_negative(self.SECTION_KEY, self, "num_threads_per_rank")
        require_positive(self.SECTION_KEY, self, "log_interval")
        if not self.metrics_file:
            raise ConfigError(f"{self.SECTION_KEY}.metrics_file", "must be a file name, got ''")


@dataclass(kw_only=True)
class SyntheticDataConfig:
    """`synthetic_data`: the CPU demo's generated task (arithmetic prompts, tokenizer, untrained
    Qwen2-architecture checkpoint). The generator lives elsewhere; this only holds its knobs."""

    SECTION_KEY: ClassVar[str] = "synthetic_data"

    enabled: bool = True
    # Holds model/ (HF tokenizer + checkpoint) and prompts.jsonl; relative to the launch directory.
    data_dir: str = "data/tiny"
    seed: int = 1
    vocab_size: int = 64
    hidden_size: int = 128
    ffn_hidden_size: int = 256
    num_layers: int = 2
    num_attention_heads: int = 4
    num_query_groups: int = 2
    # Largest operand of the generated arithmetic problems.
    max_operand: int = 4
    num_prompts: int = 256

    def __post_init__(self) -> None:
        prefix = self.SECTION_KEY
        require_positive(
            prefix,
            self,
            "vocab_size",
            "hidden_size",
            "ffn_hidden_size",
            "num_layers",
            "num_attention_heads",
            "num_query_groups",
            "max_operand",
            "num_prompts",
        )
        if self.num_attention_heads % self.num_query_groups != 0:
            raise ConfigError(
                f"{prefix}.num_query_groups",
                f"must divide synthetic_data.num_attention_heads={self.num_attention_heads}, "
                f"got {self.num_query_groups}",
            )
        if self.hidden_size % self.num_attention_heads != 0:
            raise ConfigError(
                f"{prefix}.num_attention_heads",
                f"must divide synthetic_data.hidden_size={self.hidden_size}, got {self.num_attention_heads}",
            )
