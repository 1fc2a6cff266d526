"""Export a trained actor as an HF checkpoint directory (safetensors shards, config, tokenizer, generation config).

The Megatron -> HF conversion is the one the resharding uses (`resharding.naive.gather_full_hf`, built on
`models.layouts.hf_from_megatron_shards`), so an export and a weight push to vLLM can never disagree on layout.
The directory appears whole or not at all: it is written into a temporary sibling, every file fsynced, then
renamed into place.
"""
from __future__ import annotations

import json
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch

from mindspeed_rl.errors import ConfigError
from mindspeed_rl.checkpoint.lora_export import LORA_STATE_KEY, load_lora_model
from mindspeed_rl.checkpoint.store import TRAINER_STATE_NAME, disk_error_named, fsync_path, replace_dir
from mindspeed_rl.models.qwen2 import Qwen2Spec
from mindspeed_rl.parallel.megatron_state import RankGroups

# Files copied next to the weights when the source directory has them (tokenizer + generation defaults).
_SIDE_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.json", "merges.txt",
               "added_tokens.json", "chat_template.jinja", "generation_config.json")
_DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
           "float16": torch.float16, "fp16": torch.float16}
WEIGHTS_NAME = "model.safetensors"
INDEX_NAME = "model.safetensors.index.json"
# megatron_training.save_hf's output, in the Hydra run directory.
RUN_EXPORT_DIR = "hf_export"


def parse_dtype(name: str, *, key: str = "--dtype") -> torch.dtype:
    if name not in _DTYPES:
        raise ConfigError(key, f"unknown dtype {name!r}, expected one of {sorted(_DTYPES)}")
    return _DTYPES[name]

# trainer_state.json key -> how a feature's checkpoint loads into a TP1 PP1 model (LoRA: its adapters, and the
# backbone from the checkpoint or its base).
FEATURE_LOADERS = {LORA_STATE_KEY: load_lora_model}

@dataclass(frozen=True, kw_only=True)
class ExportOptions:
    """`dtype`: None means the training dtype (the embedding's).
    `max_shard_bytes`: a safetensors file holds at most this many bytes of tensors
    (a single larger tensor gets a file of its own, as in transformers)."""
    dtype: torch.dtype | None = None
    max_shard_bytes: int = 5 * 1024**3

    def __post_init__(self) -> None:
        if self.max_shard_bytes <= 0:
            raise ConfigError("max_shard_bytes", f"must be > 0 bytes, got {self.max_shard_bytes}")


def hf_weights_from_megatron(named_weights: dict[str, torch.Tensor], spec: Qwen2Spec, *,
                             parallel: RankGroups) -> dict[str, torch.Tensor]:
    """Full HF-named tensors from this rank's Megatron shards, at its place `parallel` in the training layout
    (collective over TP/PP when those are > 1)."""
    from mindspeed_rl.resharding.naive import gather_full_hf

    full, _ = gather_full_hf(named_weights, spec, parallel=parallel)
    if spec.tie_word_embeddings:
        full.pop("lm_head.weight", None)  # HF re-ties it from embed_tokens
    return full


def _shards(state: dict[str, torch.Tensor], max_shard_bytes: int) -> list[dict[str, torch.Tensor]]:
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name in sorted(state):
        nbytes = state[name].numel() * state[name].element_size()
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = state[name]
        size += nbytes
    return shards



