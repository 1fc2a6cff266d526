"""The GRPO loop: rollout -> rewards -> advantages -> reference and old log-probs -> update -> record.

`train()` reads like the algorithm; each step is one call here. Every step talks to the actor through
`ActorGroup` (workers/actor_group.py), whichever placement runs it, and never moves device states: each
RPC declares its phase and the ranks' sharding managers do the rest.
"""
from __future__ import annotations

import copy
import time
from dataclasses import replace
from pathlib import Path

from mindspeed_rl.accelerator.host_memory import return_free_heap
from mindspeed_rl.checkpoint.lora_export import lora_record
from mindspeed_rl.checkpoint.trainer_state import Contents, save_run_checkpoint
from mindspeed_rl.config import GRPOConfig
from mindspeed_rl.data.dataset import PromptDataset, PromptSampler
from mindspeed_rl.data.rewards import RuleRewards
from mindspeed_rl.protocol import ROUTES_COLUMN, RolloutBatch
from mindspeed_rl.trainer import setup
from mindspeed_rl.trainer.advantage_step import AdvantageStep
from mindspeed_rl.trainer.critic_step import CriticAdvantageStep
from mindspeed_rl.trainer.dynamic_sampling import ScoredRollouts
from mindspeed_rl.trainer.evaluation import Evaluation, format_eval_line
from mindspeed_rl.trainer.scoring import Scoring
from mindspeed_rl.trainer.metrics import format_line, iteration_metrics
from mindspeed_rl.trainer.multi_turn import ToolTurns
from mindspeed_rl.trainer.phase_progress import with_phase_progress
from mindspeed_rl.trainer.rollout_correction_step import correct_rollout
from mindspeed_rl.trainer.rollout import forward_logprobs, padded_rows, response_ids, rollout_batch
from mindspeed_rl.trainer.sinks import MetricsSinks
from mindspeed_rl.trainer.trackers import build_trackers
from mindspeed_rl.trainer.stopping import RunProgress
from mindspeed_rl.trainer.summary import summary_lines
from mindspeed_rl.workers.actor_group import ActorGroup, merge_metrics, merge_shards


# The advantage step of an estimator that brings more than the outcome rewards (PPO's GAE: the critic).
ADVANTAGE_STEPS = {"gae": CriticAdvantageStep}


def train(config: GRPOConfig, actor_group: ActorGroup, tokenizer, dataset: PromptDataset, run_dir: Path, *,
          sampler: PromptSampler | None = None, start_iteration: int = 1, hf_dir: str | None = None,
          progress: RunProgress | None = None, prediction=None, reward_group=None,
          eval_dataset: PromptDataset | None = None, kl_coef: float | None = None,
          rollout_ahead: list | None = None) -> list[dict]:
    """Iterations start_iteration..train_iters; `sampler`, `kl_coef` and `rollout_ahead` (the rollout a checkpoint
    kept, started ahead of its next iteration) come from the checkpoint a run resumes from."""
    hf_dir = hf_dir or setup.resolve_assets(config)[0]
    progress = progress or RunProgress(save_root=config.actor_config.save, first_iteration=start_iteration)
    actor_group = with_phase_progress(actor_group, every_seconds=config.runtime.progress_seconds,
                                      iteration=lambda: progress.iteration)
    rollouts, sampling, evaluation = _rollout_steps(config, actor_group, tokenizer, dataset, sampler, reward_group,
                                                    eval_dataset, rollout_ahead)
    advantages = ADVANTAGE_STEPS.get(config.rl_config.adv_estimator, AdvantageStep)(config, actor_group, kl_coef=kl_coef)
    record = Recorder(config, run_dir, prediction or setup.memory_prediction(
        config, setup.read_hf_config(hf_dir), quiet=True), progress=progress)
    try:
        if start_iteration == 1 and evaluation.due(0):  # a resumed run was evaluated when it was saved
            record.evaluation_before_train(evaluation.run(0))
        for iteration in range(start_iteration, config.megatron_training.train_iters + 1):
            progress.iteration = iteration
            started = time.perf_counter()
            scored = sampling.next(iteration)  # generated now or during the last update, scored, maybe refilled
            batch, rewards, metrics = scored.batch, scored.rewards, scored.metrics
            if config.uses_reference:  # the KL term's only input
                batch.columns["ref_logprobs"], ref_metrics = forward_logprobs(actor_group, "compute_ref_log_prob", batch)
                metrics |= ref_metrics
            metrics |= old_logprobs(config, actor_group, batch)
            metrics |= correct_rollout(batch, config.rl_config)  # before the advantages: they skip rejected tokens
            metrics |= advantages.estimate(batch, rewards)
            rollouts.start_ahead(iteration + 1, rescore=batch)  # one-step off-policy: the next rollout runs meanwhile
            finish_critic_update = advantages.start_critic_update(batch)  # on its own devices: during the update
            metrics |= merge_metrics(actor_group.call("update", batch, kl_coef=advantages.loss_kl_coef))
            metrics |= finish_critic_update()
            metrics |= evaluation.run(iteration) if evaluation.due(iteration) else {}
            metrics |= rollouts.finish_rescore(batch)
            record(iteration, started, batch, rewards, scored.accuracy, metrics)
            if saves_at(config, iteration):
                save_checkpoint(config, actor_group, iteration, rollouts, progress, hf_dir, kl_coef=advantages.kl_coef)
    finally:
        record.close()
        actor_group.stop_reporting()
    return record.finish(actor_group, hf_dir)


