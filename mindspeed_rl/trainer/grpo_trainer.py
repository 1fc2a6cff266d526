"""The GRPO loop: rollout -> rewards -> advantages -> reference and old log-probs -> update -> record.

`train()` reads like the algorithm; each step is one call here. Every step talks to the actor through
`ActorGroup` (workers/actor_group.py), whichever placement runs it, and never moves device states: each
RPC declares its phase and the ranks' sharding managers do the rest.
"""
from __future__ import annotations

import time
from pathlib import Path

from mindspeed_rl.accelerator.host_memory import return_free_heap
from mindspeed_rl.checkpoint.lora_export import lora_record
from mindspeed_rl.checkpoint.trainer_state import (Contents, save_run_checkpoint, saved_carried_samples,
                                                   saved_rollout_ahead)
from mindspeed_rl.config.partial_rollout import max_token_age
from mindspeed_rl.config import GRPOConfig
from mindspeed_rl.data.dataset import PromptDataset, PromptSampler
from mindspeed_rl.data.rewards import RuleRewards
from mindspeed_rl.protocol import RolloutBatch, checked_token_ages, has_older_tokens
from mindspeed_rl.trainer import setup
from mindspeed_rl.trainer.advantage_step import AdvantageStep
from mindspeed_rl.trainer.critic_step import CriticAdvantageStep
from mindspeed_rl.trainer.distill_step import teacher_logprobs
from mindspeed_rl.trainer.dynamic_sampling import ScoredRollouts
from mindspeed_rl.trainer.evaluation import Evaluation, format_eval_line
from mindspeed_rl.trainer.metrics import format_line, iteration_metrics
from mindspeed_rl.trainer.mismatch_step import measurement_step
from mindspeed_rl.trainer.phase_progress import ProgressReportingGroup, console_clock
from mindspeed_rl.trainer.prepared_run import PreparedRun
from mindspeed_rl.trainer.rollout import forward_logprobs
from mindspeed_rl.trainer.rollout_correction_step import correct_rollout
from mindspeed_rl.trainer.rollout_strategy import rollout_strategy, strategy_carries
from mindspeed_rl.trainer.rollouts import Rollouts
from mindspeed_rl.trainer.scoring import Scoring
from mindspeed_rl.trainer.sinks import MetricsSinks
from mindspeed_rl.trainer.stopping import RunProgress
from mindspeed_rl.trainer.summary import summary_lines
from mindspeed_rl.trainer.trackers import build_trackers
from mindspeed_rl.workers.actor_group import ActorGroup, merge_metrics

# The advantage step of an estimator that brings more than the outcome rewards (PPO's GAE: the critic).
ADVANTAGE_STEPS = {"gae": CriticAdvantageStep}


def train(config: GRPOConfig, actor_group: ActorGroup, run: PreparedRun, run_dir: Path, *,
          progress: RunProgress | None = None, reward_group=None) -> list[dict]:
    """Iterations after the checkpoint `run` resumes from (its sampler, KL coefficient and the rollout it kept, started
    ahead of its next iteration) to train_iters; `reward_group`: the CPU reward workers, if any."""
    first = run.resume.iteration + 1 if run.resume else 1
    progress = progress or RunProgress(save_root=config.actor_config.save, first_iteration=first)
    clock = console_clock(every_seconds=config.runtime.progress_seconds, iteration=lambda: progress.iteration)
    actor_group = ProgressReportingGroup(actor_group, clock)  # a phase waited on long is reported on the console
    rollouts, sampling, evaluation = _rollout_steps(config, actor_group, run, reward_group)
    resumed_kl = run.resume.state.get("kl_coef") if run.resume and run.resume.iteration else None
    advantages = ADVANTAGE_STEPS.get(config.rl_config.adv_estimator, AdvantageStep)(config, actor_group,
                                                                                    kl_coef=resumed_kl)
    measurement = measurement_step(config, actor_group)  # the mismatch ledger's passes, when it is on
    record = Recorder(config, run_dir, run.prediction or setup.memory_prediction(
        config, setup.read_hf_config(run.model_dir), quiet=True), progress=progress)
    try:
        if first == 1 and evaluation.due(0):  # a resumed run was evaluated when it was saved
            record.evaluation_before_train(evaluation.run(0))
        for iteration in range(first, config.megatron_training.train_iters + 1):
            progress.iteration = iteration
            if config.profiling:  # profiler_config's step range counts these iterations
                actor_group.begin_iteration(iteration)
            started = time.perf_counter()
            scored = sampling.next(iteration)  # generated now or during the last update, scored, maybe refilled
            batch, rewards, metrics = scored.batch, scored.rewards, scored.metrics
            if config.uses_reference:  # the KL term's only input
                batch.columns["ref_logprobs"], ref_metrics = forward_logprobs(actor_group, "compute_ref_log_prob", batch)
                metrics |= ref_metrics
            metrics |= teacher_logprobs(config, actor_group, batch)  # on-policy distillation's teacher
            metrics |= old_logprobs(config, actor_group, batch, policy_version=iteration - 1)
            metrics |= measurement.replay_routes(batch)
            metrics |= correct_rollout(batch, config.rl_config)  # before the advantages: they skip rejected tokens
            metrics |= advantages.estimate(batch, rewards)
            rollouts.start_ahead(iteration + 1)  # one-step off-policy: the next rollout runs meanwhile
            measurement.start_rescore(batch, stale=rollouts.stale or has_older_tokens(batch, iteration - 1))
            finish_critic_update = advantages.start_critic_update(batch)  # on its own devices: during the update
            metrics |= merge_metrics(actor_group.call("update", batch, kl_coef=advantages.loss_kl_coef))
            metrics |= finish_critic_update()
            metrics |= evaluation.run(iteration) if evaluation.due(iteration) else {}
            metrics |= measurement.finish_rescore(batch)
            record(iteration, started, batch, rewards, scored.accuracy, metrics)
            if saves_at(config, iteration):
                save_checkpoint(config, actor_group, iteration, rollouts, progress, run.model_dir,
                                kl_coef=advantages.kl_coef)
    finally:
        record.close()
        clock.close()
    return record.finish(actor_group, run.model_dir)