def write_hf_checkpoint(state: dict[str, torch.Tensor], *, config_dir: str | os.PathLike, output_dir: str | os.PathLike,
                        options: ExportOptions = ExportOptions()) -> Path:
    """Write `state` (full HF-named tensors) + config/tokenizer/generation files from `config_dir` into
    `output_dir`, atomically. `output_dir` must not exist or be empty."""
    from safetensors.torch import save_file

    out = Path(output_dir)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ConfigError("--output", f"{out} exists and is not an empty directory; choose a new path")
    config_dir = Path(config_dir)
    if not (config_dir / "config.json").is_file():
        raise ConfigError("--checkpoint", f"{config_dir / 'config.json'} is missing (the architecture of the weights)")
    # The training dtype is the embedding's (checkpoints saved before the engine cast its norms hold them in fp32),
    # and an HF checkpoint holds one dtype (the one config.json names).
    dtype = options.dtype or state.get("model.embed_tokens.weight", next(iter(state.values()))).dtype
    state = {name: t.detach().to(dtype).contiguous().cpu() for name, t in state.items()}
    out.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
    try:
        shards = _shards(state, options.max_shard_bytes)
        names = ([WEIGHTS_NAME] if len(shards) == 1 else
                 [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))])
        weight_map = {}
        for file_name, shard in zip(names, shards):
            save_file(shard, str(staging / file_name), metadata={"format": "pt"})
            weight_map.update({tensor_name: file_name for tensor_name in shard})
        if len(shards) > 1:
            total = sum(t.numel() * t.element_size() for t in state.values())
            (staging / INDEX_NAME).write_text(json.dumps(
                {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}, indent=2))
        config = json.loads((config_dir / "config.json").read_text())
        # transformers 5 reads "dtype", older versions "torch_dtype"; both name what the files hold
        config["dtype"] = config["torch_dtype"] = str(dtype).removeprefix("torch.")
        if config.get("num_nextn_predict_layers"):
            config["num_nextn_predict_layers"] = 0  # DeepSeek-V3's MTP module is not trained or exported
        (staging / "config.json").write_text(json.dumps(config, indent=2) + "\n")
        for name in _SIDE_FILES:
            if (config_dir / name).is_file():
                shutil.copyfile(config_dir / name, staging / name)
        for path in staging.iterdir():
            fsync_path(path)
        fsync_path(staging)
        if out.exists():
            out.rmdir()  # empty (checked above); rename needs the name free
        os.rename(staging, out)
        fsync_path(out.parent)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return out


def export_engine(engine, *, config_dir: str | os.PathLike, output_dir: str | os.PathLike,
                  options: ExportOptions = ExportOptions()) -> Path | None:
    """Collective: a live `MegatronEngine`'s weights as an HF checkpoint, written by global rank 0
    (`megatron_training.save_hf` at the end of a run, see export_run_actor). Returns the path on rank 0,
    None elsewhere."""
    import torch.distributed as dist

    state = hf_weights_from_megatron(engine.named_weights(), engine.spec, parallel=engine.parallel)
    if dist.is_initialized() and dist.get_rank() != 0:
        return None
    return write_hf_checkpoint(state, config_dir=config_dir, output_dir=output_dir, options=options)


def export_run_actor(actor_group, *, run_dir: str | os.PathLike, config_dir: str | os.PathLike) -> Path:
    """megatron_training.save_hf: the live actor of a finished run (its ActorGroup) as an HF checkpoint at
    `run_dir/hf_export`. The ranks export into a new sibling, which then takes the name: a resumed run
    replaces the export its earlier part left there whole, and a reader sees one or the other, never a mix."""
    out = Path(os.path.abspath(run_dir)) / RUN_EXPORT_DIR  # the ranks may run in another working directory
    staged = out.parent / f".{out.name}.new-{os.getpid()}"
    shutil.rmtree(staged, ignore_errors=True)
    with disk_error_named(out.parent):
        results = actor_group.call("export_hf", str(staged), str(config_dir))
    written = [path for path, _ in results if path is not None]
    if written != [str(staged)]:
        raise RuntimeError(f"export_hf: expected global rank 0 alone to write {staged}, the ranks wrote {written}")
    replace_dir(staged, out)
    fsync_path(out.parent)
    return out


