"""LoRA in checkpoints and exports: the adapter's settings in trainer_state.json ("lora"), the model of a LoRA
checkpoint on one rank, and the PEFT adapter directory (`cli/export_hf.py --peft`).

A LoRA checkpoint's model/ holds the backbone and the adapters, or with `lora_filter` the adapters only; then the
backbone is the run's HF checkpoint, whose path the record keeps (`backbone`; `--base` overrides it). The PEFT
directory is what `peft.PeftModel.from_pretrained(hf_base, DIR)` loads: adapter_config.json and
adapter_model.safetensors with PEFT's per-module tensors (models/lora_peft.py), written atomically.
"""
from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path

import torch

from mindspeed_rl.checkpoint.store import fsync_path
from mindspeed_rl.errors import ConfigError

LORA_STATE_KEY = "lora"
ADAPTER_CONFIG_NAME, ADAPTER_WEIGHTS_NAME = "adapter_config.json", "adapter_model.safetensors"


def lora_record(config, backbone_dir: str) -> dict:
    """What a checkpoint keeps of the run's LoRA, under LORA_STATE_KEY in trainer_state.json (nothing without one)."""
    actor = config.actor_config
    if not actor.uses_lora:
        return {}
    return {LORA_STATE_KEY: {"rank": actor.lora_r, "alpha": actor.lora_alpha,
                             "target_modules": list(actor.lora_target_modules), "filter": actor.lora_filter,
                             "seed": config.megatron_training.seed, "backbone": os.path.abspath(backbone_dir)}}


def load_lora_model(model, spec, model_dir: Path, record: dict, *, parallel, base: str | None, key: str):
    """`model` (a TP1 PP1 GPTModel, at `parallel`: the caller's groups) with the checkpoint's adapters: the backbone
    from the checkpoint, or with `filter` from the HF directory `base` (default: the record's `backbone`)."""
    from megatron.core import dist_checkpointing

    from mindspeed_rl.engines.dist_checkpoint import model_sharded_state_dict
    from mindspeed_rl.engines.megatron_engine import load_hf_into_megatron
    from mindspeed_rl.models.checkpoint import load_hf_checkpoint
    from mindspeed_rl.models.lora import LoRASettings, add_lora, is_lora_param

    if record["filter"]:
        backbone = base or record["backbone"]
        if not (Path(backbone) / "config.json").is_file():
            raise ConfigError("--base", f"the checkpoint holds the LoRA adapters only (lora_filter); their backbone "
                                        f"{backbone} is not an HF model directory: give it with --base")
        load_hf_into_megatron(model, load_hf_checkpoint(backbone)[1], spec, parallel=parallel)
    add_lora(model, LoRASettings(rank=record["rank"], alpha=record["alpha"],
                                 target_modules=tuple(record["target_modules"]), seed=record["seed"]),
             parallel=parallel)
    wanted = model_sharded_state_dict(model)
    if record["filter"]:
        wanted = {name: value for name, value in wanted.items() if is_lora_param(name)}
    try:
        state = dist_checkpointing.load(wanted, str(model_dir), strict="raise_all")
    except Exception as error:  # Megatron raises several types for a foreign/corrupt checkpoint
        raise ConfigError(key, f"{model_dir} does not load as this LoRA model: {str(error).splitlines()[0]}") from None
    model.load_state_dict(state, strict=False)
    return model


def write_peft_adapter(model, spec, record: dict | None, output_dir: str | os.PathLike, *, base: str | None,
                       dtype: torch.dtype | None = None) -> Path:
    """The adapters of `model` (TP1 PP1) as a PEFT adapter directory at `output_dir` (new or empty), atomically;
    `record` is the checkpoint's LoRA record (None: it has no adapters, refused)."""
    if record is None:
        raise ConfigError("--peft", "the checkpoint has no LoRA adapters (actor_config.lora_target_modules): "
                                    "export the whole model without --peft")
    from peft import LoraConfig
    from safetensors.torch import save_file

    from mindspeed_rl.models.lora_peft import peft_lora_tensors, peft_target_modules

    out = Path(output_dir)
    adapters = {name: p.detach() for name, p in model.named_parameters() if name.endswith(("lora_A", "lora_B"))}
    tensors = {name: t.to(dtype or t.dtype).contiguous().cpu() for name, t in peft_lora_tensors([adapters], spec).items()}
    config = LoraConfig(r=record["rank"], lora_alpha=record["alpha"], lora_dropout=0.0, bias="none",
                        target_modules=sorted(peft_target_modules(record["target_modules"])),
                        base_model_name_or_path=base or record["backbone"], task_type="CAUSAL_LM")
    out.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
    try:
        save_file(tensors, str(staging / ADAPTER_WEIGHTS_NAME), metadata={"format": "pt"})
        (staging / ADAPTER_CONFIG_NAME).write_text(json.dumps(config.to_dict(), indent=2, default=list) + "\n")
        for path in staging.iterdir():
            fsync_path(path)
        fsync_path(staging)
        if out.exists():
            out.rmdir()  # empty (checked by the caller); rename needs the name free
        os.rename(staging, out)
        fsync_path(out.parent)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return out
