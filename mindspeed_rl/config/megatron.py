"""`megatron_training` and `actor_config`: the Megatron arguments, under MindSpeed-RL's key names.

MindSpeed-RL builds the actor's Megatron arguments as ``{**megatron_training, **actor_config}``;
here the two stay separate typed sections and the consumer reads each key from its own section.
Keys that only matter to fused NPU/CUDA kernels are accepted and stored so that a MindSpeed-RL
YAML validates unchanged; the CPU engine ignores them.
"""

from dataclasses import dataclass, field
from typing import ClassVar, Optional

from mindspeed_rl.config.checks import (
    require_choice,
    require_in_range,
    require_non_negative,
    require_positive,
)
from mindspeed_rl.config.errors import ConfigError

SUPPORTED_STAGES = ("ray_grpo",)
# The collective backend is chosen by the accelerator from the device (gloo / nccl / hccl); the key
# is kept for MindSpeed-RL compatibility, whose YAMLs say "nccl" even on NPUs.
DISTRIBUTED_BACKENDS = ("nccl", "gloo", "hccl")
LR_DECAY_STYLES = ("constant", "linear", "cosine", "inverse-square-root", "WSD")


@dataclass(kw_only=True)
class MegatronTrainingConfig:
    """`megatron_training`: Megatron arguments shared by every model role."""

    SECTION_KEY: ClassVar[str] = "megatron_training"

    # Name of the architecture block under top-level `model`; if set, must equal actor_config.model.
    model: Optional[str] = None
    use_fused_rmsnorm: bool = False
    use_mcore_models: bool = True
    sequence_parallel: bool = False
    use_flash_attn: bool = False
    no_masked_softmax_fusion: bool = False
    attention_softmax_in_fp32: bool = False
    no_gradient_accumulation_fusion: bool = False
    use_fused_swiglu: bool = False
    use_fused_rotary_pos_emb: bool = False
    bf16: bool = False
    use_distributed_optimizer: bool = False
    tokenizer_type: str = "PretrainedFromHF"
    # HF model directory: tokenizer, and the HF config/weights the engines are built from.
    tokenizer_name_or_path: str
    # Prompts per iteration; the rollout has global_batch_size * rl_config.n_samples_per_prompt samples.
    global_batch_size: int
    seq_length: int
    # Iterations between checkpoints; None saves none.
    save_interval: Optional[int] = None
    train_iters: int
    stage: str = "ray_grpo"
    # RL fine-tuning keeps dropout off (Megatron's default is 0.1) so that old and new log-probs of
    # the same weights agree.
    attention_dropout: float = 0.0
    init_method_std: float = 0.02
    hidden_dropout: float = 0.0
    distributed_backend: str = "nccl"
    no_shared_storage: bool = False
    dataset_additional_keys: list[str] = field(default_factory=list)
    data_path: str
    split: str = "100,0,0"
    no_shuffle: bool = False
    full_shuffle_instruction_dataset: bool = False
    seed: int = 1234
    reuse_fp32_param: bool = False

    def __post_init__(self) -> None:
        prefix = self.SECTION_KEY
        require_positive(prefix, self, "global_batch_size", "seq_length", "train_iters", "save_interval")
        require_positive(prefix, self, "init_method_std")
        require_in_range(prefix, self, "attention_dropout", 0.0, 1.0, high_open=True)
        require_in_range(prefix, self, "hidden_dropout", 0.0, 1.0, high_open=True)
        require_choice(prefix, self, "stage", SUPPORTED_STAGES)
        require_choice(prefix, self, "distributed_backend", DISTRIBUTED_BACKENDS)
        self._check_split()

    def _check_split(self) -> None:
        parts = self.split.split(",")
        try:
            weights = [float(part) for part in parts]
        except ValueError:
            weights = []
        if len(parts) != 3 or len(weights) != 3 or min(weights) < 0 or sum(weights) <= 0:
            raise ConfigError(
                f"{self.SECTION_KEY}.split",
                f"must be three non-negative train,valid,test weights like '100,0,0', got {self.split!r}",
            )


@dataclass(kw_only=True)
class ActorConfig:
    """`actor_config`: the actor's training layout and optimizer."""

    SECTION_KEY: ClassVar[str] = "actor_config"

    # Name of the architecture block under top-level `model`.
    model: str
    # Samples per forward/backward on one data-parallel rank.
    micro_batch_size: int
    tensor_model_parallel_size: int = 1
    pipeline_model_parallel_size: int = 1
    expert_model_parallel_size: int = 1
    lr: float
    lr_decay_style: str = "constant"
    min_lr: float = 0.0
    weight_decay: float = 0.01
    lr_warmup_fraction: float = 0.0
    # Global gradient-norm clip; 0 disables clipping (Megatron semantics).
    clip_grad: float = 1.0
    adam_beta1: float = 0.9
    adam_beta2: float = 0.999
    adam_eps: float = 1e-8
    finetune: bool = False
    # Megatron checkpoint directories; None = start from the HF weights / do not save.
    load: Optional[str] = None
    save: Optional[str] = None
    no_load_optim: bool = False
    no_load_rng: bool = False

    def __post_init__(self) -> None:
        prefix = self.SECTION_KEY
        require_positive(
            prefix,
            self,
            "micro_batch_size",
            "tensor_model_parallel_size",
            "pipeline_model_parallel_size",
            "expert_model_parallel_size",
            "lr",
            "adam_eps",
        )
        require_non_negative(prefix, self, "min_lr", "weight_decay", "clip_grad")
        if self.min_lr > self.lr:
            raise ConfigError(f"{prefix}.min_lr", f"must be <= actor_config.lr={self.lr}, got {self.min_lr}")
        require_choice(prefix, self, "lr_decay_style", LR_DECAY_STYLES)
        require_in_range(prefix, self, "lr_warmup_fraction", 0.0, 1.0)
        require_in_range(prefix, self, "adam_beta1", 0.0, 1.0, high_open=True)
        require_in_range(prefix, self, "adam_beta2", 0.0, 1.0, high_open=True)