def load_checkpoint_model(checkpoint: str | os.PathLike, *, parallel: RankGroups, key: str = "--checkpoint",
                          base: str | None = None):
    """A TP1/PP1 Megatron model holding a mindspeed_rl checkpoint's weights (FORMAT.md; with LoRA its adapters too,
    checkpoint/lora_export.py, the backbone from `base` where the checkpoint holds only the adapters), its spec, its
    HF dir and its LoRA record (None without LoRA).

    Needs torch.distributed and Megatron's parallel state initialized at TP1 PP1 (one rank is enough), `parallel`
    being that rank's groups (megatron_state.initialize's): `dist_checkpointing.load` reshards whatever TP/PP the run
    saved at into this layout."""
    from megatron.core import dist_checkpointing
    from transformers import AutoConfig

    from mindspeed_rl.checkpoint.store import resolve_and_verify
    from mindspeed_rl.engines.dist_checkpoint import model_sharded_state_dict
    from mindspeed_rl.engines.megatron_engine import build_gpt_model

    verified = resolve_and_verify(checkpoint, key=key)
    hf_dir, model_dir = verified.path / "hf", verified.path / "model"
    try:
        spec = Qwen2Spec.from_hf_config(AutoConfig.from_pretrained(str(hf_dir)))
    except (OSError, ValueError) as error:
        raise ConfigError(key, f"{hf_dir / 'config.json'} is unreadable: {error}") from None
    params_dtype = _saved_dtype(model_dir, key=key)
    model = build_gpt_model(spec, params_dtype=params_dtype, parallel=parallel)  # TP1 PP1: the caller's
    state_path = verified.path / TRAINER_STATE_NAME  # a run's save has one; a model-only checkpoint may not
    trainer_state = json.loads(state_path.read_text()) if state_path.is_file() else {}
    for record_key, load_feature_model in FEATURE_LOADERS.items():  # a feature's own way of loading its checkpoints
        record = trainer_state.get(record_key)
        if record is not None:
            return (load_feature_model(model, spec, model_dir, record, parallel=parallel, base=base, key=key), spec,
                    hf_dir, record)
    try:
        state = dist_checkpointing.load(model_sharded_state_dict(model), str(model_dir), strict="raise_all")
    except Exception as error:  # Megatron raises several types for a foreign/corrupt checkpoint
        raise ConfigError(key, f"{model_dir} does not load as this model: {str(error).splitlines()[0]}") from None
    model.load_state_dict(state, strict=False)
    return model, spec, hf_dir, None


def _saved_dtype(model_dir: Path, *, key: str) -> torch.dtype:
    # The training dtype is the embedding's dtype in the checkpoint (older checkpoints hold fp32 norms in a bf16
    # model, so those are not a reliable witness); an adapters-only checkpoint: the adapters'.
    from torch.distributed.checkpoint import FileSystemReader

    try:
        metadata = FileSystemReader(str(model_dir)).read_metadata()
    except Exception as error:
        raise ConfigError(key, f"{model_dir} has no readable dist-checkpoint metadata: {error}") from None
    for suffix in ("word_embeddings.weight", "lora_A"):
        for name, item in metadata.state_dict_metadata.items():
            if name.endswith(suffix):
                return item.properties.dtype
    raise ConfigError(key, f"{model_dir} holds no embedding.word_embeddings.weight (not a GPT model checkpoint)")


def export_checkpoint(checkpoint: str | os.PathLike, output_dir: str | os.PathLike, *, parallel: RankGroups,
                      options: ExportOptions = ExportOptions(), peft: bool = False, base: str | None = None) -> Path:
    """A mindspeed_rl checkpoint (save root or iter dir) -> HF checkpoint directory, with LoRA its adapters merged
    into the backbone, or with `peft` a PEFT adapter directory instead. One rank, TP1 PP1 (`parallel`: its groups,
    the caller's)."""
    from mindspeed_rl.checkpoint.lora_export import write_peft_adapter
    from mindspeed_rl.models.lora import MergedWeights

    out = Path(output_dir)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ConfigError("--output", f"{out} exists and is not an empty directory; choose a new path")
    model, spec, hf_dir, lora = load_checkpoint_model(checkpoint, parallel=parallel, base=base)
    if peft:
        return write_peft_adapter(model, spec, lora, out, base=base, dtype=options.dtype)
    # With LoRA, each adapter merged into its weight.
    state = hf_weights_from_megatron(MergedWeights(model), spec, parallel=parallel)
    return write_hf_checkpoint(state, config_dir=hf_dir, output_dir=out, options=options)
