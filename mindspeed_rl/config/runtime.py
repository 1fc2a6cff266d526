"""Our additions to the MindSpeed-RL tree: `runtime` (device, threads, logging) and `synthetic_data`."""

from dataclasses import dataclass
from typing import ClassVar

from mindspeed_rl.config.checks import require_choice, require_non_negative, require_positive
from mindspeed_rl.errors import ConfigError
from mindspeed_rl.console import LOG_LEVELS
from mindspeed_rl.sizes import parse_bytes

DEVICES = ("auto", "cpu", "cuda", "npu")
# arith: "a+b=" prompts, answer = the leading integer (verifier arith_acc).
# math_word: small-integer word problems in DAPO-Math-17k's parquet schema, chat template, \boxed{n}
# answers (verifiers math_17k_acc, format).
# tool_call: a model programmed to call the code interpreter (multi-turn tool use, verifier retool_reward).
# search_call: the same model calling MindSpeed-RL's search tool (configs/tools/search_local.yaml).
SYNTHETIC_TASKS = ("arith", "math_word", "tool_call", "search_call")


@dataclass(kw_only=True)
class RuntimeConfig:
    """`runtime`: where and how the process runs, independent of the algorithm."""

    SECTION_KEY: ClassVar[str] = "runtime"

    # auto picks npu, then cuda, then cpu, whichever is present.
    device: str = "auto"
    # torch intra-op threads per rank; 0 = all cores (torch's default). Set it when ranks share a host.
    num_threads_per_rank: int = 0
    # On runtime.device=cpu every rank is a process; more than this many per CPU core is an error at
    # start (such a run makes no progress) instead of a queue or a swapping host.
    max_ranks_per_cpu_core: int = 2
    # Iterations between metric log lines.
    log_interval: int = 1
    # Draw the device-memory ledger's last iterations (memory_timeline.png) at the end; the ledger itself is in
    # metrics.jsonl either way.
    memory_timeline: bool = True
    # Draw training_curves.png at the end (false: metrics.jsonl only, which `python -m mindspeed_rl.trainer.curves`
    # draws afterwards): matplotlib and the drawing are ~1.5 s of a run's end.
    training_curves: bool = True
    # Written in the Hydra run directory.
    metrics_file: str = "metrics.jsonl"
    # The watchdog. A worker RPC that runs longer than this (or than 4x its slowest earlier run, if
    # that is longer) is a hang: the run stops naming the rank. initialize (checkpoint read, engine
    # builds) has its own limit.
    rpc_timeout_seconds: float = 1800.0
    initialize_timeout_seconds: float = 3600.0
    # A Ray rank whose heartbeat (a thread beating every second) stops this long is reported at once, whatever
    # the RPC deadline: a stopped or frozen process (SIGSTOP, a hung host), not a slow phase.
    heartbeat_timeout_seconds: float = 60.0
    # A phase the driver waits on (generate, log-probs, update, a checkpoint save, ...) that runs longer than this
    # prints one line, and another every this many seconds while it runs; 0: never.
    progress_seconds: float = 10.0
    # Every torch.distributed group in the workers (gloo/nccl/hccl): a rank never waits longer.
    collective_timeout_seconds: float = 1800.0
    # Ray must place every rank within this time, else the run says which resource is missing.
    placement_timeout_seconds: float = 60.0
    # null: a Ray instance of this process on this machine. "auto" or "HEAD_IP:6379": join the cluster
    # started by `ray start` on each node (multi-node; see README "Resources").
    ray_address: str | None = None
    # A run with one rank process (colocated, no CPU reward workers, ray_address null) runs that rank
    # in this process, without Ray (workers/local_group.py): seconds less start-up and no Ray daemons.
    # false: start Ray and the rank as a Ray actor, as runs with more ranks do.
    local_single_rank: bool = True
    # actor_config.load is a save root whose newest checkpoint is damaged (a file missing, truncated, corrupt):
    # false stops the run naming the newest intact one; true resumes from that one, saying so.
    resume_from_last_intact: bool = False
    # A worker that fails (raises, dies, freezes) or a node lost: the run tears its ranks down and starts them again
    # from the newest intact checkpoint of actor_config.save (or from the start when none is saved yet), at most this
    # many times; the iterations after a restart equal an uninterrupted run's (docs/checkpoints_and_failures.md).
    # 0: the run ends at the first failure, naming it.
    max_restarts: int = 0
    # A restart whose cluster no longer holds the layout (a node lost) waits this long for the resources to return.
    restart_wait_seconds: float = 300.0
    # Each device's memory, e.g. "64MiB" or "64GB": past it a phase fails with `out of device memory in <phase>` as on
    # a device that size. On CPU the engine refuses what the memory ledger attributes (states, activations, KV cache)
    # past it; on CUDA/NPU the allocator is capped too. null: the device's own memory (on CPU: none enforced).
    device_memory_limit: str | None = None
    # The libraries' log records (Megatron, vLLM, Ray) reach the console from this level up (debug, info,
    # warning, error); all of them are in the run's log file. Our own lines are always shown.
    log_level: str = "warning"
    # MindSpeed-RL keys of its own implementation are accepted and listed at start as having no effect here
    # (config/no_effect.py); true makes each an error.
    strict_keys: bool = False

    @property
    def device_memory_limit_bytes(self) -> int | None:
        return None if self.device_memory_limit is None else parse_bytes(str(self.device_memory_limit))

    def __post_init__(self) -> None:
        require_choice(self.SECTION_KEY, self, "log_level", LOG_LEVELS)
        for name in ("local_single_rank", "resume_from_last_intact", "strict_keys"):
            if not isinstance(getattr(self, name), bool):
                raise ConfigError(f"{self.SECTION_KEY}.{name}", f"expected true or false, got {getattr(self, name)!r}")
        require_choice(self.SECTION_KEY, self, "device", DEVICES)
        require_non_negative(self.SECTION_KEY, self, "num_threads_per_rank", "progress_seconds", "max_restarts")
        require_positive(self.SECTION_KEY, self, "log_interval", "max_ranks_per_cpu_core", "rpc_timeout_seconds",
                         "initialize_timeout_seconds", "collective_timeout_seconds", "placement_timeout_seconds",
                         "restart_wait_seconds")
        if self.heartbeat_timeout_seconds < 3:
            raise ConfigError(f"{self.SECTION_KEY}.heartbeat_timeout_seconds",
                              f"must be >= 3 (a rank beats every second), got {self.heartbeat_timeout_seconds}")
        if self.device_memory_limit is not None:
            try:
                parse_bytes(str(self.device_memory_limit))
            except ValueError as error:
                raise ConfigError(f"{self.SECTION_KEY}.device_memory_limit",
                                  f"a size such as 64MiB or 64GB, or null ({error})") from None
        if not self.metrics_file:
            raise ConfigError(f"{self.SECTION_KEY}.metrics_file", "must be a file name, got ''")


