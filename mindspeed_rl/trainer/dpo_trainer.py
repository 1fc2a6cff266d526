"""The DPO loop (`megatron_training.stage: dpo`, cli/train_dpo.py): pairs -> the reference's log-probs -> update ->
held-out preference accuracy -> record -> checkpoint.

No rollout: the data are preference pairs (data/preference.py), each two rows of a batch (chosen, rejected). The
rank holds the training engine and its reference (workers/roles.py: no inference engine); the reference's log-probs
run in their residency row, the update in its own with DPO's loss (workers/actor_steps.dpo_mini_batch_step,
algorithms/dpo.py). Start-up, checkpoints and resume are the GRPO runs' (trainer/run.py, checkpoint/trainer_state.py).
"""
from __future__ import annotations

import time
from pathlib import Path

import torch

from mindspeed_rl.algorithms.dpo import preference_accuracy, summed_logprobs
from mindspeed_rl.checkpoint.lora_export import lora_record
from mindspeed_rl.checkpoint.trainer_state import save_run_checkpoint
from mindspeed_rl.config import GRPOConfig
from mindspeed_rl.data.dataset import PromptSampler
from mindspeed_rl.data.preference import PreferenceDataset, PreferencePair
from mindspeed_rl.protocol import RolloutBatch
from mindspeed_rl.trainer.grpo_trainer import checkpoint_contents, saves_at
from mindspeed_rl.trainer.prepared_run import PreparedRun
from mindspeed_rl.trainer.rollout import forward_logprobs
from mindspeed_rl.trainer.sinks import MetricsSinks
from mindspeed_rl.trainer.stopping import RunProgress
from mindspeed_rl.trainer.trackers import build_trackers
from mindspeed_rl.workers.actor_group import ActorGroup, merge_metrics


def pairs_batch(pairs: list[PreferencePair], *, pad_id: int) -> RolloutBatch:
    """The pairs as a pair-major batch: rows 2i (chosen) and 2i+1 (rejected) share pair i's prompt."""
    prompts = [pair.prompt_ids for pair in pairs for _ in range(2)]
    responses = [ids for pair in pairs for ids in (pair.chosen_ids, pair.rejected_ids)]
    width = max(len(ids) for ids in responses)
    return RolloutBatch.from_token_lists(prompts, responses, pad_id=pad_id, response_width=width)


