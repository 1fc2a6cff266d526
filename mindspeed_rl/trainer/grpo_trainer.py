"""The GRPO loop: generate -> reward -> reference and old log-probs -> advantages -> update."""
from __future__ import annotations

import contextlib
import copy
import os
import sys
import time
from pathlib import Path

import torch

from mindspeed_rl.algorithms.grpo import group_normalized_advantages
from mindspeed_rl.checkpoint.store import discard_unfinished_saves
from mindspeed_rl.checkpoint.trainer_state import (find_resume_point, resume_actor, save_run_checkpoint,
                                                  truncate_metrics_after)
from mindspeed_rl.config import GRPOConfig
from mindspeed_rl.data.dataset import PromptDataset, PromptSampler, check_prompt_rows, load_prompt_dataset
from mindspeed_rl.data.rewards import accuracy, compute_rule_rewards
from mindspeed_rl.protocol import RolloutBatch
from mindspeed_rl.trainer import setup
from mindspeed_rl.trainer.reward_model import model_score_metrics, resolve_reward_model, with_model_scores
from mindspeed_rl.trainer.metrics import (length_stats, phase_timings, reward_metrics, rollout_mismatch,
                                          throughput)
from mindspeed_rl.trainer.sinks import MetricsSinks
from mindspeed_rl import interrupts
from mindspeed_rl.interrupts import RunInterrupted
from mindspeed_rl.trainer.stopping import WORKER_FAILURE_EXIT_CODE, RunProgress, RunStopped
from mindspeed_rl.workers.group import RayActorGroup, default_env_vars, merge_metrics, merge_shards
from mindspeed_rl.workers.local_group import LocalActorGroup, check_local_devices, reason_for_ray
from mindspeed_rl.workers.reward_workers import RewardWorkerGroup
from mindspeed_rl.workers.supervision import WorkerFailure


def run_grpo(config: GRPOConfig, *, run_dir: Path) -> list[dict]:
    """The whole run. Ends with the history, or raises RunStopped (interrupted, a worker failed)
    after every worker is gone; ConfigError for bad input, before any worker starts."""
    progress = RunProgress(save_root=config.actor_config.save)
    with contextlib.ExitStack() as stack:
        if not interrupts.is_installed():  # the CLI installs them first; a library caller gets them here
            stack.enter_context(interrupts.stop_signals())
        try:
            return _run(config, run_dir, progress)
        except RunInterrupted as interrupt:
            raise RunStopped(128 + interrupt.signum, progress.interrupted_line(interrupt.signum)) from None
        except WorkerFailure as failure:
            raise RunStopped(WORKER_FAILURE_EXIT_CODE, progress.worker_failure_line(failure)) from None


