"""DPO's keys (`megatron_training.stage: dpo`, cli/train_dpo.py): MindSpeed-LLM's arguments, which MindSpeed-RL's DPO
recipe (configs/dpo_qwen3_30b_a3b_A3.yaml) sets under megatron_training, and the checks a DPO run needs across
sections. Pure: no torch.

A DPO iteration trains on `global_batch_size` preference pairs, each two rows (chosen, rejected) of one prompt: the
rows of a pair must stay together through the update, so whatever would separate them is refused here.
"""
from __future__ import annotations

from typing import Any

from mindspeed_rl.config.checks import require_choice, require_in_range, require_non_negative, require_positive
from mindspeed_rl.errors import ConfigError, run_checks

DPO_STAGE = "dpo"
# MindSpeed-LLM's DPOTrainer.dpo_loss (the formulas: mindspeed_rl/algorithms/dpo.py, docs/dpo.md).
DPO_LOSS_TYPES = ("sigmoid", "hinge", "ipo", "kto_pair")
# A pair is two samples of its prompt: rl_config.n_samples_per_prompt, which the update's mini-batches count by.
ROWS_PER_PAIR = 2


def check_dpo_keys(prefix: str, section: Any) -> None:
    """megatron_training's DPO keys alone (their own values; what they need of other sections: check_dpo_run)."""
    require_choice(prefix, section, "dpo_loss_type", DPO_LOSS_TYPES)
    if section.dpo_beta <= 0:
        raise ConfigError(f"{prefix}.dpo_beta", f"must be > 0 (the DPO temperature), got {section.dpo_beta}")
    # cDPO's label smoothing: the probability that a pair's label is flipped, at most even odds.
    require_in_range(prefix, section, "dpo_label_smoothing", 0.0, 0.5)
    require_non_negative(prefix, section, "pref_ftx")
    require_positive(prefix, section, "refer_model_iter")
    if section.stage == DPO_STAGE and not section.is_pairwise_dataset:
        raise ConfigError(f"{prefix}.is_pairwise_dataset", "must be true with stage dpo: DPO trains on chosen/rejected "
                                                           "pairs (docs/dpo.md)")
    if section.stage != DPO_STAGE and section.is_pairwise_dataset:
        raise ConfigError(f"{prefix}.is_pairwise_dataset", f"is true but stage is {section.stage}: pairwise "
                                                           "(chosen/rejected) data trains DPO only (stage dpo)")
    if section.dpo_label_smoothing > 0 and section.dpo_loss_type != "sigmoid":
        raise ConfigError(f"{prefix}.dpo_label_smoothing", f"is {section.dpo_label_smoothing}, but only the sigmoid "
                                                           f"loss smooths labels (dpo_loss_type is "
                                                           f"{section.dpo_loss_type})")


def check_dpo_run(config: Any) -> None:
    """A stage-dpo run: nothing that generates, scores or separates a pair's rows."""
    if config.megatron_training.stage != DPO_STAGE:
        return
    rl, dp = config.rl_config, config.train_data_parallel_size
    run_checks(
        lambda: _require(config.megatron_training.global_batch_size % dp == 0, "megatron_training.global_batch_size",
                         f"must divide by the data-parallel size {dp} with stage dpo: each rank takes whole pairs"),
        lambda: _require(rl.mini_batch_size % dp == 0, "rl_config.mini_batch_size",
                         f"must divide by the data-parallel size {dp} with stage dpo: each rank takes whole pairs"),
        lambda: _require(rl.n_samples_per_prompt == ROWS_PER_PAIR, "rl_config.n_samples_per_prompt",
                         f"must be {ROWS_PER_PAIR} with stage dpo (a pair's chosen and rejected rows), got "
                         f"{rl.n_samples_per_prompt}"),
        lambda: _require(not rl.shuffle_mini_batch, "rl_config.shuffle_mini_batch",
                         "must be false with stage dpo: shuffling rows would separate a pair's chosen and rejected"),
        lambda: _require(not rl.use_dynamic_bsz, "rl_config.use_dynamic_bsz",
                         "must be false with stage dpo: token-budget micro-batches would separate a pair's rows"),
        lambda: _require(config.critic_config is None, "critic_config", "DPO trains no critic: leave it out"),
        lambda: _require(not rl.multi_turn_enable, "rl_config.multi_turn_enable", "DPO does not generate: false"),
        lambda: _require(not config.disaggregated, "actor_infer",
                         "DPO does not generate: no inference devices (actor_infer) to give it"),
        lambda: _require(config.reward_model is None, "rewards", "DPO scores nothing: no reward model"),
        lambda: _require(config.runtime.max_restarts == 0, "runtime.max_restarts",
                         "must be 0 with stage dpo: restarting failed ranks is the GRPO loop's (a DPO run resumes "
                         "from its last checkpoint)"),
    )


def _require(holds: bool, key: str, message: str) -> None:
    if not holds:
        raise ConfigError(key, message)
