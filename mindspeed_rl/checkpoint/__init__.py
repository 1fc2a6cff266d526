"""Checkpoints of a GRPO run: atomic directories with a manifest and a `latest` pointer (see FORMAT.md)."""

from mindspeed_rl.checkpoint.store import (
    VerifiedCheckpoint,
    begin_save,
    commit_save,
    is_checkpoint_dir,
    iteration_dir_name,
    resolve_and_verify,
)

__all__ = ["VerifiedCheckpoint", "begin_save", "commit_save", "is_checkpoint_dir", "iteration_dir_name",
           "resolve_and_verify"]
