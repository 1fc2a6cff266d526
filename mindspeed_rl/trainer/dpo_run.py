"""A whole DPO run (cli/train_dpo.py): prepare it (every check, the pairs; no worker), start the ranks (training
engine and reference, no inference engine), restore a checkpoint, train (trainer/dpo_trainer.py), and end every
process whatever happened. The GRPO run's steps (trainer/run.py) wherever they apply."""
from __future__ import annotations

import contextlib
import os
from pathlib import Path

from mindspeed_rl import interrupts
from mindspeed_rl.checkpoint.store import discard_unfinished_saves, is_checkpoint_dir
from mindspeed_rl.checkpoint.trainer_state import check_optimizer_split, find_resume_point, verify_same_model
from mindspeed_rl.config import ConfigError, GRPOConfig
from mindspeed_rl.data.preference import PreferenceDataset, ensure_arith_pairs, load_preference_dataset
from mindspeed_rl.trainer import setup
from mindspeed_rl.trainer.dpo_trainer import make_pair_sampler, train_dpo
from mindspeed_rl.trainer.prepared_run import PreparedRun
from mindspeed_rl.trainer.run import stopped_on_failure
from mindspeed_rl.trainer.stopping import RunProgress

REF_MODEL_KEY = "megatron_training.ref_model"


def run_dpo(config: GRPOConfig, *, run_dir: Path) -> list[dict]:
    """The whole run; ends with this run's records, or raises RunStopped (interrupted, a worker failed) after every
    worker is gone; ConfigError for bad input, before any worker starts."""
    progress = RunProgress(save_root=config.actor_config.save)
    with stopped_on_failure(progress), contextlib.ExitStack() as held:  # the run and save directories, to the end
        run = prepare_dpo_run(config, run_dir, held)
        progress.first_iteration = run.resume.iteration + 1 if run.resume else 1
        return _start_and_train(config, run, run_dir, progress)


def _start_and_train(config: GRPOConfig, run: PreparedRun, run_dir: Path, progress: RunProgress) -> list[dict]:
    import ray

    from mindspeed_rl.trainer.run import _hang_reporter, initialize, restore, start_hosts
    from mindspeed_rl.workers.start import start_actor_group

    actor_group, completed = None, False
    try:
        in_process = start_hosts(config, run.device, progress)
        progress.phase = "initialize"
        print(f"[init] starting {config.num_rank_processes} rank(s) on {run.device}: checkpoint load, Megatron build "
              "(policy and reference; DPO generates nothing: no vLLM)", flush=True)
        actor_group = start_actor_group(config, device=run.device, model_dir=run.model_dir, ref_model_dir=run.ref_dir,
                                        threads=setup.threads_per_rank(config), in_process=in_process,
                                        on_hang=_hang_reporter(config, progress))
        initialize(config, actor_group, run.device)
        restore(config, run, actor_group, run_dir, progress)
        history = train_dpo(config, actor_group, run, run_dir, progress=progress)
        completed = True
        return history
    finally:
        with interrupts.deferred():  # a second Ctrl-C must not leave the workers running
            if actor_group is not None:
                actor_group.shutdown() if completed else actor_group.kill()
            if not completed:
                discard_unfinished_saves(config.actor_config.save)
            ray.shutdown()