def _run(config: GRPOConfig, run_dir: Path, progress: RunProgress) -> list[dict]:
    import ray
    from transformers import AutoTokenizer

    from mindspeed_rl.accelerator import detect_device

    mt = config.megatron_training
    setup.check_host(config, run_dir)  # a missing device or an unwritable run dir fails before any file is read
    model_dir, ref_dir, data_path = setup.resolve_assets(config)
    check_prompt_rows(data_path, map_keys=dict(mt.map_keys))  # bad rows fail before any model file is read
    hf_config = setup.read_hf_config(model_dir)
    setup.check_against_checkpoint(config, hf_config, model_dir)
    tokenizer = AutoTokenizer.from_pretrained(model_dir, trust_remote_code=config.generate_config.trust_remote_code)
    setup.check_tokenizer_fits_model(tokenizer, hf_config, model_dir)
    resolve_reward_model(config, model_dir, len(tokenizer))  # rewards.<name>.model_path, checked before any worker
    ac = config.actor_config
    # A partial, corrupt or other-model checkpoint stops here, before any worker starts.
    resume = find_resume_point(ac.load, finetune=ac.finetune, hf_config=hf_config)
    ref_checkpoint = setup.reference_checkpoint(config, hf_config)
    setup.check_run_dir_metrics(run_dir / config.runtime.metrics_file, resume_iteration=resume.iteration if resume else 0)
    dataset = load_prompt_dataset(data_path, tokenizer=tokenizer, prompt_type=mt.prompt_type, map_keys=dict(mt.map_keys),
                                  max_prompt_length=config.rl_config.max_prompt_length,
                                  overlong_prompts=mt.overlong_prompts)
    sampler = _sampler(config, dataset)  # a dataset smaller than a batch fails here, not as a hang later
    print(f"[data] {len(dataset.records)} prompts from {dataset.source} "
          f"({dataset.num_filtered} longer than rl_config.max_prompt_length={config.rl_config.max_prompt_length} "
          f"filtered), prompt_type={mt.prompt_type}", flush=True)
    device = detect_device() if config.runtime.device == "auto" else config.runtime.device
    setup.check_host_capacity(config, device, os.cpu_count() or 1)
    print(config.resource_plan.table(device), flush=True)  # device -> roles, colocated or disaggregated
    prediction = memory_prediction(config, hf_config, device)  # cli/plan.py's figures, compared with the ledger
    threads = setup.threads_per_rank(config)
    ray_reason = reason_for_ray(config)  # None: one rank process, run in this one (runtime.local_single_rank)
    actor, completed, reward_group = None, False, None
    try:
        if ray_reason is None:
            print("[init] one rank: running it in this process (no Ray; runtime.local_single_rank=false uses Ray)",
                  flush=True)
            check_local_devices(config, device)
        else:
            print(f"[init] Ray runs the rank processes ({ray_reason})", flush=True)
            progress.phase = "Ray start"
            with interrupts.shielded():
                setup.start_ray(config, device, threads)
            interrupts.install()
            config.resource_plan.check_ray_cluster(device)
            reward_group = RewardWorkerGroup.from_config(config)  # rewards.<name>.world_size CPU workers, or None
        progress.phase = "initialize"
        print(f"[init] starting {config.num_rank_processes} rank(s) on {device}: checkpoint load, Megatron build, "
              "vLLM start", flush=True)
        if ray_reason is None:
            actor = LocalActorGroup(config=config, env_vars=default_env_vars(threads), model_dir=model_dir,
                                    ref_model_dir=ref_dir, threads=threads, on_hang=_hang_reporter(config, progress))
        else:
            actor = _actor_group(config, device, default_env_vars(threads), model_dir, ref_dir)
        for address in actor.addresses:
            print(f"[init] {address.describe()}", flush=True)
        init_metrics = merge_metrics(actor.initialize())
        print(f"[init] ranks={config.num_rank_processes} device={device} {init_metrics['timing/initialize']:.1f}s", flush=True)
        if resume is not None:
            progress.phase = "checkpoint load"
            resume_actor(actor, resume, finetune=ac.finetune, no_load_optim=ac.no_load_optim,
                         no_load_rng=ac.no_load_rng)
            progress.last_checkpoint = str(resume.path)
            if resume.iteration:
                sampler.load_state_dict(resume.state["sampler"])
                truncate_metrics_after(run_dir / config.runtime.metrics_file, resume.iteration)
            print(f"[checkpoint] loaded {resume.path} ({'weights only' if ac.finetune else 'resuming'} "
                  f"after iteration {resume.iteration})", flush=True)
        if ref_checkpoint is not None:
            actor.call("load_reference_checkpoint", str(ref_checkpoint))
            print(f"[checkpoint] reference model loaded from {ref_checkpoint}", flush=True)
        history = train(config, actor, tokenizer, dataset, run_dir, sampler=sampler,
                        start_iteration=resume.iteration + 1 if resume else 1, hf_dir=model_dir, progress=progress,
                        prediction=prediction, reward_group=reward_group)
        completed = True
        return history
    finally:
        # Signals wait until the workers are gone: a second Ctrl-C must not leave them running.
        with interrupts.deferred():
            if reward_group is not None:
                reward_group.kill()
            if actor is not None and completed:
                actor.shutdown()
            elif actor is not None:
                actor.kill()
            if not completed:
                discard_unfinished_saves(config.actor_config.save)
            ray.shutdown()


def _hang_reporter(config: GRPOConfig, progress: RunProgress):
    """What the in-process rank's watchdog does before it ends the process: the run's one failure line,
    and no half-written checkpoint left looking like one (the `finally` of _run never runs)."""
    def report(message: str) -> None:
        print(progress.worker_failure_line(message), file=sys.stderr, flush=True)
        discard_unfinished_saves(config.actor_config.save)
    return report


