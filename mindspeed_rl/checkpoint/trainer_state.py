"""Driver side of a checkpoint: trainer_state.json, HF config/tokenizer copies, save and resume steps.

The workers write model/, optimizer/ and rng/ (the training part's save_checkpoint, workers/parts/training.py); the driver writes the
rest and commits the directory (store.commit_save). Layout: FORMAT.md.
"""

from __future__ import annotations

import dataclasses
import json
import shutil
from dataclasses import dataclass
from pathlib import Path


from mindspeed_rl.checkpoint.store import (TRAINER_STATE_NAME, begin_save, commit_save, disk_error_named,
                                         is_checkpoint_dir, resolve_and_verify)
from mindspeed_rl.errors import ConfigError

HF_SUBDIR = "hf"
HF_FILES = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
            "special_tokens_map.json", "vocab.json", "merges.txt", "added_tokens.json", "chat_template.jinja")
LOAD_KEY = "actor_config.load"
CONTENTS_KEY = "contents"
ROLLOUT_AHEAD_NAME = "rollout_ahead.pt"
CARRIED_SAMPLES_NAME = "carried_samples.json"  # partial rollout's carried groups (trainer/partial_rollout.py)


@dataclass(frozen=True, kw_only=True)
class Contents:
    """What a checkpoint holds beside the weights (actor_config.no_save_optim / no_save_rng), and the expert-parallel
    size it was saved at: Megatron keeps a MoE's experts in an optimizer of their own only at EP > 1, and the
    optimizer's param groups follow that split."""
    optimizer: bool = True
    rng: bool = True
    expert_parallel_size: int = 1


def checkpointed(actor_group) -> list:
    """What each part of the group that trains saves and loads (workers/parts: `CHECKPOINT`), the actor's first."""
    return [part.CHECKPOINT for part in actor_group.parts() if part.CHECKPOINT is not None]


def save_run_checkpoint(*, actor_group, save_root: str, iteration: int, sampler, kl_coef: float, seed: int,
                        hf_dir: str, keep_last_n: int | None, records: dict | None = None,
                        contents: Contents = Contents(), rollout_ahead: list | None = None,
                        carried_samples: dict | None = None) -> Path:
    """Every rank writes its parts' shards into a temporary dir, the driver adds its state (and `records`: what a
    feature keeps of its settings, e.g. LoRA's, checkpoint/lora_export.py; `rollout_ahead`: one-step off-policy's
    finished rollout of the next iteration, sampled by weights no checkpoint holds; `carried_samples`: partial
    rollout's unfinished and untrained groups, their tokens, log-probs and policy versions) and commits it."""
    tmp = begin_save(save_root, iteration)
    parts = dict(with_optimizer=contents.optimizer, with_rng=contents.rng)
    with disk_error_named(tmp):
        schedulers = {saved.state_key: actor_group.call(saved.save, str(tmp), **parts)[0][0]
                      for saved in checkpointed(actor_group)}
    state = {"iteration": iteration, "sampler": sampler.state_dict(), **schedulers,
             "kl_coef": kl_coef, "seed": seed, CONTENTS_KEY: dataclasses.asdict(contents), **(records or {})}
    (tmp / TRAINER_STATE_NAME).write_text(json.dumps(state, indent=1, sort_keys=True))
    if rollout_ahead is not None:
        import torch

        torch.save(rollout_ahead, tmp / ROLLOUT_AHEAD_NAME)
    if carried_samples is not None:  # JSON: Python writes a float's shortest repr, read back bit-exact
        (tmp / CARRIED_SAMPLES_NAME).write_text(json.dumps(carried_samples))
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


def saved_rollout_ahead(point: ResumePoint | None) -> list | None:
    """The rollout started ahead that `point` kept (one-step off-policy), or None."""
    if point is None or not point.iteration or not (point.path / ROLLOUT_AHEAD_NAME).is_file():
        return None
    import torch

    saved = torch.load(point.path / ROLLOUT_AHEAD_NAME, weights_only=False)  # our own file, verified by its manifest
    return [(_as_generations(shard), metrics) for shard, metrics in saved]