class PreferenceEvaluation:
    """Held-out preference accuracy (`eval/dpo/accuracy`): the share of held-out pairs whose implicit reward
    (dpo_beta x the log-ratio to the reference) is higher for the chosen response, and their mean reward margin.
    The reference's log-probs of the held-out pairs are computed once: the reference never changes."""

    def __init__(self, config: GRPOConfig, actor_group: ActorGroup, dataset: PreferenceDataset | None, pad_id: int):
        self.config, self.actor_group = config, actor_group
        self.interval, self.before_train = config.rl_config.eval_interval, config.rl_config.eval_before_train
        # Whole pairs per data-parallel rank: the group splits a batch's rows evenly.
        dp = config.train_data_parallel_size
        pairs = (dataset.pairs if dataset is not None else [])
        self.batch = pairs_batch(pairs[:len(pairs) // dp * dp], pad_id=pad_id) if len(pairs) >= dp else None
        self._ref_sums: torch.Tensor | None = None

    def due(self, iteration: int) -> bool:
        if self.batch is None:
            return False
        if iteration == 0:
            return self.before_train
        return self.interval > 0 and (iteration % self.interval == 0
                                      or iteration == self.config.megatron_training.train_iters)

    def run(self) -> dict[str, float]:
        mask = self.batch.loss_mask()
        if self._ref_sums is None:
            ref, _ = forward_logprobs(self.actor_group, "compute_ref_log_prob", self.batch)
            self._ref_sums = summed_logprobs(ref, mask)[0]
        policy, _ = forward_logprobs(self.actor_group, "compute_log_prob", self.batch)
        values = preference_accuracy(summed_logprobs(policy, mask)[0], self._ref_sums,
                                     beta=self.config.megatron_training.dpo_beta)
        return {f"eval/dpo/{name}": value for name, value in values.items()} | {"eval/dpo/pairs": len(self.batch) / 2}


def train_dpo(config: GRPOConfig, actor_group: ActorGroup, run: PreparedRun, run_dir: Path, *,
              progress: RunProgress) -> list[dict]:
    """Iterations after the checkpoint `run` resumes from to train_iters; returns this run's records."""
    mt = config.megatron_training
    first = run.resume.iteration + 1 if run.resume else 1
    pad_id = run.tokenizer.pad_token_id if run.tokenizer.pad_token_id is not None else 0
    evaluation = PreferenceEvaluation(config, actor_group, run.eval_dataset, pad_id)
    sinks = MetricsSinks(run_dir, metrics_file=config.runtime.metrics_file, trackers=build_trackers(run_dir, config))
    history: list[dict] = []
    try:
        if first == 1 and evaluation.due(0):
            record = {"iteration": 0, **evaluation.run()}
            sinks.write(record)
            print(format_dpo_line(record), flush=True)
        for iteration in range(first, mt.train_iters + 1):
            progress.iteration = iteration
            started = time.perf_counter()
            batch = pairs_batch([run.dataset.pairs[i] for i in run.sampler.next_indices()], pad_id=pad_id)
            batch.columns["ref_logprobs"], metrics = forward_logprobs(actor_group, "compute_ref_log_prob", batch)
            metrics |= merge_metrics(actor_group.call("update", batch, kl_coef=0.0))
            metrics |= evaluation.run() if evaluation.due(iteration) else {}
            metrics |= {"iteration": iteration, "timing/all": time.perf_counter() - started,
                        "dpo/pairs": len(batch) / 2, "dpo/response_tokens": float(batch.loss_mask().sum())}
            sinks.write(metrics)
            history.append(metrics)
            if iteration % config.runtime.log_interval == 0 or "eval/dpo/accuracy" in metrics:
                print(format_dpo_line(metrics), flush=True)
            if saves_at(config, iteration):
                save_dpo_checkpoint(config, actor_group, iteration, run, progress)
    finally:
        sinks.close()
    return history


def format_dpo_line(metrics: dict) -> str:
    """One console line of an iteration (or of the evaluation before training, iteration 0)."""
    parts = [f"[dpo] iter {metrics['iteration']}"]
    for key, label in (("dpo/loss", "loss"), ("dpo/reward_margin", "margin"), ("dpo/accuracy", "acc"),
                       ("eval/dpo/accuracy", "eval_acc"), ("eval/dpo/reward_margin", "eval_margin"),
                       ("timing/all", "s")):
        if key in metrics:
            parts.append(f"{label}={metrics[key]:.4f}")
    return " ".join(parts)


def save_dpo_checkpoint(config: GRPOConfig, actor_group: ActorGroup, iteration: int, run: PreparedRun,
                        progress: RunProgress) -> None:
    path = save_run_checkpoint(actor_group=actor_group, save_root=config.actor_config.save, iteration=iteration,
                               sampler=run.sampler, kl_coef=0.0, seed=config.megatron_training.seed,
                               hf_dir=run.model_dir, keep_last_n=config.actor_config.keep_last_n,
                               records=lora_record(config, run.model_dir), contents=checkpoint_contents(config))
    progress.last_checkpoint, progress.saved_by_this_run = str(path), True
    print(f"[checkpoint] saved {path}", flush=True)


def make_pair_sampler(config: GRPOConfig, dataset: PreferenceDataset) -> PromptSampler:
    mt = config.megatron_training
    return PromptSampler(len(dataset.pairs), mt.global_batch_size, seed=mt.seed, shuffle=not mt.no_shuffle,
                         wrap_small_dataset=mt.wrap_small_dataset)