def old_logprobs(config: GRPOConfig, actor_group: ActorGroup, batch: RolloutBatch) -> dict:
    """The separate old-log-prob pass, where the update's own first forward does not give them; with the mismatch
    ledger on routes the update does not replay, also the log-probs under vLLM's routes (its routing share)."""
    rl, metrics = config.rl_config, {}
    routing_share = rl.mismatch_ledger and ROUTES_COLUMN in batch.columns and not rl.routing_replay
    if not config.old_logprobs_from_update or routing_share:
        batch.columns["old_logprobs"], metrics = forward_logprobs(actor_group, "compute_log_prob", batch)
    if routing_share:
        forced = replace(batch, meta_info={**batch.meta_info, "replay_routing": True})
        batch.columns["replayed_logprobs"], _ = forward_logprobs(actor_group, "compute_log_prob", forced)
    return metrics


def _rollout_steps(config: GRPOConfig, actor_group: ActorGroup, tokenizer, dataset: PromptDataset,
                   sampler: PromptSampler | None, reward_group, eval_dataset: PromptDataset | None,
                   rollout_ahead: list | None):
    """The rollouts (with the tools under multi-turn), their scoring with dynamic sampling's refills, and the
    evaluation, which rolls out and scores the same way."""
    tool_turns = ToolTurns(config, tokenizer) if config.rl_config.multi_turn_enable else None
    rollouts = Rollouts(actor_group, dataset, sampler or make_sampler(config, dataset), config, tool_turns,
                        resumed_ahead=rollout_ahead)
    scoring = Scoring(config, tokenizer, actor_group, reward_group)
    return rollouts, ScoredRollouts(rollouts, scoring, config), Evaluation(config, scoring, eval_dataset, tool_turns)


