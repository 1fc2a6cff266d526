"""The Megatron engine's optimizer settings: Adam's, the clip and the learning-rate schedule."""
from __future__ import annotations

from dataclasses import dataclass, field

LR_DECAY_STYLES = ("constant", "linear", "cosine", "inverse-square-root")


@dataclass(frozen=True, kw_only=True)
class LRSchedule:
    """Megatron's OptimizerParamScheduler counted in optimizer steps: linear warmup from 0 to `lr`
    over `warmup_steps`, then `decay_style` down to `min_lr` at `decay_steps` (the run's total).

    Megatron-LM counts samples (steps x global batch); every step here has the same number of
    samples, so counting steps gives the same curve.
    """

    decay_style: str = "constant"
    warmup_steps: float = 0.0  # a float, as Megatron computes it: lr_warmup_fraction * decay_steps
    decay_steps: int = 1

    def __post_init__(self) -> None:
        if self.decay_style not in LR_DECAY_STYLES:
            raise ValueError(f"decay_style must be one of {LR_DECAY_STYLES}, got {self.decay_style!r}")
        if self.decay_steps < 1:
            raise ValueError(f"decay_steps must be >= 1, got {self.decay_steps}")
        if not 0 <= self.warmup_steps < self.decay_steps:
            raise ValueError(f"warmup_steps must be in [0, decay_steps={self.decay_steps}), got {self.warmup_steps}")


@dataclass(frozen=True, kw_only=True)
class OptimizerSettings:
    lr: float
    min_lr: float
    weight_decay: float
    adam_beta1: float
    adam_beta2: float
    adam_eps: float
    clip_grad: float
    schedule: LRSchedule = field(default_factory=LRSchedule)
    # Megatron's DistributedOptimizer: fp32 masters and Adam moments sharded over DP ranks.
    use_distributed_optimizer: bool = False