def _actor_group(config: GRPOConfig, device: str, env_vars: dict[str, str], model_dir: str, ref_dir: str):
    """The actor's ranks: one group switching between roles (colocated), or a training group and an
    inference group behind the same interface (disaggregated)."""
    if config.disaggregated:
        from mindspeed_rl.workers.disaggregated import DisaggregatedActor

        return DisaggregatedActor(config=config, device=device, env_vars=env_vars, model_dir=model_dir,
                                  ref_model_dir=ref_dir)
    return RayActorGroup(config=config, device=device, env_vars=env_vars, model_dir=model_dir, ref_model_dir=ref_dir)


def _draw(dataset: PromptDataset, sampler: PromptSampler) -> list:
    return [dataset.records[index] for index in sampler.next_indices()]


def _sampler(config: GRPOConfig, dataset: PromptDataset) -> PromptSampler:
    mt = config.megatron_training
    return PromptSampler(len(dataset.records), mt.global_batch_size, seed=mt.seed, shuffle=not mt.no_shuffle,
                         wrap_small_dataset=mt.wrap_small_dataset)


def train(config: GRPOConfig, actor: RayActorGroup, tokenizer, dataset: PromptDataset, run_dir: Path, *,
          sampler: PromptSampler | None = None, start_iteration: int = 1, hf_dir: str | None = None,
          progress: RunProgress | None = None, prediction=None,
          reward_group: RewardWorkerGroup | None = None) -> list[dict]:
    mt, rl = config.megatron_training, config.rl_config
    if prediction is None:  # a library caller: the same plan, from the checkpoint the run was built from
        prediction = memory_prediction(config, setup.read_hf_config(hf_dir or setup.resolve_assets(config)[0]),
                                       quiet=True)
    sampler = sampler or _sampler(config, dataset)
    progress = progress or RunProgress(save_root=config.actor_config.save)
    sinks = MetricsSinks(run_dir, metrics_file=config.runtime.metrics_file, use_tensorboard=rl.use_tensorboard)
    history, next_rollout, sampler_before_next = [], None, None
    try:
        for iteration in range(start_iteration, mt.train_iters + 1):
            progress.iteration = iteration
            started = time.perf_counter()
            if next_rollout is None:
                prompts = _draw(dataset, sampler)
                batch, metrics = generate(actor, prompts, config, iteration=iteration)
                metrics["rollout/staleness"] = 0
            else:  # started during the previous update (async_generation_ratio: 1)
                (prompts, batch, metrics), next_rollout = finish_rollout(actor, next_rollout, config), None
                metrics["rollout/staleness"] = config.rollout_staleness
            responses = [tokenizer.decode(ids, skip_special_tokens=True) for ids in _response_ids(batch)]
            labels = [p.label for p in prompts for _ in range(rl.n_samples_per_prompt)]
            if reward_group is None:
                rewards = compute_rule_rewards(responses, labels, rl.verifier_function, rl.verifier_weight,
                                               timeout_seconds=rl.verifier_timeout_seconds)
            else:  # in parallel on the CPU workers; a failed sample scores 0 and is counted
                rewards, metrics["reward_workers/failed_samples"] = reward_group.score(responses, labels)
            if config.reward_model is not None:  # on the actor's ranks, in the residency table's `reward` phase
                scores, model_metrics = forward_logprobs(actor, "compute_reward_scores", batch)
                rewards = with_model_scores(rewards, scores, config.reward_model[1].model_weight)
                metrics.update(model_metrics | model_score_metrics(scores))
            batch.columns["advantages"] = group_normalized_advantages(rewards.total, rl.n_samples_per_prompt)
            batch.columns["ref_logprobs"], ref_metrics = forward_logprobs(actor, "compute_ref_log_prob", batch)
            # ROLL's manual control: the update right after needs the train params again, so they stay.
            batch.meta_info["is_offload_states"] = False
            batch.columns["old_logprobs"], old_metrics = forward_logprobs(actor, "compute_log_prob", batch)
            batch.meta_info.pop("is_offload_states")
            if config.rollout_staleness and iteration < mt.train_iters:  # the next rollout runs during this update
                sampler_before_next = copy.deepcopy(sampler)  # a checkpoint of this iteration resumes at those prompts
                next_rollout = start_rollout(actor, _draw(dataset, sampler), iteration + 1)
            update_metrics = merge_metrics(actor.call("update", batch, kl_coef=rl.init_kl_coef))
            metrics.update(ref_metrics | old_metrics | update_metrics)
            metrics["iteration"] = iteration
            metrics["timing/all"] = time.perf_counter() - started
            metrics.update(iteration_metrics(config, batch, metrics, rewards,
                                             accuracy(responses, labels, rl.verifier_function)))
            if prediction is not None:  # the planner's bytes at this iteration's sequence width, beside the ledger's
                metrics.update(prediction.with_seq_length(batch.input_ids.shape[1]).ledger_metrics())
            history.append(metrics)
            sinks.write(metrics)
            if iteration % config.runtime.log_interval == 0:
                print(format_line(metrics), flush=True)
            if _saves_at(config, iteration):
                resume_sampler = sampler if next_rollout is None else sampler_before_next
                path = save_run_checkpoint(actor=actor, save_root=config.actor_config.save, iteration=iteration,
                                           sampler=resume_sampler, kl_coef=rl.init_kl_coef, seed=mt.seed,
                                           hf_dir=hf_dir or mt.tokenizer_name_or_path,
                                           keep_last_n=config.actor_config.keep_last_n)
                progress.last_checkpoint = str(path)
                print(f"[checkpoint] saved {path}", flush=True)
    finally:
        sinks.close()
    if history:
        _plot_curves(history, run_dir, config)
    if mt.save_hf:
        from mindspeed_rl.checkpoint.hf_export import export_run_actor

        path = export_run_actor(actor, run_dir=run_dir, config_dir=hf_dir or mt.tokenizer_name_or_path)
        print(f"[export] HF checkpoint: {path}", flush=True)
    return history


