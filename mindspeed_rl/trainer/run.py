"""A whole run: prepare it (every check, the data; no worker), start the actor's ranks, restore a checkpoint,
train, and end every process whatever happened."""
from __future__ import annotations

import contextlib
import dataclasses
import os
import sys
from pathlib import Path

from mindspeed_rl import interrupts
from mindspeed_rl.checkpoint.store import discard_unfinished_saves
from mindspeed_rl.checkpoint.trainer_state import (check_optimizer_split, find_resume_point, resume_actor,
                                                  truncate_metrics_after)
from mindspeed_rl.config import ConfigError, GRPOConfig
from mindspeed_rl.data.dataset import PromptDataset, check_prompt_rows, load_prompt_dataset
from mindspeed_rl.interrupts import RunInterrupted
from mindspeed_rl.trainer import setup
from mindspeed_rl.trainer.grpo_trainer import make_sampler, train
from mindspeed_rl.trainer.prepared_run import PreparedRun
from mindspeed_rl.trainer.restarts import Restarts, wait_for_cluster
from mindspeed_rl.trainer.reward_model import resolve_reward_model
from mindspeed_rl.trainer.teacher import resolve_teacher
from mindspeed_rl.trainer.stopping import DISK_ERRNOS, WORKER_FAILURE_EXIT_CODE, RunProgress, RunStopped
from mindspeed_rl.workers.actor_group import ActorGroup, merge_metrics
from mindspeed_rl.workers.supervision import WorkerFailure


def run_grpo(config: GRPOConfig, *, run_dir: Path) -> list[dict]:
    """The whole run. Ends with the history, or raises RunStopped (interrupted, a worker failed)
    after every worker is gone; ConfigError for bad input, before any worker starts."""
    progress = RunProgress(save_root=config.actor_config.save)
    with stopped_on_failure(progress):
        return _run(config, run_dir, progress)


@contextlib.contextmanager
def stopped_on_failure(progress: RunProgress):
    """A run's body (every entry point's): stop signals installed where the CLI has not, and an interrupt, a worker
    failure or a disk error turned into RunStopped with its one line, after every worker is gone."""
    with contextlib.ExitStack() as stack:
        if not interrupts.is_installed():  # the CLI installs them first; a library caller gets them here
            stack.enter_context(interrupts.stop_signals())
        try:
            yield
        except RunInterrupted as interrupt:
            raise RunStopped(128 + interrupt.signum, progress.interrupted_line(interrupt.signum)) from None
        except WorkerFailure as failure:
            raise RunStopped(WORKER_FAILURE_EXIT_CODE, progress.worker_failure_line(failure)) from None
        except OSError as error:
            if error.errno not in DISK_ERRNOS:
                raise
            raise RunStopped(WORKER_FAILURE_EXIT_CODE, progress.disk_failure_line(error)) from None


def _run(config: GRPOConfig, run_dir: Path, progress: RunProgress) -> list[dict]:
    with contextlib.ExitStack() as held:  # the run and save directories, held from prepare_run to the end
        run = prepare_run(config, run_dir, held)
        progress.first_iteration = run.resume.iteration + 1 if run.resume else 1
        restarts = Restarts(max_restarts=config.runtime.max_restarts,
                            restart_wait_seconds=config.runtime.restart_wait_seconds)
        while True:
            try:
                return _start_and_train(restarts.config_for_restart(config) if restarts.count else config, run,
                                        run_dir, progress, restarts)
            except WorkerFailure as failure:
                restarts.after(failure, progress)  # raises when the run ends here
            except ConfigError as error:
                if not restarts.count:
                    raise
                # A restart that Ray could not place (a node not back in time) ends the run, not its config.
                raise RunStopped(WORKER_FAILURE_EXIT_CODE, f"restart {restarts.count} failed: {error}") from None
            run = restart_point(config, run, run_dir, progress, restarts)


def restart_point(config: GRPOConfig, run: PreparedRun, run_dir: Path, progress: RunProgress,
                  restarts: Restarts) -> PreparedRun:
    """Where a restart resumes: the newest intact checkpoint of actor_config.save once this run saved one (an
    interrupted save was discarded with the ranks), else where the run started; a fresh sampler that the
    checkpoint positions, and the metrics records after it dropped (the restarted iterations write them again)."""
    resume = run.resume
    if progress.saved_by_this_run:
        resume = find_resume_point(config.actor_config.save, finetune=False,
                                   hf_config=setup.read_hf_config(run.model_dir), resume_from_last_intact=True)
    start_iteration = resume.iteration + 1 if resume else 1
    # From the start: the evaluation before training (iteration 0) runs again too.
    truncate_metrics_after(run_dir / config.runtime.metrics_file, start_iteration - 1 if start_iteration > 1 else -1)
    print(restarts.restart_line(start_iteration, str(resume.path) if resume else "the initial weights"), flush=True)
    return dataclasses.replace(run, resume=resume, sampler=make_sampler(config, run.dataset),
                               restarted=progress.saved_by_this_run)