def old_logprobs(config: GRPOConfig, actor_group: ActorGroup, batch: RolloutBatch, *, policy_version: int) -> dict:
    """The separate old-log-prob pass, where the update's own first forward does not give them: that shortcut holds
    for an exactly on-policy batch only, every trained token sampled by the policy of `policy_version` (a partial
    rollout's resumed tokens are older). Every trained token's age is checked against the declared bound first."""
    ages = checked_token_ages(batch, policy_version, bound=max_token_age(config))
    if config.old_logprobs_from_update and not ages.any():
        return {}
    batch.columns["old_logprobs"], metrics = forward_logprobs(actor_group, "compute_log_prob", batch)
    return metrics


def _rollout_steps(config: GRPOConfig, actor_group: ActorGroup, run: PreparedRun, reward_group):
    """The rollouts by the run's one strategy (tool turns under multi-turn), their scoring with dynamic sampling's
    refills, and the evaluation, which rolls out and scores the same way."""
    strategy = rollout_strategy(config, run.tokenizer)
    resumed_ahead = saved_rollout_ahead(run.resume) if config.rollout_staleness else None
    rollouts = Rollouts(actor_group, run.dataset, run.sampler, config, strategy, resumed_ahead=resumed_ahead,
                        resumed_carried=saved_carried_samples(run.resume) if strategy_carries(strategy) else None)
    scoring = Scoring(config, run.tokenizer, actor_group, reward_group)
    return rollouts, ScoredRollouts(rollouts, scoring, config), Evaluation(config, scoring, run.eval_dataset, strategy)