def memory_prediction(config: GRPOConfig, hf_config: dict, device: str | None = None, *, quiet: bool = False):
    """The planner's MemoryPlan of this run (cli/plan.py), printed as one line per phase; None (said in one
    line) when the planner cannot size the model."""
    from mindspeed_rl.accelerator import detect_device
    from mindspeed_rl.config import ConfigError
    from mindspeed_rl.planner.from_config import predict_run
    from mindspeed_rl.planner.memory import format_bytes

    device = device or (detect_device() if config.runtime.device == "auto" else config.runtime.device)
    try:
        plan = predict_run(config, hf_config, device=device)
    except (ConfigError, ValueError) as error:
        if not quiet:
            print(f"[plan] no memory prediction: {error}", flush=True)
        return None
    if not quiet:
        table, totals = plan.table(plan.ledger_phases), plan.totals(plan.ledger_phases)
        for phase in plan.ledger_phases:
            parts = ", ".join(f"{k} {format_bytes(v)}" for k, v in table[phase].items() if v)
            where = f" at {plan.inputs.padded_seq_length} tokens per sequence" if phase == "update" else ""
            print(f"[plan] {phase}: {format_bytes(totals[phase][1])} per device predicted{where} ({parts})", flush=True)
    return plan


def iteration_metrics(config: GRPOConfig, batch: RolloutBatch, phase_metrics: dict, rewards, accuracy_value: float) -> dict:
    """Everything derived from the iteration's batch, rewards and phase timings."""
    response_lengths, prompt_lengths = batch.response_mask.sum(1).long(), batch.prompt_lengths
    metrics = reward_metrics(rewards.total, rewards.per_verifier, accuracy_value)
    metrics |= length_stats("response_length", response_lengths) | length_stats("prompt_length", prompt_lengths)
    metrics |= rollout_mismatch(batch.columns["rollout_logprobs"], batch.columns["old_logprobs"], batch.response_mask)
    metrics |= phase_timings(phase_metrics)
    metrics |= throughput(prompt_lengths=prompt_lengths, response_lengths=response_lengths,
                          world_size=config.num_rank_processes, seconds_all=phase_metrics["timing/all"],
                          seconds_rollout=phase_metrics.get("timing/rollout", 0.0),
                          seconds_update=metrics["timing/update"],
                          use_max_lengths=config.rl_config.log_max_throughput)
    if "actor/grad_norm" in phase_metrics:
        metrics["grad_norm"] = phase_metrics["actor/grad_norm"]
    return metrics


def _plot_curves(history: list[dict], run_dir: Path, config: GRPOConfig) -> None:
    from mindspeed_rl.trainer.curves import plot_training_curves

    plot_training_curves(history, run_dir / "training_curves.png")
    print(f"[metrics] training curves: {run_dir / 'training_curves.png'}", flush=True)
    if config.runtime.memory_timeline:
        from mindspeed_rl.memory.timeline import plot_memory_timeline

        path = run_dir / "memory_timeline.png"
        plot_memory_timeline(history, path, last_iterations=3,
                             title=f"Device memory per phase (memory ledger; per rank, the largest of {config.world_size})")
        print(f"[memory] timeline of the last iterations: {path}", flush=True)


