"""The driver's side of on-policy distillation's teacher (distillation.teacher_models, config/distillation.py): its
checkpoint resolved and checked at start, before any worker starts; the demo's teacher made once.

`model_path: synthetic` (with synthetic_data.enabled) names the demo's teacher: the demo's own policy after
DEMO_TEACHER_ITERATIONS iterations of GRPO (`cli/train_grpo.py --config-name grpo_tiny_cpu`, exported as HF), a
generated asset like the demo's model and data (data/asset_cache.py): one directory per (student assets, iterations),
made once under synthetic_data.data_dir, never modified.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from dataclasses import asdict, replace
from pathlib import Path

from mindspeed_rl.config import ConfigError, GRPOConfig
from mindspeed_rl.registries import SYNTHETIC_TEACHER
from mindspeed_rl.trainer.reward_model import check_shards_like_the_actor

DEMO_TEACHER_ITERATIONS = 100
TASK = "grpo_teacher"
REQUIRED = ("config.json", "model.safetensors", "teacher_training_metrics.jsonl")
CLI_GRPO = Path(__file__).resolve().parents[2] / "cli" / "train_grpo.py"


def resolve_teacher(config: GRPOConfig, model_dir: str, tokenizer_size: int) -> str | None:
    """The teacher's HF directory (made first for `synthetic`), checked against the actor's layout and tokenizer and
    written back into the config as an absolute path, so that the ranks read the same directory. None without
    distillation."""
    if not config.distills:
        return None
    from mindspeed_rl.trainer.setup import check_hf_model_dir

    distillation = config.distillation
    name = distillation.teacher_name
    key = f"distillation.teacher_models.{name}.model_path"
    path = distillation.teacher.model_path
    if path == SYNTHETIC_TEACHER:
        path = str(ensure_demo_teacher(config, model_dir))
    check_hf_model_dir(path, key)
    check_teacher_config(config, json.loads((Path(path) / "config.json").read_text(encoding="utf-8")), key,
                         tokenizer_size)
    path = os.path.abspath(path)
    distillation.teacher_models[name] = replace(distillation.teacher, model_path=path)
    return path


def check_teacher_config(config: GRPOConfig, hf_config: dict, key: str, tokenizer_size: int) -> None:
    """A causal LM that its layout (the actor's TP/PP, or its own on devices of its own) can shard (even pipeline
    stages: the actor's num_layer_list is not its own) and that has a row for every token id of the student's
    tokenizer (it shares the student's tokenizer). Raises ConfigError naming `key`."""
    from mindspeed_rl.config.distillation import teacher_has_own_devices, teacher_layout

    architectures = hf_config.get("architectures") or []
    if not any(a.endswith("ForCausalLM") for a in architectures):
        raise ConfigError(key, f"must be a causal LM checkpoint (e.g. Qwen2ForCausalLM): the teacher scores tokens, "
                               f"its config.json lists architectures {architectures}")
    own = teacher_layout(config).train if teacher_has_own_devices(config) else None
    layout = (own.tp, own.pp, f"distillation.teacher_models.{config.distillation.teacher_name}.inference") if own \
        else None
    check_shards_like_the_actor(config, hf_config, key, what="the teacher", tokenizer_size=tokenizer_size,
                                layout=layout)


def ensure_demo_teacher(config: GRPOConfig, model_dir: str) -> Path:
    """The demo's teacher for the student at `model_dir` (a generated asset directory, so its name identifies its
    parameters): made once by a GRPO run of the demo from the same start."""
    from mindspeed_rl.data.asset_cache import ensure_generated

    synthetic = config.synthetic_data
    if synthetic is None or not synthetic.enabled:
        raise ConfigError(f"distillation.teacher_models.{config.distillation.teacher_name}.model_path",
                          f"`{SYNTHETIC_TEACHER}` is the demo's teacher, trained from the generated demo model: it "
                          "needs synthetic_data.enabled=true; give an HF causal LM directory")
    params = {"base_assets": Path(model_dir).name, "iterations": DEMO_TEACHER_ITERATIONS}
    return ensure_generated(synthetic.data_dir, TASK, params, required=REQUIRED,
                            generate=lambda staging, p: _train_demo_teacher(staging, synthetic, p["iterations"]))


def _train_demo_teacher(staging: Path, synthetic, iterations: int) -> None:
    print(f"[teacher] making the demo's teacher once: {iterations} GRPO iterations of the demo "
          f"(cli/train_grpo.py --config-name grpo_tiny_cpu)", flush=True)
    run_dir = staging / "run"
    # The student's own synthetic_data (its model and prompts): the teacher starts where the student does.
    same_assets = [f"synthetic_data.{name}={_override_value(value)}" for name, value in asdict(synthetic).items()
                   if name != "data_dir"]
    command = [sys.executable, str(CLI_GRPO), "--config-name", "grpo_tiny_cpu",
               f"megatron_training.train_iters={iterations}", "megatron_training.save_hf=true",
               f"synthetic_data.data_dir={os.path.abspath(synthetic.data_dir)}", *same_assets,
               "runtime.memory_timeline=false", f"hydra.run.dir={run_dir}"]
    finished = subprocess.run(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, check=False)
    if finished.returncode != 0:
        raise RuntimeError(f"the demo teacher's GRPO run failed (exit {finished.returncode}): "
                           f"{finished.stderr[-2000:]}")
    for entry in (run_dir / "hf_export").iterdir():
        shutil.move(str(entry), staging / entry.name)
    shutil.move(str(run_dir / "metrics.jsonl"), staging / "teacher_training_metrics.jsonl")
    shutil.rmtree(run_dir)


def _override_value(value) -> str:
    return json.dumps(value) if value is None or isinstance(value, (bool, list, dict)) else str(value)
