"""From a run's config (the same GRPOConfig the trainer loads) to the planner's inputs, and the search for
overrides that make a plan fit.

The model's numbers come from, in order: the run's checkpoint `config.json` when it exists on this machine
(`actor_config.load` when it is an HF directory, else `megatron_training.tokenizer_name_or_path`), the
shipped copy of the published config.json named by the model block (`configs/model/hf/<actor_config.model>.json`),
or the model block itself (`model.<name>`; the tiny demos, whose checkpoint is generated at start).
"""
from __future__ import annotations

import itertools
import json
import math
from dataclasses import dataclass, replace
from pathlib import Path

from mindspeed_rl.config import ConfigError, GRPOConfig
from mindspeed_rl.config.tolerated import longest_sample_tokens, sequence_parallel_in_effect
from mindspeed_rl.memory.residency import ResidencyPolicy, run_states
from mindspeed_rl.planner.arch import Architecture, ArchitectureError, from_hf_config, hf_config_from_model_block
from mindspeed_rl.planner.critic import critic_inputs
from mindspeed_rl.planner.lora import lora_inputs
from mindspeed_rl.planner.expert_map import expert_slots, read_expert_map
from mindspeed_rl.planner.inputs import CP_GATHER, KVCacheSpec, PlanInputs
from mindspeed_rl.planner.memory import MemoryPlan, plan_memory
from mindspeed_rl.planner.switch import SwitchPlan, plan_switch
from mindspeed_rl.sizes import GIB

REPO = Path(__file__).resolve().parents[2]
SHIPPED_HF_DIR = REPO / "configs" / "model" / "hf"


@dataclass(frozen=True)
class ModelSource:
    hf_config: dict
    source: str  # where the numbers came from, for the output


def resolve_hf_config(config: GRPOConfig) -> ModelSource:
    """The model's config.json (see the module docstring). Raises ConfigError naming the key."""
    name = config.actor_config.model
    for key, path in (("actor_config.load", config.actor_config.load),
                      ("megatron_training.tokenizer_name_or_path", config.megatron_training.tokenizer_name_or_path)):
        if path and (Path(path) / "config.json").is_file():
            return ModelSource(_read_json(Path(path) / "config.json", key), f"{Path(path) / 'config.json'} ({key})")
    shipped = SHIPPED_HF_DIR / f"{name}.json"
    if shipped.is_file():
        return ModelSource(_read_json(shipped, "actor_config.model"),
                           f"{shipped.relative_to(REPO)} (published config.json of actor_config.model={name})")
    block = config.selected_model
    if block is None:
        raise ConfigError("actor_config.model", f"{name!r}: no checkpoint config.json on this machine, no "
                                                f"configs/model/hf/{name}.json and no model.{name} block to size it from")
    try:
        return ModelSource(hf_config_from_model_block(block, name), f"the model.{name} block")
    except ArchitectureError as error:
        raise ConfigError(f"model.{name}", str(error)) from None


def _read_json(path: Path, key: str) -> dict:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as error:
        raise ConfigError(key, f"{path}: cannot read it as JSON ({error})") from None


def architecture(source: ModelSource, key: str = "actor_config.model") -> Architecture:
    try:
        return from_hf_config(source.hf_config, where=source.source)
    except ArchitectureError as error:
        raise ConfigError(key, str(error)) from None


def reward_architecture(config: GRPOConfig) -> Architecture | None:
    """The reward model's architecture from its config.json where it is on this machine; None (plan it as the
    actor's trunk) without a reward model or before the demo's generated one exists."""
    if config.reward_model is None:
        return None
    name, section = config.reward_model
    path = Path(section.model_path) / "config.json"
    if not path.is_file():
        return None
    key = f"rewards.{name}.model_path"
    return architecture(ModelSource(_read_json(path, key), f"{path} ({key})"), key)


def teacher_architecture(config: GRPOConfig) -> Architecture | None:
    """The teacher's architecture from its config.json where it is on this machine; None (plan it as the actor's)
    without distillation or before the demo's teacher is made."""
    if not config.distills:
        return None
    path = Path(config.distillation.teacher.model_path) / "config.json"
    if not path.is_file():
        return None
    return _architecture_at(path, f"distillation.teacher_models.{config.distillation.teacher_name}.model_path")


