"""Read an HF checkpoint directory: the architecture spec and the full tensors."""
from __future__ import annotations

from pathlib import Path

import torch

from mindspeed_rl.models.qwen2 import Qwen2Spec


def read_spec(model_dir: str) -> Qwen2Spec:
    """The architecture spec from the checkpoint's config.json alone (no weights read)."""
    from transformers import AutoConfig

    return Qwen2Spec.from_hf_config(AutoConfig.from_pretrained(model_dir))


def load_hf_checkpoint(model_dir: str) -> tuple[Qwen2Spec, dict[str, torch.Tensor]]:
    from safetensors.torch import load_file

    files = sorted(Path(model_dir).glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{model_dir}: no *.safetensors files (expected an HF checkpoint directory)")
    state: dict[str, torch.Tensor] = {}
    for file in files:
        state.update(load_file(str(file)))
    return read_spec(model_dir), state