class Rollouts:
    """Each iteration's prompts and samples: generated when asked for, or, one-step off-policy
    (`async_generation_ratio: 1`, disaggregated), started on the inference ranks during the update before."""

    def __init__(self, actor_group: ActorGroup, dataset: PromptDataset, sampler: PromptSampler, config: GRPOConfig,
                 tool_turns: ToolTurns | None = None, *, resumed_ahead: list | None = None):
        self.actor_group, self.dataset, self.sampler, self.config = actor_group, dataset, sampler, config
        self.tool_turns = tool_turns  # multi-turn tool use: the rollout runs turn by turn (trainer/multi_turn.py)
        self._ahead: list | None = None  # the prompts of the rollout started ahead
        self._sampler_before_ahead: PromptSampler | None = None
        self.ahead_result: list | None = None  # that rollout's per-rank results, once finished
        self._stale = False  # whether the last batch handed out was sampled ahead
        self._rescoring = False  # a re-score of it started (start_ahead's `rescore`)
        if resumed_ahead is not None:  # a checkpoint's: sampled by the weights before its own, as it was then
            self._sampler_before_ahead = copy.deepcopy(self.sampler)
            self._ahead, self.ahead_result = self._draw(), resumed_ahead

    def next(self, iteration: int, *, refill: int = 0) -> tuple[list, RolloutBatch, dict]:
        """(prompts, batch, metrics) of `iteration`; `refill` > 0: dynamic sampling's further rollouts of it."""
        if self.tool_turns is not None:  # never ahead (config/multi_turn.py)
            prompts = self._draw()
            batch, metrics = self.tool_turns.generate(self.actor_group, [p.token_ids for p in prompts],
                                                      iteration=(iteration, refill))
            return prompts, batch, metrics | {"rollout/staleness": 0}
        if self._ahead is None:
            prompts, staleness = self._draw(), 0
            # Each refill its own sampling stream; refill 0 is the iteration's own (workers/actor_steps.sampling_seed).
            self.actor_group.start_generate([p.token_ids for p in prompts], (iteration, refill))
        else:
            self.finish_ahead()
            prompts, self._ahead = self._ahead, None
            staleness = self.config.rollout_staleness
        results, self.ahead_result = self.ahead_result or self.actor_group.finish_generate(), None
        batch, metrics = rollout_batch(results, [p.token_ids for p in prompts], self.config)
        metrics["rollout/staleness"] = staleness
        self._stale = bool(staleness)
        return prompts, batch, metrics

    def start_ahead(self, iteration: int, *, rescore: RolloutBatch | None = None) -> None:
        """Start `iteration`'s rollout now where the run is one-step off-policy (and that iteration runs); with the
        mismatch ledger, `rescore` (this iteration's batch, sampled ahead) is re-scored by vLLM under the weights
        that train it, pushed for that rollout (or for the re-score alone after the last one)."""
        if not self.config.rollout_staleness:
            return
        if iteration <= self.config.megatron_training.train_iters:
            self._sampler_before_ahead = copy.deepcopy(self.sampler)  # a checkpoint now resumes at those prompts
            self._ahead = self._draw()
            self.actor_group.start_generate([p.token_ids for p in self._ahead], iteration)
        if rescore is not None and self._stale and self.config.rl_config.mismatch_ledger:
            prompts = [row[:length].tolist() for row, length in zip(rescore.input_ids, rescore.prompt_lengths)]
            self.actor_group.start_score(prompts, response_ids(rescore))
            self._rescoring = True

    def finish_rescore(self, batch: RolloutBatch) -> dict:
        """The re-score started with the next rollout, waited for, as `batch`'s `rescored_logprobs` column."""
        if not self._rescoring:
            return {}
        self._rescoring = False
        results = self.actor_group.finish_score()
        rows = [values for shard in merge_shards([s for s, _ in results]) for values in shard.value]
        batch.columns["rescored_logprobs"] = padded_rows(rows, batch.response_logprobs_shape)
        return {"timing/rescore": results[0][1].get("timing/rescore", 0.0)}

    def finish_ahead(self) -> list | None:
        """The rollout started ahead, waited for (a checkpoint keeps it: its weights are gone after the update)."""
        if self._ahead is not None and self.ahead_result is None:
            self.ahead_result = self.actor_group.finish_generate()
        return self.ahead_result

    @property
    def resume_sampler(self) -> PromptSampler:
        """The sampler a checkpoint saves: before the prompts of a rollout started ahead."""
        return self.sampler if self._ahead is None else self._sampler_before_ahead

    def _draw(self) -> list:
        return [self.dataset.records[index] for index in self.sampler.next_indices()]


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
                               rollout_ahead=rollouts.finish_ahead())
    progress.last_checkpoint, progress.saved_by_this_run = str(path), True
    print(f"[checkpoint] saved {path}", flush=True)


def checkpoint_contents(config: GRPOConfig) -> Contents:
    ac = config.actor_config
    return Contents(optimizer=not ac.no_save_optim, rng=not ac.no_save_rng,
                    expert_parallel_size=ac.expert_model_parallel_size)


def plot_curves(history: list[dict], run_dir: Path, config: GRPOConfig, *, before_train: dict | None = None) -> None:
    from mindspeed_rl.trainer.curves import plot_training_curves

    plot_training_curves(([before_train] if before_train else []) + history, run_dir / "training_curves.png")
    print(f"[metrics] training curves: {run_dir / 'training_curves.png'}", flush=True)
    if config.runtime.memory_timeline:
        from mindspeed_rl.memory.timeline import plot_memory_timeline

        path = run_dir / "memory_timeline.png"
        plot_memory_timeline(history, path, last_iterations=3,
                             title=f"Device memory per phase (memory ledger; per rank, the largest of {config.world_size})")
        print(f"[memory] timeline of the last iterations: {path}", flush=True)
