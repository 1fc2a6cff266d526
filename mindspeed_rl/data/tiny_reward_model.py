"""A seeded tiny reward model for the CPU demos and tests: HF `Qwen2ForSequenceClassification` (num_labels=1)
with the architecture and tokenizer of the demo's actor checkpoint, every parameter random (seeded).

`rewards.<name>.model_path: synthetic` (with `synthetic_data.enabled`) names it. It is a generated asset like
the demo's model and data (`data/asset_cache.py`): one content-addressed directory per (actor assets, seed),
made once under `synthetic_data.data_dir`, never modified.
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch

from mindspeed_rl.data.asset_cache import ensure_generated
from mindspeed_rl.data.tiny_model import randomize_parameters

from mindspeed_rl.registries import SYNTHETIC_REWARD_MODEL as SYNTHETIC  # the model_path that asks for it
TASK = "reward_model"
REQUIRED = ("config.json", "model.safetensors")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")


def create_tiny_reward_checkpoint(out_dir: str | Path, *, base_model_dir: str | Path, seed: int,
                                  init_std: float = 0.05) -> Path:
    """Write a Qwen2ForSequenceClassification checkpoint with `base_model_dir`'s config (num_labels=1) and its
    tokenizer files to `out_dir`."""
    from transformers import Qwen2Config, Qwen2ForSequenceClassification

    base = Path(base_model_dir)
    config = Qwen2Config.from_dict(json.loads((base / "config.json").read_text(encoding="utf-8")))
    config.num_labels = 1
    config.architectures = ["Qwen2ForSequenceClassification"]
    model = Qwen2ForSequenceClassification(config).to(torch.float32)
    randomize_parameters(model, seed, init_std)
    out = Path(out_dir)
    model.save_pretrained(str(out))
    for name in TOKENIZER_FILES:  # the actor's tokenizer: the reward model reads the actor's token ids
        if (base / name).is_file():
            shutil.copy2(base / name, out / name)
    return out


def ensure_tiny_reward_model(data_dir: str | Path, *, base_model_dir: str | Path, seed: int) -> Path:
    """The generated reward model of the demo actor at `base_model_dir` (itself a generated asset directory, so
    its name identifies its parameters), made once under `data_dir`."""
    params = {"base_assets": Path(base_model_dir).name, "seed": seed}
    return ensure_generated(data_dir, TASK, params, required=REQUIRED,
                            generate=lambda staging, p: create_tiny_reward_checkpoint(
                                staging, base_model_dir=base_model_dir, seed=p["seed"]))
