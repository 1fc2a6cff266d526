"""The GRPO loop: generate -> reward -> reference and old log-probs -> advantages -> update."""
from __future__ import annotations

import json
import os
import time
from pathlib import Path

import torch

from mindspeed_rl.algorithms.grpo import group_normalized_advantages
from mindspeed_rl.config import GRPOConfig
from mindspeed_rl.data.rewards import accuracy, compute_rule_rewards
from mindspeed_rl.protocol import RolloutBatch
from mindspeed_rl.trainer import setup
from mindspeed_rl.workers.group import RayActorGroup, default_env_vars, merge_metrics, merge_shards


def run_grpo(config: GRPOConfig, *, run_dir: Path) -> list[dict]:
    from transformers import AutoTokenizer

    from mindspeed_rl.accelerator import detect_device

    model_dir, ref_dir, prompts_path = setup.resolve_assets(config)
    rows = setup.read_prompt_rows(prompts_path)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    prompts = setup.tokenize_prompts(rows, tokenizer, config.rl_config.max_prompt_length, prompts_path)
    device = detect_device() if config.runtime.device == "auto" else config.runtime.device
    threads = setup.threads_per_rank(config)
    setup.start_ray(config, device, threads)
    actor = RayActorGroup(config=config, device=device, env_vars=default_env_vars(threads),
                          model_dir=model_dir, ref_model_dir=ref_dir)
    try:
        init_metrics = merge_metrics(actor.call("initialize"))
        print(f"[init] ranks={config.world_size} device={device} {init_metrics['timing/initialize']:.1f}s", flush=True)
        return train(config, actor, tokenizer, prompts, run_dir)
    finally:
        actor.shutdown()


def train(config: GRPOConfig, actor: RayActorGroup, tokenizer, prompts, run_dir: Path) -> list[dict]:
    mt, rl = config.megatron_training, config.rl_config
    batches = setup.prompt_batches(prompts, mt.global_batch_size, seed=mt.seed, shuffle=not mt.no_shuffle)
    metrics_path = run_dir / config.runtime.metrics_file
    history = []
    for iteration in range(1, mt.train_iters + 1):
        started = time.perf_counter()
        prompt_batch = next(batches)
        batch, metrics = generate(actor, prompt_batch, config)
        responses = [tokenizer.decode(ids, skip_special_tokens=True) for ids in _response_ids(batch)]
        answers = [p.answer for p in prompt_batch for _ in range(rl.n_samples_per_prompt)]
        rewards = compute_rule_rewards(responses, answers, rl.verifier_function, rl.verifier_weight)
        batch.columns["advantages"] = group_normalized_advantages(rewards, rl.n_samples_per_prompt)
        batch.columns["ref_logprobs"], ref_metrics = forward_logprobs(actor, "compute_ref_log_prob", batch)
        # ROLL's manual control: the update right after needs the train params again, so they stay.
        batch.meta_info["is_offload_states"] = False
        batch.columns["old_logprobs"], old_metrics = forward_logprobs(actor, "compute_log_prob", batch)
        batch.meta_info.pop("is_offload_states")
        update_metrics = merge_metrics(actor.call("update", batch, kl_coef=rl.init_kl_coef))
        metrics.update(ref_metrics | old_metrics | update_metrics)
        metrics.update({
            "iteration": iteration,
            "reward/mean": rewards.mean().item(),
            "reward/accuracy": accuracy(responses, answers),
            "response_length/mean": batch.response_mask.sum(1).mean().item(),
            "rollout/logprob_max_abs_diff": _rollout_mismatch(batch),
            "timing/iteration": time.perf_counter() - started,
        })
        history.append(metrics)
        _append_jsonl(metrics_path, metrics)
        if iteration % config.runtime.log_interval == 0:
            print(format_line(metrics), flush=True)
    if config.runtime.memory_timeline and history:
        _plot_memory_timeline(history, run_dir, config.world_size)
    return history


def _plot_memory_timeline(history: list[dict], run_dir: Path, world_size: int) -> None:
    from mindspeed_rl.memory.timeline import plot_memory_timeline

    path = run_dir / "memory_timeline.png"
    plot_memory_timeline(history, path, last_iterations=3,
                         title=f"Device memory per phase (memory ledger; per rank, the largest of {world_size})")
    print(f"[memory] timeline of the last iterations: {path}", flush=True)


def generate(actor: RayActorGroup, prompt_batch, config: GRPOConfig) -> tuple[RolloutBatch, dict]:
    prompt_ids = [p.token_ids for p in prompt_batch]
    results = actor.call("generate_sequences", prompt_ids)
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


def _rollout_mismatch(batch: RolloutBatch) -> float:
    """max |vLLM log-prob - Megatron log-prob| over sampled tokens: the weight push made them equal."""
    diff = (batch.columns["rollout_logprobs"] - batch.columns["old_logprobs"]).abs() * batch.response_mask
    return diff.max().item()


def _append_jsonl(path: Path, record: dict) -> None:
    # One complete line per write + flush + fsync: a crash leaves whole records only.
    with open(path, "a", encoding="utf-8") as f:
        f.write(json.dumps(record) + "\n")
        f.flush()
        os.fsync(f.fileno())


def format_line(m: dict) -> str:
    phases = ("rollout", "resharding_enter_infer")
    seconds = " ".join(f"{p}={m.get('timing/' + p, 0.0):.2f}s" for p in phases)
    # ROLL's automatic mode moves states around every call; its cost summed over the phases.
    for stage in ("onload", "offload"):
        spent = sum(m.get(f"timing/{p}/{stage}", 0.0) for p in ("generate", "ref_logprob", "old_logprob", "update"))
        seconds += f" {stage}={spent:.2f}s"
    memory = " ".join(f"{p}={m.get(f'memory/{p}/total_bytes', 0) / 2**20:.0f}MiB"
                      for p in ("generate", "ref_logprob", "old_logprob", "update"))
    return (f"[iter {m['iteration']:>4}] reward={m['reward/mean']:.3f} acc={m['reward/accuracy']:.3f} "
            f"kl={m.get('actor/kl_loss', 0.0):.4f} lp_diff={m['rollout/logprob_max_abs_diff']:.1e} "
            f"total={m['timing/iteration']:.2f}s {seconds} | device {memory}")