def teacher_inputs(config: GRPOConfig) -> dict:
    """PlanInputs' teacher fields: its architecture, and its devices and layout where it has devices of its own."""
    from mindspeed_rl.config.distillation import own_teacher_ranks, teacher_layout

    world = own_teacher_ranks(config)
    layout = teacher_layout(config).train
    return dict(teacher_arch=teacher_architecture(config), teacher_world_size=world,
                teacher_tp=layout.tp if world else 1, teacher_pp=layout.pp if world else 1)


def _architecture_at(path: Path, key: str) -> Architecture:
    return architecture(ModelSource(_read_json(path, key), f"{path} ({key})"), key)


def on_cpu(config: GRPOConfig, device_memory: int | None, device: str | None = None) -> bool:
    """`device` (the run's resolved device) if given; else runtime.device, where auto plans for an accelerator
    when a device size is given and for CPU otherwise."""
    device = device or config.runtime.device
    return device == "cpu" or (device == "auto" and device_memory is None)


def plan_inputs(config: GRPOConfig, arch: Architecture, *, device_memory: int | None = None,
                seq_length: int | None = None, device: str | None = None, profile: str | None = None,
                this_engine: bool = False) -> PlanInputs:
    """`profile` (ACTIVATION_PROFILES) None: accelerator off CPU when the recipe selects the fused RMSNorm and SwiGLU
    kernels the published count assumes; otherwise cpu (the unfused path's measured amounts). `this_engine`: what this
    engine holds (its CP gather, vLLM's even expert placement), not MindSpeed-RL's planned-for keys."""
    mt, ac, rl, gen = config.megatron_training, config.actor_config, config.rl_config, config.generate_config
    cpu = on_cpu(config, device_memory, device)
    profile = profile or ("accelerator" if not cpu and mt.use_fused_rmsnorm and mt.use_fused_swiglu else "cpu")
    return PlanInputs(
        arch=replace(arch, pipeline_stage_layers=ac.pipeline_stage_layers), **PlanInputs.layout_fields(config.layout),
        bf16=mt.bf16, infer_dtype=gen.dtype, distributed_optimizer=mt.use_distributed_optimizer,
        sequence_parallel=sequence_parallel_in_effect(config), flash_attention=mt.use_flash_attn and not cpu,
        micro_batch_size=ac.micro_batch_size, mini_batch_samples=rl.mini_batch_size_in_samples,
        seq_length=seq_length or longest_sample_tokens(config),
        response_length=config.response_length_limit,
        policy=ResidencyPolicy.for_states(config, run_states(config)),
        **lora_inputs(config), reward_arch=reward_architecture(config),
        **teacher_inputs(config), **critic_inputs(config, _architecture_at),
        kv=KVCacheSpec(on_cpu=cpu, cpu_bytes=int(gen.cpu_kvcache_space_gb * GIB),
                       gpu_memory_utilization=gen.gpu_memory_utilization, max_num_seqs=gen.max_num_seqs,
                       max_model_len=gen.max_model_len),
        device_memory=device_memory, bucket_bytes=int(gen.resharding_bucket_mb * 2**20),
        swap_optimizer_times=mt.swap_optimizer_times,
        packed=rl.use_remove_padding,
        recompute_granularity=ac.recompute_granularity, recompute_method=ac.recompute_method,
        recompute_num_layers=ac.recompute_num_layers,
        packing_token_budget=rl.packing_budgets["update"][0] if rl.use_dynamic_bsz else None,
        activation_profile=profile, **planned_for_their_stack(config, arch, cpu=cpu, profile=profile,
                                                               this_engine=this_engine),
    )