def _start_and_train(config: GRPOConfig, run: PreparedRun, run_dir: Path, progress: RunProgress,
                     restarts: Restarts) -> list[dict]:
    import ray

    from mindspeed_rl.data.verifier_process import shared_verifier_process
    from mindspeed_rl.workers.reward_workers import RewardWorkerGroup
    from mindspeed_rl.workers.start import start_actor_group

    actor_group, reward_group, completed = None, None, False
    try:
        in_process = start_hosts(config, run.device, progress, restarts)
        reward_group = RewardWorkerGroup.from_config(config)  # rewards.<name>.world_size CPU workers, or None
        if reward_group is None:  # the driver's verifier child starts while the ranks do
            shared_verifier_process().start()
        progress.phase = "initialize"
        print(f"[init] starting {config.num_rank_processes} rank(s) on {run.device}: checkpoint load, Megatron "
              "build, vLLM start", flush=True)
        actor_group = start_actor_group(config, device=run.device, model_dir=run.model_dir, ref_model_dir=run.ref_dir,
                                        threads=setup.threads_per_rank(config), in_process=in_process,
                                        on_hang=_hang_reporter(config, progress))
        initialize(config, actor_group, run.device)
        restore(config, run, actor_group, run_dir, progress)
        if restarts.count:
            print(restarts.resumed_line(run.resume.iteration + 1 if run.resume else 1), flush=True)
        history = train(config, actor_group, run, run_dir, progress=progress, reward_group=reward_group)
        completed = True
        return history
    finally:
        # Signals wait until the workers are gone: a second Ctrl-C must not leave them running.
        with interrupts.deferred():
            if reward_group is not None:
                reward_group.kill()
            if actor_group is not None and completed:
                actor_group.shutdown()
            elif actor_group is not None:
                actor_group.kill()
            if not completed:
                discard_unfinished_saves(config.actor_config.save)
            ray.shutdown()


def prepare_run(config: GRPOConfig, run_dir: Path, held: contextlib.ExitStack) -> PreparedRun:
    """Every check that can fail on user input, in the order that fails cheapest first; the data loaded. The run
    and save directories are held (`held`) from here on: a second run on either is refused."""
    from transformers import AutoTokenizer

    from mindspeed_rl.accelerator import detect_device
    from mindspeed_rl.workers.stage_probe import write_configurations

    mt, ac = config.megatron_training, config.actor_config
    setup.check_host(config, run_dir)  # a missing device or an unwritable run dir fails before any file is read
    setup.hold_run_directories(config, run_dir, held)
    model_dir, ref_dir, data_path = setup.resolve_assets(config)
    check_prompt_rows(data_path, map_keys=dict(mt.map_keys))  # bad rows fail before any model file is read
    hf_config = setup.read_hf_config(model_dir)
    setup.check_against_checkpoint(config, hf_config, model_dir)
    tokenizer = AutoTokenizer.from_pretrained(model_dir, trust_remote_code=config.generate_config.trust_remote_code)
    setup.check_tokenizer_fits_model(tokenizer, hf_config, model_dir)
    resolve_reward_model(config, model_dir, len(tokenizer))  # rewards.<name>.model_path, checked before any worker
    resolve_teacher(config, model_dir, len(tokenizer))  # distillation's teacher, made once for the demo
    # A partial, corrupt or other-model checkpoint stops here, before any worker starts.
    resume = find_resume_point(ac.load, finetune=ac.finetune, hf_config=hf_config,
                               resume_from_last_intact=config.runtime.resume_from_last_intact)
    if resume is not None:
        check_optimizer_split(resume, finetune=ac.finetune, no_load_optim=ac.no_load_optim,
                              is_moe=bool(hf_config.get("num_experts") or hf_config.get("n_routed_experts")),
                              expert_parallel_size=ac.expert_model_parallel_size)
    ref_checkpoint = setup.reference_checkpoint(config, hf_config)
    setup.check_run_dir_metrics(run_dir / config.runtime.metrics_file, resume_iteration=resume.iteration if resume else 0)
    dataset = load_prompts(config, data_path, tokenizer)
    sampler = make_sampler(config, dataset)  # a dataset smaller than a batch fails here, not as a hang later
    print(f"[data] {len(dataset.records)} prompts from {dataset.source} "
          f"({dataset.num_filtered} longer than rl_config.max_prompt_length={config.rl_config.max_prompt_length} "
          f"filtered), prompt_type={mt.prompt_type}", flush=True)
    eval_dataset = load_eval_dataset(config, tokenizer)
    device = detect_device() if config.runtime.device == "auto" else config.runtime.device
    setup.check_host_capacity(config, device, os.cpu_count() or 1)
    absent = () if config.uses_reference else ("reference",)  # init_kl_coef 0: no reference model
    print(config.resource_plan.table(device, absent), flush=True)  # device -> roles, colocated or disaggregated
    write_configurations(config)  # msprobe_config.configurations_dump
    return PreparedRun(model_dir=model_dir, ref_dir=ref_dir, tokenizer=tokenizer, dataset=dataset,
                       eval_dataset=eval_dataset, sampler=sampler,
                       resume=resume, ref_checkpoint=ref_checkpoint, device=device,
                       prediction=setup.memory_prediction(config, hf_config, device))  # compared with the ledger


