"""Everything the GRPO loop needs before its first iteration: assets, data, Ray, workers."""
from __future__ import annotations

import os
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

from mindspeed_rl.config import ConfigError, GRPOConfig


@dataclass(frozen=True, kw_only=True)
class Prompt:
    token_ids: list[int]
    answer: str


def resolve_assets(config: GRPOConfig) -> tuple[str, str, str]:
    """(model_dir, ref_model_dir, prompts_path); generates the demo's assets on first use."""
    mt = config.megatron_training
    model_dir, prompts_path = mt.tokenizer_name_or_path, mt.data_path
    synthetic = config.synthetic_data
    if synthetic is not None and synthetic.enabled:
        from mindspeed_rl.data.arith_task import ensure_demo_assets

        made_model, made_prompts = ensure_demo_assets(
            synthetic.data_dir, vocab_size=synthetic.vocab_size, hidden_size=synthetic.hidden_size,
            ffn_hidden_size=synthetic.ffn_hidden_size, num_layers=synthetic.num_layers,
            num_attention_heads=synthetic.num_attention_heads, num_query_groups=synthetic.num_query_groups,
            num_prompts=synthetic.num_prompts, max_operand=synthetic.max_operand, seed=synthetic.seed,
        )
        model_dir, prompts_path = str(made_model), str(made_prompts)
    model_dir = config.actor_config.load or model_dir
    for key, path in (("megatron_training.tokenizer_name_or_path", model_dir), ("megatron_training.data_path", prompts_path)):
        if not Path(path).exists():
            raise ConfigError(key, f"{path} does not exist")
    ref_dir = config.rl_config.integrated_mode_config.ref_model_load_path or model_dir
    if not Path(ref_dir).exists():
        raise ConfigError("rl_config.integrated_mode_config.ref_model_load_path", f"{ref_dir} does not exist")
    return os.path.abspath(model_dir), os.path.abspath(ref_dir), os.path.abspath(prompts_path)


def read_prompt_rows(prompts_path: str) -> list[dict]:
    """The data file's rows, validated before anything heavy is loaded."""
    from mindspeed_rl.data.arith_task import read_prompts_jsonl

    try:
        return read_prompts_jsonl(prompts_path)
    except ValueError as error:  # names the file and line
        raise ConfigError("megatron_training.data_path", str(error)) from None


def tokenize_prompts(rows: list[dict], tokenizer, max_prompt_length: int, prompts_path: str) -> list[Prompt]:
    prompts = []
    for row in rows:
        ids = tokenizer.encode(row["prompt"], add_special_tokens=False)
        if len(ids) <= max_prompt_length:  # MindSpeed-RL drops over-long prompts the same way
            prompts.append(Prompt(token_ids=ids, answer=str(row["answer"])))
    if not prompts:
        raise ConfigError("rl_config.max_prompt_length", f"no prompt of {prompts_path} fits in {max_prompt_length} tokens")
    return prompts


def prompt_batches(prompts: list[Prompt], batch_size: int, *, seed: int, shuffle: bool) -> Iterator[list[Prompt]]:
    """Endless epochs of `batch_size` prompts; reshuffled every epoch unless `no_shuffle`."""
    rng = random.Random(seed)
    while True:
        order = list(range(len(prompts)))
        if shuffle:
            rng.shuffle(order)
        for start in range(0, len(order) - batch_size + 1, batch_size):
            yield [prompts[i] for i in order[start:start + batch_size]]


def start_ray(config: GRPOConfig, device: str, threads_per_rank: int, *, attempts: int = 2) -> None:
    import ray

    if ray.is_initialized():
        return
    # The raylet waits for its Python agents; on a small, busy host they can take longer to start
    # than Ray's default allows, which fails the whole start ("node timed out during startup").
    os.environ.setdefault("RAY_agent_register_timeout_ms", "120000")
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    for attempt in range(1, attempts + 1):
        try:
            # Logical CPUs: one per rank at least, whatever the host has (ranks are mostly idle
            # while another role runs; threads are capped separately).
            ray.init(num_cpus=max(config.world_size, os.cpu_count() or 1), include_dashboard=False,
                     log_to_driver=True, configure_logging=False,
                     runtime_env={"env_vars": {"PYTHONWARNINGS": "ignore"}})
            return
        except Exception as error:  # Ray raises a bare Exception for a failed node start
            ray.shutdown()
            if attempt == attempts:
                raise
            print(f"[ray] start failed ({error}); retrying", flush=True)


def threads_per_rank(config: GRPOConfig) -> int:
    if config.runtime.num_threads_per_rank > 0:
        return config.runtime.num_threads_per_rank
    return max(1, (os.cpu_count() or 1) // config.world_size)