def _saves_at(config: GRPOConfig, iteration: int) -> bool:
    interval = config.megatron_training.save_interval
    last = iteration == config.megatron_training.train_iters
    return config.actor_config.save is not None and (last or (interval is not None and iteration % interval == 0))


def generate(actor: RayActorGroup, prompt_batch, config: GRPOConfig, *,
             iteration: int | None = None) -> tuple[RolloutBatch, dict]:
    prompt_ids = [p.token_ids for p in prompt_batch]
    return rollout_batch(actor.call("generate_sequences", prompt_ids, iteration), prompt_ids, config)


def start_rollout(actor, prompt_batch, iteration: int) -> list:
    """The rollout of `iteration` on the inference devices, not waited for (a DisaggregatedActor)."""
    actor.start_generate([p.token_ids for p in prompt_batch], iteration)
    return prompt_batch


def finish_rollout(actor, prompt_batch, config: GRPOConfig) -> tuple[list, RolloutBatch, dict]:
    batch, metrics = rollout_batch(actor.finish_generate(), [p.token_ids for p in prompt_batch], config)
    return prompt_batch, batch, metrics


def rollout_batch(results: list, prompt_ids: list[list[int]], config: GRPOConfig) -> tuple[RolloutBatch, dict]:
    """Every inference rank's (samples, metrics) -> one prompt-major batch and the merged metrics."""
    metrics = merge_metrics([m for _, m in results])
    samples = [sample for shard in merge_shards([s for s, _ in results]) for sample in shard.value]
    samples.sort(key=lambda sample: sample[0])  # prompt-major: a prompt's n samples are contiguous
    width = config.generate_config.sampling_config.max_tokens
    batch = RolloutBatch.from_token_lists([prompt_ids[i] for i, _, _ in samples], [ids for _, ids, _ in samples],
                                          pad_id=0, response_width=width)
    rollout_logprobs = torch.zeros(batch.response_logprobs_shape)
    for row, (_, ids, logprobs) in enumerate(samples):
        rollout_logprobs[row, : len(ids)] = torch.tensor(logprobs)
    batch.columns["rollout_logprobs"] = rollout_logprobs
    return batch, metrics


def forward_logprobs(actor: RayActorGroup, method: str, batch: RolloutBatch) -> tuple[torch.Tensor, dict]:
    results = actor.call(method, batch)
    logprobs = torch.cat([shard.value for shard in merge_shards([s for s, _ in results])])
    return logprobs, merge_metrics([m for _, m in results])


def _response_ids(batch: RolloutBatch) -> list[list[int]]:
    tokens, lengths = batch.response_tokens(), batch.response_mask.sum(1).long()
    return [tokens[i, : lengths[i]].tolist() for i in range(len(batch))]


def format_line(m: dict) -> str:
    phases = ("rollout", "resharding_to_infer", "update")
    seconds = " ".join(f"{p}={m.get('timing/' + p, 0.0):.2f}s" for p in phases)
    # ROLL's automatic mode moves states around every call; its cost summed over the phases.
    for stage in ("onload", "offload"):
        spent = sum(m.get(f"timing/{p}/{stage}", 0.0) for p in ("generate", "reward", "ref_logprob", "old_logprob",
                                                                  "update"))
        seconds += f" {stage}={spent:.2f}s"
    if "timing/resharding_fingerprint" in m:  # what the exact-weights check costs, inside resharding_to_infer
        seconds += f" fingerprint={m['timing/resharding_fingerprint']:.3f}s"
    if m.get("rollout/staleness"):
        seconds += f" stale={m['rollout/staleness']}"
    memory = " ".join(f"{p}={m.get(f'memory/{p}/total_bytes', 0) / 2**20:.0f}MiB"
                      for p in ("generate", "ref_logprob", "old_logprob", "update"))
    return (f"[iter {m['iteration']:>4}] reward={m['reward/mean']:.3f} acc={m['reward/accuracy']:.3f} "
            f"kl={m.get('actor/kl_loss', 0.0):.4f} lp_diff={m['rollout/logprob_max_abs_diff']:.1e} "
            f"resp_len={m['response_length/mean']:.1f} e2e_tps={m['e2e_tps']:.0f} "
            f"total={m['timing/all']:.2f}s {seconds} | device {memory}")