def planned_for_their_stack(config: GRPOConfig, arch: Architecture, *, cpu: bool, profile: str,
                            this_engine: bool) -> dict:
    """PlanInputs' cp_exchange, expert_slots and moe_tokens_split_over_tp: the keys this engine plans for but runs its
    own way (moe_tp_extend_ep: the accelerator profile counts each TP rank's own dispatched tokens). On an accelerator
    the plan is for the user's devices (MindSpeed's CP exchange with the accelerator profile; EPLB's expert map, read
    and checked whenever it is set and there; a map not made yet - theirs come from the user's own rollouts - plans the
    even share, said by cli/plan.py); on CPU, or for `this_engine`, what this engine holds (its gather; vLLM's even
    expert placement). A run checks the map at start (trainer/setup.py)."""
    gen, algo = config.generate_config, config.actor_config.context_parallel_algo
    exchange = CP_GATHER if this_engine or profile == "cpu" or algo is None else algo
    slots = None
    if gen.expert_map_path and not this_engine and Path(gen.expert_map_path).exists():
        slots = expert_slots(read_expert_map(gen.expert_map_path), arch,
                             ep_size=config.world_size // gen.infer_pipeline_parallel_size,  # vLLM's TP x DP
                             expert_parallel=gen.infer_expert_parallel_size > 1)
    their_layout = not (this_engine or profile == "cpu")
    return {"cp_exchange": exchange, "expert_slots": None if cpu else slots,
            "moe_tokens_split_over_tp": their_layout and config.actor_config.moe_tp_extend_ep
            and sequence_parallel_in_effect(config)}


def plan_config(config: GRPOConfig, arch: Architecture, *, device_memory: int | None = None,
                link_bytes_per_second: float = 50e9, with_switch: bool = True, seq_length: int | None = None,
                device: str | None = None, profile: str | None = None,
                this_engine: bool = False) -> tuple[MemoryPlan, SwitchPlan | None]:
    """The memory plan of a config (and the switch's bytes from the resharding plan); `this_engine`: plan_inputs'."""
    if config.disaggregated:
        # Its phases and the switch assume one device holds every role's states in turn.
        raise ConfigError("actor_infer.device_mapping", "disaggregated roles: the planner models colocated roles "
                                                        "only (every state on one set of devices, taking turns)")
    inputs = plan_inputs(config, arch, device_memory=device_memory, seq_length=seq_length, device=device,
                         profile=profile, this_engine=this_engine)
    switch = plan_switch(inputs, link_bytes_per_second=link_bytes_per_second) if with_switch else None
    staging = {r.rank: r.staging for r in switch.ranks} if switch else None
    return plan_memory(inputs, switch_staging=staging), switch


def predict_run(config: GRPOConfig, hf_config: dict, *, device: str) -> MemoryPlan:
    """What the trainer prints at start and logs beside the ledger: the plan of this run's config and
    checkpoint on its device, of runtime.device_memory_limit where set (else no device size is known: on an
    accelerator the KV cache is taken as max_num_seqs x max_model_len tokens), as this engine holds it (its CP gather,
    vLLM's even expert placement). Raises ConfigError or ValueError when it cannot size the model."""
    arch = architecture(ModelSource(hf_config, "the checkpoint's config.json"))
    return plan_config(config, arch, with_switch=False, device=device,
                       device_memory=config.runtime.device_memory_limit_bytes, this_engine=True)[0]


# -- suggestions ----------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Suggestion:
    overrides: tuple[str, ...]  # Hydra overrides, `key=value`
    peak_phase: str
    peak_bytes: int