@dataclass(kw_only=True)
class SyntheticDataConfig:
    """`synthetic_data`: a CPU demo's generated task (prompts, tokenizer, untrained Qwen2-architecture
    checkpoint, or with num_experts > 0 a Qwen3-MoE one). The generators live in mindspeed_rl/data; this only
    holds their knobs."""

    SECTION_KEY: ClassVar[str] = "synthetic_data"

    enabled: bool = True
    task: str = "arith"
    # Relative to the launch directory. Each parameter set gets its own <task>-<hash>/ in it, holding model/
    # (HF tokenizer + checkpoint) and the prompts file, generated once and never rewritten (data/asset_cache.py).
    data_dir: str = "data/tiny"
    seed: int = 1
    # arith only: the generated tokenizer's size. math_word's vocabulary is fixed by its word list.
    vocab_size: int = 64
    hidden_size: int = 128
    # The dense MLP's width (config.json's intermediate_size; a MoE checkpoint has no dense layer to use it).
    ffn_hidden_size: int = 256
    num_layers: int = 2
    num_attention_heads: int = 4
    num_query_groups: int = 2
    # Largest operand of the generated problems (both tasks).
    max_operand: int = 4
    num_prompts: int = 256
    # arith only: > 0 generates a Qwen3-MoE checkpoint (q/k norms, no QKV bias, head size hidden_size /
    # num_attention_heads, a router and num_experts experts of moe_ffn_hidden_size on every layer, moe_router_topk
    # of them per token) instead of the Qwen2 one; 0: the dense Qwen2. MindSpeed-RL's model-block names.
    num_experts: int = 0
    moe_router_topk: int = 2
    moe_ffn_hidden_size: int = 64

    def __post_init__(self) -> None:
        prefix = self.SECTION_KEY
        require_choice(prefix, self, "task", SYNTHETIC_TASKS)
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
        self._check_experts()

    @property
    def is_moe(self) -> bool:
        """The generated checkpoint is a Qwen3-MoE (num_experts > 0)."""
        return self.num_experts > 0

    def _check_experts(self) -> None:
        prefix = self.SECTION_KEY
        require_non_negative(prefix, self, "num_experts")
        if not self.is_moe:
            return
        if self.task != "arith":
            raise ConfigError(f"{prefix}.num_experts", f"the {self.task} task generates a dense Qwen2 checkpoint "
                                                       f"(only arith generates a MoE one): set 0, got {self.num_experts}")
        require_positive(prefix, self, "moe_router_topk", "moe_ffn_hidden_size")
        if self.moe_router_topk > self.num_experts:
            raise ConfigError(f"{prefix}.moe_router_topk",
                              f"must be <= synthetic_data.num_experts={self.num_experts}, got {self.moe_router_topk}")
