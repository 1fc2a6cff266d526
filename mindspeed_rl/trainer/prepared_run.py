"""What a run's checks found and loaded before any worker starts (trainer/run.prepare_run), as the loop takes it."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from mindspeed_rl.checkpoint.trainer_state import ResumePoint
from mindspeed_rl.data.dataset import PromptDataset, PromptSampler


@dataclass(frozen=True, kw_only=True)
class PreparedRun:
    """What the checks found and loaded before any worker starts."""

    model_dir: str
    ref_dir: str
    tokenizer: object
    dataset: PromptDataset
    eval_dataset: PromptDataset | None  # megatron_training.eval_data_path
    sampler: PromptSampler
    resume: ResumePoint | None
    ref_checkpoint: Path | None
    device: str
    prediction: object  # the planner's MemoryPlan, or None
    restarted: bool = False  # resume is this run's own save: everything in it loads, whatever actor_config says
