"""Everything the GRPO loop needs before its first iteration: assets, checks, data, Ray.

Every check that can fail on user input runs here, before any worker starts, and raises a
ConfigError naming the key or file (the CLI prints one line and exits 2).
"""
from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path

from mindspeed_rl.checkpoint.store import is_checkpoint_dir
from mindspeed_rl.config import ConfigError, GRPOConfig

MODEL_DIR_KEY = "megatron_training.tokenizer_name_or_path"
DATA_PATH_KEY = "megatron_training.data_path"


def resolve_assets(config: GRPOConfig) -> tuple[str, str, str]:
    """(model_dir, ref_model_dir, data_path); generates the demo's assets on first use."""
    mt = config.megatron_training
    model_dir, data_path = mt.tokenizer_name_or_path, mt.data_path
    synthetic = config.synthetic_data
    if synthetic is not None and synthetic.enabled:
        made_model, made_data = _generate_synthetic_assets(synthetic)
        model_dir, data_path = str(made_model), str(made_data)
    # actor_config.load as one of our checkpoints: the engines are built from the initial HF weights and
    # the checkpoint is loaded over them (grpo_trainer); as an HF dir it is the initial weights.
    hf_load = config.actor_config.load if config.actor_config.load and not is_checkpoint_dir(config.actor_config.load) else None
    model_key = "actor_config.load" if hf_load else MODEL_DIR_KEY
    model_dir = hf_load or model_dir
    for key, path in ((model_key, model_dir), (DATA_PATH_KEY, data_path)):
        if not Path(path).exists():
            raise ConfigError(key, f"{path} does not exist")
    if not (Path(model_dir) / "config.json").is_file():
        raise ConfigError(model_key, f"{model_dir} is not an HF model directory (no config.json)")
    ref_dir = config.rl_config.integrated_mode_config.ref_model_load_path or model_dir
    if is_checkpoint_dir(ref_dir):
        raise ConfigError("rl_config.integrated_mode_config.ref_model_load_path",
                          f"{ref_dir} is a mindspeed_rl checkpoint; give an HF directory (export it with "
                          "cli/export_hf.py) - loading the reference from a checkpoint is not implemented yet")
    if not Path(ref_dir).exists():
        raise ConfigError("rl_config.integrated_mode_config.ref_model_load_path", f"{ref_dir} does not exist")
    return os.path.abspath(model_dir), os.path.abspath(ref_dir), os.path.abspath(data_path)


def _generate_synthetic_assets(synthetic) -> tuple[Path, Path]:
    sizes = dict(hidden_size=synthetic.hidden_size, ffn_hidden_size=synthetic.ffn_hidden_size,
                 num_layers=synthetic.num_layers, num_attention_heads=synthetic.num_attention_heads,
                 num_query_groups=synthetic.num_query_groups, num_prompts=synthetic.num_prompts,
                 max_operand=synthetic.max_operand, seed=synthetic.seed)
    if synthetic.task == "math_word":
        from mindspeed_rl.data.tiny_math import ensure_tiny_math_assets

        return ensure_tiny_math_assets(synthetic.data_dir, **sizes)
    from mindspeed_rl.data.arith_task import ensure_demo_assets

    return ensure_demo_assets(synthetic.data_dir, vocab_size=synthetic.vocab_size, **sizes)


def read_hf_config(model_dir: str) -> dict:
    path = Path(model_dir) / "config.json"
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as error:
        raise ConfigError(MODEL_DIR_KEY, f"{path}: not a readable JSON config ({error})") from None


def check_against_checkpoint(config: GRPOConfig, hf_config: dict, model_dir: str) -> None:
    """The checkpoint's config.json is what the engines build. A model block that describes another
    model is reported in one line; the parallel layout is then re-checked against the checkpoint's
    real architecture, so a layout that cannot shard it fails here and not inside a worker."""
    from mindspeed_rl.config.model_arch import ModelArchConfig
    from mindspeed_rl.config.model_check import check_model_block_against_hf

    name = config.actor_config.model
    arch = config.selected_model
    if arch is not None:
        try:
            check_model_block_against_hf(arch, f"model.{name}", hf_config)
        except ConfigError as mismatch:
            print(f"[model] warning: {mismatch} (from {model_dir}/config.json); the checkpoint's architecture "
                  "is built and the parallel layout is checked against it", flush=True)
    checkpoint_arch = ModelArchConfig(
        num_layers=hf_config["num_hidden_layers"], hidden_size=hf_config["hidden_size"],
        ffn_hidden_size=hf_config["intermediate_size"], num_attention_heads=hf_config["num_attention_heads"],
        group_query_attention=True,
        num_query_groups=hf_config.get("num_key_value_heads", hf_config["num_attention_heads"]),
        kv_channels=hf_config.get("head_dim"), num_experts=hf_config.get("num_experts") or None,
        max_position_embeddings=hf_config.get("max_position_embeddings"),
    )
    # replace() runs GRPOConfig.__post_init__ again: every layout check, now on the checkpoint's numbers.
    dataclasses.replace(config, model={**config.model, name: checkpoint_arch}, synthetic_data=None)


def check_tokenizer_fits_model(tokenizer, hf_config: dict, model_dir: str) -> None:
    vocab_size = hf_config.get("vocab_size")
    if vocab_size is not None and len(tokenizer) > vocab_size:
        raise ConfigError(MODEL_DIR_KEY, f"the tokenizer in {model_dir} has {len(tokenizer)} tokens but the model's "
                                         f"vocab_size is {vocab_size}: token ids past it have no embedding row")


def check_host_capacity(config: GRPOConfig, device: str, cpu_count: int) -> None:
    """On CPU every rank is a process; beyond a few per core the run makes no progress, so say so
    at start instead of letting Ray queue the ranks or the host swap."""
    if device != "cpu":
        return
    limit = config.runtime.max_ranks_per_cpu_core * cpu_count
    if config.world_size > limit:
        raise ConfigError(
            "rl_config.actor_resource.num_npus",
            f"{config.world_size} ranks on runtime.device=cpu, but this host has {cpu_count} CPU cores and "
            f"runtime.max_ranks_per_cpu_core={config.runtime.max_ranks_per_cpu_core} allows {limit}: lower "
            "num_npus (and the parallel sizes with it) or run on the accelerators the config was written for",
        )


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


def check_run_dir_metrics(metrics_path: Path, *, resume_iteration: int) -> None:
    """A run directory whose metrics.jsonl already has records: resume (records after the checkpoint's
    iteration are dropped then) or refuse; never append duplicate iteration numbers."""
    if resume_iteration == 0 and metrics_path.is_file() and metrics_path.stat().st_size > 0:
        raise ConfigError("hydra.run.dir", f"{metrics_path} already has records; resume with "
                                           "actor_config.load=<save dir> actor_config.finetune=false, "
                                           "or choose another run directory")
