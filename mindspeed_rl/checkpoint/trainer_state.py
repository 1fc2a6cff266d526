"""Driver side of a checkpoint: trainer_state.json, HF config/tokenizer copies, save and resume steps.

The workers write model/, optimizer/ and rng/ (ActorHybridWorkerBase.save_checkpoint); the driver writes the
rest and commits the directory (store.commit_save). Layout: FORMAT.md.
"""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass
from pathlib import Path


from mindspeed_rl.checkpoint.store import (TRAINER_STATE_NAME, begin_save, commit_save, disk_error_named,
                                         is_checkpoint_dir, resolve_and_verify)
from mindspeed_rl.config.errors import ConfigError

HF_SUBDIR = "hf"
HF_FILES = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
            "special_tokens_map.json", "vocab.json", "merges.txt", "added_tokens.json", "chat_template.jinja")
LOAD_KEY = "actor_config.load"


def save_run_checkpoint(*, actor_group, save_root: str, iteration: int, sampler, kl_coef: float, seed: int,
                        hf_dir: str, keep_last_n: int | None, with_critic: bool = False,
                        lora: dict | None = None) -> Path:
    """Every rank writes its shards into a temporary dir, the driver adds its state and commits it."""
    tmp = begin_save(save_root, iteration)
    with disk_error_named(tmp):
        results = actor_group.call("save_checkpoint", str(tmp))
        critic = actor_group.call("save_critic_checkpoint", str(tmp)) if with_critic else None
    scheduler_state = results[0][0]
    state = {"iteration": iteration, "sampler": sampler.state_dict(), "scheduler": scheduler_state,
             "kl_coef": kl_coef, "seed": seed}
    if critic is not None:
        state["critic_scheduler"] = critic[0][0]
    if lora is not None:  # the adapters' settings and backbone (checkpoint/lora_export.py)
        state["lora"] = lora
    (tmp / TRAINER_STATE_NAME).write_text(json.dumps(state, indent=1, sort_keys=True))
    (tmp / HF_SUBDIR).mkdir()
    for name in HF_FILES:
        if (Path(hf_dir) / name).is_file():
            shutil.copy2(Path(hf_dir) / name, tmp / HF_SUBDIR / name)
    return commit_save(tmp, iteration, keep_last_n=keep_last_n)


@dataclass(frozen=True, kw_only=True)
class ResumePoint:
    path: Path
    iteration: int      # the last completed iteration; the run continues at iteration + 1
    state: dict


def find_resume_point(load: str | None, *, finetune: bool, hf_config: dict,
                      resume_from_last_intact: bool = False) -> ResumePoint | None:
    """The verified checkpoint `actor_config.load` names, or None when it is an HF dir / unset.

    Runs before any worker starts: a partial, corrupt or other-model checkpoint fails here in one line, which
    names the newest intact one (taken instead with `resume_from_last_intact`)."""
    if not load or not is_checkpoint_dir(load):
        return None
    path = verify_same_model(load, hf_config, key=LOAD_KEY, fall_back_to_intact=resume_from_last_intact)
    state = json.loads((path / TRAINER_STATE_NAME).read_text())
    return ResumePoint(path=path, iteration=0 if finetune else int(state["iteration"]), state=state)


def verify_same_model(checkpoint: str, hf_config: dict, *, key: str, fall_back_to_intact: bool = False) -> Path:
    """The checkpoint's iter dir, verified against its manifest and against the model being built."""
    verified = resolve_and_verify(checkpoint, key=key, fall_back_to_intact=fall_back_to_intact)
    saved_config_path = verified.path / HF_SUBDIR / "config.json"
    saved_config = json.loads(saved_config_path.read_text())
    for field in ("hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
                  "intermediate_size", "vocab_size"):
        if saved_config.get(field) != hf_config.get(field):
            raise ConfigError(key, f"{saved_config_path}: {field}={saved_config.get(field)!r} but the model "
                                   f"being built has {field}={hf_config.get(field)!r} (a checkpoint of another model)")
    return verified.path


def resume_actor(actor_group, point: ResumePoint, *, finetune: bool, no_load_optim: bool, no_load_rng: bool,
                 with_critic: bool = False) -> None:
    """Load weights (and, resuming, optimizer/scheduler/RNG) into every rank; the critic's too when the run has
    one and the checkpoint holds one (a GRPO checkpoint starting PPO leaves the critic as critic_config made it)."""
    resuming = not finetune
    load_optimizer = resuming and not no_load_optim
    actor_group.call("load_checkpoint", str(point.path), load_optimizer=load_optimizer,
                     load_rng=resuming and not no_load_rng,
                     scheduler_state=point.state["scheduler"] if load_optimizer else None)
    if with_critic and "critic_scheduler" in point.state:
        actor_group.call("load_critic_checkpoint", str(point.path), load_optimizer=load_optimizer,
                         load_rng=resuming and not no_load_rng, scheduler_state=point.state["critic_scheduler"] if load_optimizer else None)


def truncate_metrics_after(metrics_path: Path, iteration: int) -> None:
    """Keep the records of iterations <= `iteration` (whole lines only): the resumed run appends the rest."""
    if not metrics_path.exists():
        return
    kept = []
    for line in metrics_path.read_text(encoding="utf-8").splitlines():
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            break  # a cut-off last line from a crash
        if int(record["iteration"]) <= iteration:
            kept.append(line)
    tmp = metrics_path.with_suffix(metrics_path.suffix + ".tmp")
    tmp.write_text("".join(k + "\n" for k in kept), encoding="utf-8")
    tmp.replace(metrics_path)


__all__ = ["ResumePoint", "find_resume_point", "resume_actor", "save_run_checkpoint", "truncate_metrics_after"]