class Recorder:
    """Each iteration's metrics: derived, compared with the planner, written to the sinks, printed; and at
    the end the curves, the memory timeline and the HF export. Nothing is kept per iteration in memory (a
    week-long run would hold gigabytes): the end of the run reads its records back from metrics.jsonl."""

    def __init__(self, config: GRPOConfig, run_dir: Path, prediction, *, progress: RunProgress):
        self.config, self.run_dir, self.prediction = config, run_dir, prediction
        self.progress = progress  # the run's first iteration (its summary's), its restarts
        self.sinks = MetricsSinks(run_dir, metrics_file=config.runtime.metrics_file,
                                  trackers=build_trackers(run_dir, config))
        self.before_train: dict | None = None  # the evaluation before the first update, drawn with the curves

    def evaluation_before_train(self, metrics: dict) -> None:
        """Its own metrics.jsonl record, at iteration 0 (the training records' readers skip it: no reward/mean)."""
        self.before_train = {"iteration": 0, **metrics}
        self.sinks.write(self.before_train)
        print(format_eval_line(self.before_train), flush=True)

    def __call__(self, iteration: int, started: float, batch: RolloutBatch, rewards: RuleRewards,
                 accuracy_value: float, metrics: dict) -> None:
        metrics["iteration"] = iteration
        metrics["timing/all"] = time.perf_counter() - started
        metrics["restarts"] = self.progress.restarts  # runtime.max_restarts used before this iteration
        metrics.update(iteration_metrics(self.config, batch, metrics, rewards, accuracy_value))
        if self.prediction is not None:  # the planner's bytes at this iteration's sequence width, beside the ledger's
            metrics.update(self.prediction.with_seq_length(batch.input_ids.shape[1]).ledger_metrics())
        self.sinks.write(metrics)
        if iteration % self.config.runtime.log_interval == 0:
            print(format_line(metrics), flush=True)
        if "eval/updates" in metrics:
            print(format_eval_line(metrics), flush=True)
        return_free_heap()  # the driver's own iteration ends here

    def close(self) -> None:
        self.sinks.close()

    def finish(self, actor_group: ActorGroup, hf_dir: str) -> list[dict]:
        """This run's records (read back from metrics.jsonl), after drawing them and exporting the actor."""
        from mindspeed_rl.memory.timeline import read_jsonl

        path = self.sinks.metrics_path
        first = self.progress.first_iteration
        history = [r for r in read_jsonl(path) if r["iteration"] >= first] if path.is_file() else []
        if history:
            plot_curves(history, self.run_dir, self.config, before_train=self.before_train)
        artefacts = [path.name for path in sorted(self.run_dir.iterdir()) if path.suffix in (".jsonl", ".png", ".log")]
        if self.config.megatron_training.save_hf:
            from mindspeed_rl.checkpoint.hf_export import export_run_actor

            exported = export_run_actor(actor_group, run_dir=self.run_dir, config_dir=hf_dir)
            print(f"[export] HF checkpoint: {exported}", flush=True)
            artefacts.append(f"{exported} (HF export)")
        if self.config.actor_config.save is not None:
            artefacts.append(f"{self.config.actor_config.save} (checkpoints)")
        print("\n".join(summary_lines(history, run_dir=self.run_dir, artefacts=artefacts,
                                       restarts=self.progress.restarts)), flush=True)
        return history


def make_sampler(config: GRPOConfig, dataset: PromptDataset) -> PromptSampler:
    mt = config.megatron_training
    return PromptSampler(len(dataset.records), mt.global_batch_size, seed=mt.seed, shuffle=not mt.no_shuffle,
                         wrap_small_dataset=mt.wrap_small_dataset)


def saves_at(config: GRPOConfig, iteration: int) -> bool:
    interval = config.megatron_training.save_interval
    last = iteration == config.megatron_training.train_iters
    return config.actor_config.save is not None and (last or (interval is not None and iteration % interval == 0))


def save_checkpoint(config: GRPOConfig, actor_group: ActorGroup, iteration: int, rollouts: Rollouts,
                    progress: RunProgress, hf_dir: str, *, kl_coef: float) -> None:
    path = save_run_checkpoint(actor_group=actor_group, save_root=config.actor_config.save, iteration=iteration,
                               sampler=rollouts.resume_sampler, kl_coef=kl_coef, seed=config.megatron_training.seed,
                               hf_dir=hf_dir, keep_last_n=config.actor_config.keep_last_n,
                               records=lora_record(config, hf_dir), contents=checkpoint_contents(config),
                               rollout_ahead=rollouts.finish_ahead(), carried_samples=rollouts.carried_state)
    progress.last_checkpoint, progress.saved_by_this_run = str(path), True
    print(f"[checkpoint] saved {path}", flush=True)


def checkpoint_contents(config: GRPOConfig) -> Contents:
    ac = config.actor_config
    return Contents(optimizer=not ac.no_save_optim, rng=not ac.no_save_rng,
                    expert_parallel_size=ac.expert_model_parallel_size)


def plot_curves(history: list[dict], run_dir: Path, config: GRPOConfig, *, before_train: dict | None = None) -> None:
    from mindspeed_rl.trainer.curves import plot_training_curves

    if config.runtime.training_curves:
        plot_training_curves(([before_train] if before_train else []) + history, run_dir / "training_curves.png")
        print(f"[metrics] training curves: {run_dir / 'training_curves.png'}", flush=True)
    if config.runtime.memory_timeline:
        from mindspeed_rl.memory.timeline import plot_memory_timeline

        path = run_dir / "memory_timeline.png"
        plot_memory_timeline(history, path, last_iterations=3,
                             title=f"Device memory per phase (memory ledger; per rank, the largest of {config.world_size})")
        print(f"[memory] timeline of the last iterations: {path}", flush=True)