def saved_carried_samples(point: ResumePoint | None) -> dict | None:
    """The samples partial rollout carried past `point` (with the sampler it saved, after their prompts), or None."""
    if point is None or not point.iteration or not (point.path / CARRIED_SAMPLES_NAME).is_file():
        return None
    return json.loads((point.path / CARRIED_SAMPLES_NAME).read_text())


def _as_generations(shard):
    """A rank's saved samples as `Generation`s: checkpoints from before them hold (index, ids, log-probs[, routes])."""
    from dataclasses import replace

    from mindspeed_rl.protocol import Generation

    if not shard.value or not isinstance(shard.value[0], tuple):
        return shard
    return replace(shard, value=[Generation(prompt_index=s[0], token_ids=s[1], logprobs=s[2],
                                            routed_experts=s[3] if len(s) > 3 else None) for s in shard.value])


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


def saved_contents(point: ResumePoint) -> Contents:
    """Checkpoints from before `contents` was recorded hold everything, at EP1 or without experts."""
    return Contents(**point.state.get(CONTENTS_KEY, {}))


def resume_actor(actor_group, point: ResumePoint, *, finetune: bool, no_load_optim: bool, no_load_rng: bool) -> None:
    """Load weights (and, resuming, optimizer/scheduler/RNG) into every rank: each part that trains and whose state
    the checkpoint holds (a GRPO checkpoint starting PPO leaves the critic as critic_config made it). A checkpoint
    saved without optimizer or RNG states resumes without them, said in one line each."""
    resuming, saved = not finetune, saved_contents(point)
    load_optimizer = resuming and not no_load_optim and saved.optimizer
    load_rng = resuming and not no_load_rng and saved.rng
    for line in _missing_state_lines(point, saved, resuming=resuming, no_load_optim=no_load_optim,
                                     no_load_rng=no_load_rng):
        print(line, flush=True)
    # The scheduler's position is in trainer_state.json whatever no_save_optim says: the learning rate continues.
    scheduler = resuming and not no_load_optim
    for saved in checkpointed(actor_group):
        if saved.state_key in point.state:
            actor_group.call(saved.load, str(point.path), load_optimizer=load_optimizer, load_rng=load_rng,
                             scheduler_state=point.state[saved.state_key] if scheduler else None)


def _missing_state_lines(point: ResumePoint, saved: Contents, *, resuming: bool, no_load_optim: bool,
                         no_load_rng: bool) -> list[str]:
    lines = []
    if resuming and not no_load_optim and not saved.optimizer:
        lines.append(f"[checkpoint] {point.path} holds no optimizer states (saved with actor_config.no_save_optim): "
                     f"the fp32 masters come from the saved weights and Adam's moments start from zero; the "
                     f"learning-rate schedule continues after iteration {point.iteration}")
    if resuming and not no_load_rng and not saved.rng:
        lines.append(f"[checkpoint] {point.path} holds no RNG states (saved with actor_config.no_save_rng): each "
                     f"rank's generators keep their start-up seeds, so the run does not repeat an uninterrupted one "
                     f"bit for bit (vLLM's sampling seeds follow the iteration either way)")
    return lines


def check_optimizer_split(point: ResumePoint, *, finetune: bool, no_load_optim: bool, is_moe: bool,
                          expert_parallel_size: int) -> None:
    """A MoE's optimizer states load at any EP > 1 from any EP > 1 (or EP1 from EP1): Megatron splits the experts
    into an optimizer of their own only at EP > 1, and the param groups a checkpoint holds follow that split."""
    saved = saved_contents(point)
    if finetune or no_load_optim or not saved.optimizer or not is_moe:
        return
    if (saved.expert_parallel_size > 1) != (expert_parallel_size > 1):
        raise ConfigError(LOAD_KEY, f"{point.path} holds the optimizer states of a MoE saved at expert parallel size "
                                    f"{saved.expert_parallel_size}, and this run has {expert_parallel_size}: Megatron "
                                    f"splits the experts into an optimizer of their own only at EP > 1. Resume at an "
                                    f"EP {'> 1' if saved.expert_parallel_size > 1 else 'of 1'}, or load the weights "
                                    f"without them (actor_config.no_load_optim=true)")


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


__all__ = ["ResumePoint", "find_resume_point", "resume_actor", "save_run_checkpoint", "saved_carried_samples",
           "saved_rollout_ahead", "truncate_metrics_after"]