OFFLOAD_KEYS = ("generate_config.offload_train_param", "generate_config.offload_train_grad",
                "generate_config.offload_train_optimizer")


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _knobs(config: GRPOConfig, arch: Architecture) -> list[list[dict[str, object]]]:
    """Each knob's alternative values, nearest first: the offload flags (single ones, then all on), smaller
    micro-batches, other train layouts (TP, PP, EP), other inference TPs."""
    gen, ac, world = config.generate_config, config.actor_config, config.world_size
    off = [key for key in OFFLOAD_KEYS if not getattr(gen, key.rsplit(".", 1)[1])]
    flags = [{key: True} for key in off] + ([{key: True for key in off}] if len(off) > 1 else [])
    mbs = [{"actor_config.micro_batch_size": m} for m in sorted(_divisors(ac.micro_batch_size), reverse=True)
           if m < ac.micro_batch_size]
    current = (ac.tensor_model_parallel_size, ac.pipeline_model_parallel_size, ac.expert_model_parallel_size)
    layouts = []
    for tp in _divisors(world):
        for pp in _divisors(world // tp):
            for ep in (_divisors(world // (tp * pp)) if arch.is_moe else [1]):
                if (tp, pp, ep) == current:
                    continue
                layout = {"actor_config.tensor_model_parallel_size": tp, "actor_config.pipeline_model_parallel_size": pp}
                if ac.num_layer_list is not None and pp != current[1]:  # the listed stages are for the current PP
                    layout["actor_config.num_layer_list"] = None
                if arch.is_moe:
                    layout["actor_config.expert_model_parallel_size"] = ep
                layouts.append(layout)
    layouts.sort(key=lambda layout: math.prod(v for v in layout.values() if isinstance(v, int)))  # the least model parallelism first
    infer = [{"generate_config.infer_tensor_parallel_size": tp} for tp in _divisors(world)
             if tp != gen.infer_tensor_parallel_size]
    return [knob for knob in (flags, mbs, layouts, infer) if knob]


def _candidates(config: GRPOConfig, arch: Architecture):
    """Override sets: one knob changed, then two, ... (each knob's values nearest first)."""
    knobs = _knobs(config, arch)
    for count in range(1, len(knobs) + 1):
        for chosen in itertools.combinations(knobs, count):
            for values in itertools.product(*chosen):
                merged: dict[str, object] = {}
                for value in values:
                    merged.update(value)
                yield count, merged


def _apply(config: GRPOConfig, overrides: dict[str, object]) -> GRPOConfig:
    """`config` with `section.key` overrides, rebuilt through the dataclasses: every check that load_config runs
    (each section's and the cross-section ones) runs again and raises ConfigError."""
    changed = dict(overrides)
    if changed.get("actor_config.tensor_model_parallel_size") == 1:
        changed["megatron_training.sequence_parallel"] = False
    sections: dict[str, dict[str, object]] = {}
    for key, value in changed.items():
        section, name = key.split(".", 1)
        sections.setdefault(section, {})[name] = value
    return replace(config, **{section: replace(getattr(config, section), **values)
                              for section, values in sections.items()})


def _config_value(config: GRPOConfig, key: str):
    value = config
    for part in key.split("."):
        value = getattr(value, part)
    return value


def _override_text(overrides: dict[str, object], cfg, base: GRPOConfig) -> tuple[str, ...]:
    """Hydra override strings for the keys that change (`+key=value` where the YAML does not list the key)."""
    from omegaconf import OmegaConf

    changed = dict(overrides)
    if changed.get("actor_config.tensor_model_parallel_size") == 1 and base.megatron_training.sequence_parallel:
        changed["megatron_training.sequence_parallel"] = False
    text = []
    for key, value in changed.items():
        if _config_value(base, key) == value:
            continue
        absent = OmegaConf.select(cfg, key, default=_ABSENT) is _ABSENT
        shown = "null" if value is None else str(value).lower() if isinstance(value, bool) else value
        text.append(f"{'+' if absent else ''}{key}={shown}")
    return tuple(text)


_ABSENT = object()


def suggest(cfg, arch: Architecture, *, device_memory: int, limit: int = 5,
            profile: str | None = None) -> list[Suggestion]:
    """Override sets (valid configs: every check of load_config passes) whose plan fits `device_memory`: for each set
    of knobs, the nearest values that fit; fewest changed keys first. `cfg` is the composed Hydra tree."""
    from mindspeed_rl.config import load_config

    base = load_config(cfg)
    first: dict[tuple[str, ...], Suggestion] = {}  # per set of changed keys, the first candidate that fits
    level_done = 0
    for count, overrides in _candidates(base, arch):
        if count > level_done:
            if len(first) >= limit:
                break  # enough with fewer knobs changed
            level_done = count
        text = _override_text(overrides, cfg, base)
        family = tuple(sorted(o.split("=")[0].lstrip("+") for o in text))
        if not text or any(set(known) <= set(family) for known in first):
            continue  # this set of knobs, or a part of it, already fits
        try:
            plan, _ = plan_config(_apply(base, overrides), arch, device_memory=device_memory, with_switch=False,
                                  profile=profile)
        except (ConfigError, ValueError):
            continue
        if plan.fits():
            first[family] = Suggestion(text, *plan.peak()[::2])
    return sorted(first.values(), key=lambda s: (len(s.overrides), s.peak_bytes))[:limit]
