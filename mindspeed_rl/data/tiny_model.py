"""A randomly initialised tiny Qwen2 checkpoint (HF format, safetensors) for the CPU demo.

Every parameter is random, including biases and norm weights: a weight-mapping bug (HF <->
Megatron <-> vLLM) cannot hide behind all-zero biases or all-one norms.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path
from typing import Optional

import torch
from tokenizers import Tokenizer

from mindspeed_rl.checkpoint.store import replace_dir
from mindspeed_rl.data.tokenizer import EOS_TOKEN_ID, save_hf_tokenizer, train_arith_tokenizer

ROPE_THETA = 1e6  # Qwen2.5's rotary base
RMS_NORM_EPS = 1e-6


def create_tiny_qwen2_checkpoint(
    out_dir: str | os.PathLike[str],
    *,
    vocab_size: int,
    hidden_size: int,
    ffn_hidden_size: int,
    num_layers: int,
    num_attention_heads: int,
    num_query_groups: int,
    max_position_embeddings: int = 256,
    seed: int,
    init_std: float = 0.05,
    tokenizer: Optional[Tokenizer] = None,
) -> Path:
    """Write config.json + model.safetensors + the tokenizer to ``out_dir`` and return it.

    ``tokenizer`` defaults to :func:`train_arith_tokenizer` ``(vocab_size, seed)``. The directory
    is built next to the target and moved into place, so a crash never leaves a half-written
    checkpoint and an existing checkpoint is replaced whole.
    """
    _check_sizes(hidden_size, num_attention_heads, num_query_groups)
    if tokenizer is None:
        tokenizer = train_arith_tokenizer(vocab_size, seed)
    if tokenizer.get_vocab_size(with_added_tokens=True) != vocab_size:
        raise ValueError(
            f"tokenizer has {tokenizer.get_vocab_size(with_added_tokens=True)} ids, "
            f"the model vocab_size is {vocab_size}"
        )
    config = _qwen2_config(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        ffn_hidden_size=ffn_hidden_size,
        num_layers=num_layers,
        num_attention_heads=num_attention_heads,
        num_query_groups=num_query_groups,
        max_position_embeddings=max_position_embeddings,
        init_std=init_std,
    )
    return save_tiny_checkpoint(_build_model(config, seed, init_std), tokenizer, out_dir)


def save_tiny_checkpoint(model: torch.nn.Module, tokenizer: Tokenizer, out_dir: str | os.PathLike[str], *,
                         extra_tensors: dict[str, torch.Tensor] | None = None,
                         config_updates: dict | None = None) -> Path:
    """Write the model and its tokenizer as an HF directory, whole or not at all (staged beside, then swapped in);
    `extra_tensors` and `config_updates` describe what the HF class does not build (DeepSeek-V3's MTP module)."""
    out_path = Path(out_dir)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{out_path.name}.tmp-", dir=out_path.parent))
    try:
        model.save_pretrained(str(staging))
        if extra_tensors or config_updates:
            _add_to_saved(staging, extra_tensors or {}, config_updates or {})
        save_hf_tokenizer(tokenizer, staging)
        replace_dir(staging, out_path)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return out_path


def _add_to_saved(directory: Path, tensors: dict[str, torch.Tensor], config_updates: dict) -> None:
    import json

    from safetensors.torch import load_file, save_file

    weights = directory / "model.safetensors"
    save_file(load_file(str(weights)) | {name: t.contiguous() for name, t in tensors.items()}, str(weights),
              metadata={"format": "pt"})
    config = json.loads((directory / "config.json").read_text())
    (directory / "config.json").write_text(json.dumps(config | config_updates, indent=2) + "\n")


def _check_sizes(hidden_size: int, num_attention_heads: int, num_query_groups: int) -> None:
    if hidden_size % num_attention_heads != 0:
        raise ValueError(
            f"hidden_size={hidden_size} is not divisible by num_attention_heads={num_attention_heads}"
        )
    if num_attention_heads % num_query_groups != 0:
        raise ValueError(
            f"num_attention_heads={num_attention_heads} is not divisible by "
            f"num_query_groups={num_query_groups}"
        )


def _qwen2_config(
    *,
    vocab_size: int,
    hidden_size: int,
    ffn_hidden_size: int,
    num_layers: int,
    num_attention_heads: int,
    num_query_groups: int,
    max_position_embeddings: int,
    init_std: float,
):  # -> transformers.Qwen2Config (imported lazily: transformers is heavy)
    from transformers import Qwen2Config

    return Qwen2Config(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=ffn_hidden_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_attention_heads,
        num_key_value_heads=num_query_groups,
        max_position_embeddings=max_position_embeddings,
        initializer_range=init_std,
        rms_norm_eps=RMS_NORM_EPS,
        # transformers 5.x keeps the rotary base in rope_parameters (no top-level rope_theta).
        rope_parameters={"rope_type": "default", "rope_theta": ROPE_THETA},
        tie_word_embeddings=False,
        use_sliding_window=False,
        dtype="float32",
        bos_token_id=EOS_TOKEN_ID,
        eos_token_id=EOS_TOKEN_ID,
        pad_token_id=EOS_TOKEN_ID,
    )


def _build_model(config, seed: int, init_std: float) -> torch.nn.Module:
    from transformers import Qwen2ForCausalLM

    model = Qwen2ForCausalLM(config).to(torch.float32)
    randomize_parameters(model, seed, init_std)
    return model


@torch.no_grad()
def randomize_parameters(model: torch.nn.Module, seed: int, init_std: float) -> None:
    """Seeded init independent of the global RNG: matrices N(0, init_std^2), biases
    0.02*N(0,1), norm weights 1 + 0.1*N(0,1). Parameters are visited in name order so the
    result depends only on ``seed`` and the architecture."""
    generator = torch.Generator().manual_seed(seed)
    for name, param in sorted(model.named_parameters(), key=lambda item: item[0]):
        noise = torch.randn(param.shape, generator=generator, dtype=torch.float32)
        if "norm" in name:
            value = 1.0 + 0.1 * noise
        elif name.endswith(".bias"):
            value = 0.02 * noise
        else:
            value = init_std * noise
        param.copy_(value)


def create_checkpoint_from_asset_params(out_dir: Path, params: dict, *, vocab_size: int,
                                        tokenizer: Tokenizer) -> Path:
    """The demos' checkpoint from their asset parameters (mindspeed_rl/data/asset_cache.py)."""
    return create_tiny_qwen2_checkpoint(
        out_dir, vocab_size=vocab_size, hidden_size=params["hidden_size"], ffn_hidden_size=params["ffn_hidden_size"],
        num_layers=params["num_layers"], num_attention_heads=params["num_attention_heads"],
        num_query_groups=params["num_query_groups"], max_position_embeddings=params["max_position_embeddings"],
        seed=params["seed"], init_std=params["init_std"], tokenizer=tokenizer)