def load_prompts(config: GRPOConfig, path: str, tokenizer) -> PromptDataset:
    """A prompts file read as the config says: formats, map_keys, template, length limit and its policy."""
    mt = config.megatron_training
    return load_prompt_dataset(path, tokenizer=tokenizer, prompt_type=mt.prompt_type, map_keys=dict(mt.map_keys),
                               max_prompt_length=config.rl_config.max_prompt_length,
                               overlong_prompts=mt.overlong_prompts)


def load_eval_dataset(config: GRPOConfig, tokenizer) -> PromptDataset | None:
    """megatron_training.eval_data_path read as the training data is (formats, map_keys, template, length policy)."""
    mt = config.megatron_training
    path = setup.resolve_eval_data_path(config)
    if path is None:
        return None
    check_prompt_rows(path, map_keys=dict(mt.map_keys))
    dataset = load_prompts(config, path, tokenizer)
    if len(dataset.records) < config.infer_data_parallel_size:
        raise ConfigError("megatron_training.eval_data_path", f"has {len(dataset.records)} usable prompts, fewer than "
                                                              f"the inference data-parallel size "
                                                              f"{config.infer_data_parallel_size}")
    print(f"[data] {len(dataset.records)} eval prompts from {dataset.source}", flush=True)
    return dataset


def start_hosts(config: GRPOConfig, device: str, progress: RunProgress, restarts: Restarts | None = None) -> bool:
    """Whether the one rank runs in this process; otherwise Ray is started (or joined) for the ranks."""
    from mindspeed_rl.workers.local_group import check_local_devices, reason_for_ray

    ray_reason = reason_for_ray(config)  # None: one rank process, run in this one (runtime.local_single_rank)
    if ray_reason is None:
        print("[init] one rank: running it in this process (no Ray; runtime.local_single_rank=false uses Ray)",
              flush=True)
        check_local_devices(config, device)
        return True
    print(f"[init] Ray runs the rank processes ({ray_reason})", flush=True)
    progress.phase = "Ray start"
    with interrupts.shielded():
        setup.start_ray(config, device, setup.threads_per_rank(config))
    interrupts.install()
    if restarts is not None and restarts.count:  # a lost node may be on its way back
        wait_for_cluster(lambda: config.resource_plan.check_ray_cluster(device),
                         seconds=restarts.restart_wait_seconds, what="the cluster's resources for the layout")
    else:
        config.resource_plan.check_ray_cluster(device)
    return False


def initialize(config: GRPOConfig, actor_group: ActorGroup, device: str) -> None:
    spans_nodes = len({address.ip for address in actor_group.addresses}) > 1
    for address in actor_group.addresses:
        # Across nodes the node's address tells them apart (hostnames may repeat; a node lost is named by it).
        print(f"[init] {address.describe()}" + (f" on node {address.ip}" if spans_nodes else ""), flush=True)
    init_metrics = merge_metrics(actor_group.initialize())
    print(f"[init] ranks={config.num_rank_processes} device={device} {init_metrics['timing/initialize']:.1f}s",
          flush=True)


def restore(config: GRPOConfig, run: PreparedRun, actor_group: ActorGroup, run_dir: Path,
            progress: RunProgress) -> None:
    """The checkpoint the run resumes from or starts with, and the reference model's own, if any."""
    ac = config.actor_config
    if run.resume is not None:
        progress.phase = "checkpoint load"
        finetune = ac.finetune and not run.restarted
        resume_actor(actor_group, run.resume, finetune=finetune, no_load_optim=ac.no_load_optim and not run.restarted,
                     no_load_rng=ac.no_load_rng and not run.restarted)
        progress.last_checkpoint = str(run.resume.path)
        if run.resume.iteration:
            run.sampler.load_state_dict(run.resume.state["sampler"])
            truncate_metrics_after(run_dir / config.runtime.metrics_file, run.resume.iteration)
        print(f"[checkpoint] loaded {run.resume.path} ({'weights only' if finetune else 'resuming'} "
              f"after iteration {run.resume.iteration})", flush=True)
    if run.ref_checkpoint is not None:
        actor_group.call("load_reference_checkpoint", str(run.ref_checkpoint))
        print(f"[checkpoint] reference model loaded from {run.ref_checkpoint}", flush=True)


def _hang_reporter(config: GRPOConfig, progress: RunProgress):
    """What the in-process rank's watchdog does before it ends the process: the run's one failure line,
    and no half-written checkpoint left looking like one (the `finally` of _run never runs)."""
    def report(message: str) -> None:
        print(progress.worker_failure_line(message), file=sys.stderr, flush=True)
        discard_unfinished_saves(config.actor_config.save)
    return report