def prepare_dpo_run(config: GRPOConfig, run_dir: Path, held: contextlib.ExitStack) -> PreparedRun:
    """Every check that can fail on user input, cheapest first, and the pairs loaded."""
    from transformers import AutoTokenizer

    from mindspeed_rl.accelerator import detect_device
    from mindspeed_rl.workers.stage_probe import write_configurations

    ac = config.actor_config
    setup.check_host(config, run_dir)
    setup.hold_run_directories(config, run_dir, held)
    model_dir, _, data_path = setup.resolve_assets(config)  # synthetic: the demo's model (its prompts unused)
    data_path, eval_path = pair_paths(config, data_path)
    hf_config = setup.read_hf_config(model_dir)
    setup.check_against_checkpoint(config, hf_config, model_dir)
    tokenizer = AutoTokenizer.from_pretrained(model_dir, trust_remote_code=config.generate_config.trust_remote_code)
    setup.check_tokenizer_fits_model(tokenizer, hf_config, model_dir)
    resume = find_resume_point(ac.load, finetune=ac.finetune, hf_config=hf_config,
                               resume_from_last_intact=config.runtime.resume_from_last_intact)
    if resume is not None:
        check_optimizer_split(resume, finetune=ac.finetune, no_load_optim=ac.no_load_optim,
                              is_moe=bool(hf_config.get("num_experts") or hf_config.get("n_routed_experts")),
                              expert_parallel_size=ac.expert_model_parallel_size)
    ref_dir, ref_checkpoint = reference_weights(config, model_dir, hf_config)
    setup.check_run_dir_metrics(run_dir / config.runtime.metrics_file,
                                resume_iteration=resume.iteration if resume else 0)
    dataset = load_pairs(config, data_path, tokenizer)
    eval_dataset = load_pairs(config, eval_path, tokenizer) if eval_path else None
    sampler = make_pair_sampler(config, dataset)  # a dataset smaller than a batch fails here
    print(f"[data] {len(dataset.pairs)} preference pairs from {dataset.source} ({dataset.num_filtered} too long "
          f"dropped)" + (f"; {len(eval_dataset.pairs)} held-out pairs from {eval_dataset.source}" if eval_dataset
                         else ""), flush=True)
    device = detect_device() if config.runtime.device == "auto" else config.runtime.device
    setup.check_host_capacity(config, device, os.cpu_count() or 1)
    write_configurations(config)  # msprobe_config.configurations_dump
    return PreparedRun(model_dir=model_dir, ref_dir=ref_dir, tokenizer=tokenizer, dataset=dataset,
                       eval_dataset=eval_dataset, sampler=sampler, resume=resume, ref_checkpoint=ref_checkpoint,
                       device=device, prediction=None)


def pair_paths(config: GRPOConfig, data_path: str) -> tuple[str, str | None]:
    """(training pairs, held-out pairs or None): the files the config names, or the generated demo's pairs."""
    synthetic, mt = config.synthetic_data, config.megatron_training
    if synthetic is not None and synthetic.enabled:
        train, held_out = ensure_arith_pairs(synthetic.data_dir, max_operand=synthetic.max_operand, seed=synthetic.seed)
        return str(train), str(held_out)
    return data_path, setup.resolve_eval_data_path(config)


def load_pairs(config: GRPOConfig, path: str, tokenizer) -> PreferenceDataset:
    """Pairs whose prompt fits rl_config.max_prompt_length plus the responses' limit."""
    mt = config.megatron_training
    return load_preference_dataset(path, tokenizer=tokenizer, prompt_type=mt.prompt_type, map_keys=dict(mt.map_keys),
                                   max_length=config.rl_config.max_prompt_length + config.response_length_limit)


def reference_weights(config: GRPOConfig, model_dir: str, hf_config: dict) -> tuple[str, Path | None]:
    """(the HF dir the reference is built from, one of our checkpoints loaded over it or None): ref_model's; without
    one the policy's starting weights (actor_config.load's when it fine-tunes one of our checkpoints)."""
    mt, ac = config.megatron_training, config.actor_config
    finetuned = ac.load if ac.load and ac.finetune and is_checkpoint_dir(ac.load) else None
    source = mt.ref_model or finetuned
    if source is None:
        return model_dir, None
    if not Path(source).exists():
        raise ConfigError(REF_MODEL_KEY, f"{source} does not exist")
    if is_checkpoint_dir(source):
        checkpoint = reference_iteration(Path(source), mt.refer_model_iter) if source == mt.ref_model else source
        return model_dir, verify_same_model(str(checkpoint), hf_config, key=REF_MODEL_KEY)
    setup.check_hf_model_dir(source, REF_MODEL_KEY)
    return source, None


def reference_iteration(checkpoint: Path, iteration: int) -> Path:
    """ref_model as a save root: its checkpoint of iteration refer_model_iter (MindSpeed-LLM's meaning, which tells a
    resumed DPO run's reference from its policy's newer saves); a checkpoint's own directory as it is."""
    if not (checkpoint / "latest").exists():
        return checkpoint
    chosen = checkpoint / f"iter_{iteration:07d}"
    if not chosen.is_dir():
        there = sorted(path.name for path in checkpoint.glob("iter_*"))
        raise ConfigError("megatron_training.refer_model_iter", f"is {iteration}, but {checkpoint} has no "
                                                                f"{chosen.name} (it has {', '.join(there) or 'none'})")
    return chosen
