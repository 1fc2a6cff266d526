"""Read an HF checkpoint directory: the architecture spec and the full tensors."""
from __future__ import annotations

import re
from pathlib import Path

import torch

from mindspeed_rl.models.qwen2 import Qwen2Spec

_LAYER_INDEX = re.compile(r"model\.layers\.(\d+)\.")


def read_spec(model_dir: str) -> Qwen2Spec:
    """The architecture spec from the checkpoint's config.json alone (no weights read)."""
    from transformers import AutoConfig

    return Qwen2Spec.from_hf_config(AutoConfig.from_pretrained(model_dir))


def load_hf_checkpoint(model_dir: str) -> tuple[Qwen2Spec, dict[str, torch.Tensor]]:
    """The spec and every tensor of the model it describes. DeepSeek-V3's multi-token-prediction module (layers
    from num_hidden_layers on, `num_nextn_predict_layers`) is not read: RL trains and pushes the main model only, as
    MindSpeed-RL does (its Megatron actor builds no MTP module), and vLLM generates without it."""
    from safetensors import safe_open

    files = sorted(Path(model_dir).glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{model_dir}: no *.safetensors files (expected an HF checkpoint directory)")
    spec = read_spec(model_dir)
    state: dict[str, torch.Tensor] = {}
    for file in files:
        with safe_open(str(file), framework="pt") as tensors:
            for name in tensors.keys():
                if not is_mtp_tensor(name, spec.num_layers):
                    state[name] = tensors.get_tensor(name)
    return spec, state


def is_mtp_tensor(name: str, num_layers: int) -> bool:
    """A tensor of a layer past the model's `num_layers`: DeepSeek-V3's MTP module (`model.layers.61.*` of V3)."""
    layer = hf_layer_index(name)
    return layer is not None and layer >= num_layers


def hf_layer_index(name: str) -> int | None:
    """`model.layers.<i>.…` -> i; None for a tensor outside the decoder layers."""
    match = _LAYER_INDEX.match(name)
    return int(match.group(1)) if match else None
