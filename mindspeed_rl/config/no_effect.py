"""MindSpeed-RL keys that are knobs of its implementation with no counterpart here, and model-block keys
that MindSpeed-RL reads as megatron_training's.

A user's recipe runs unchanged: such a key is accepted, dropped before the schema and listed once at
start (``[config] no effect on this engine: key (why), ...``); ``runtime.strict_keys: true`` makes each an
error instead. Only keys that do not change what is computed (the model, the algorithm, the data) are
here; where only some values are harmless (``reset_attention_mask: true``), any other is an error.
"""

from collections.abc import Callable, Mapping
from dataclasses import KW_ONLY, dataclass
from typing import Any, Optional

from mindspeed_rl.errors import ConfigError
from mindspeed_rl.config.msprobe import drop_msprobe_section
from mindspeed_rl.config.removed import present_keys
from mindspeed_rl.config.their_keys import megatron_argument_entries


@dataclass(frozen=True)
class NoEffect:
    """A key of MindSpeed-RL's implementation, accepted and listed. "No effect" claims that no value, no byte of
    memory and no file changes: `why` says why the values computed are the same, `memory` and `files` why the device
    memory and the files are ("same: ...") or how they differ from MindSpeed-RL's with the key ("differs: ...", then
    said in the start line too, e.g. a memory saving of theirs this engine does not make)."""
    why: str
    # The values that are harmless here (None: any value); any other is an error.
    values: Optional[tuple[Any, ...]] = None
    # Given the tree and the key's value: true when the key does have an effect in this config (it then stays
    # for the schema).
    applies: Optional[Callable[[Mapping[str, Any], Any], bool]] = None
    _: KW_ONLY
    memory: str
    files: str

    def notice(self, key: str) -> str:
        differences = [f"{what}: {reason.removeprefix(DIFFERS)}" for what, reason in
                       (("memory", self.memory), ("files", self.files)) if reason.startswith(DIFFERS)]
        return f"{key} ({'; '.join([self.why, *differences])})"


SAME, DIFFERS = "same: ", "differs: "


def _setting(tree: Mapping[str, Any], section: str, key: str, default: Any) -> Any:
    """`section.key` of the raw tree (before the schema), `default` where the section or the key is absent."""
    node = tree.get(section)
    return node.get(key, default) if isinstance(node, Mapping) else default


def _estimator(tree: Mapping[str, Any]) -> Any:
    return _setting(tree, "rl_config", "adv_estimator", "group_norm")


def _partial_rollout_on(tree: Mapping[str, Any]) -> bool:
    split = _setting(tree, "rl_config", "partial_rollout_max_split", 1)
    return isinstance(split, int) and split > 1


def _stage(tree: Mapping[str, Any]) -> Any:
    return _setting(tree, "megatron_training", "stage", None)


_CRITIC_IN_ACTOR_CHECKPOINT = ("the critic is saved in and resumed from the actor's checkpoints: actor_config.{key} "
                              "decides for both")
_NPU_KERNEL = "an NPU kernel or layout choice of MindSpeed; the values computed are the same"
_TRANSFER_DOCK = "MindSpeed-RL's transfer-dock transport between its workers; there is none here"
_MOE_KERNEL = "a MoE kernel/communication choice (the engine's per-expert linears and allgather dispatch compute the same)"
# The memory and file reasons most entries share.
_SIZES_NOTHING = SAME + "it sizes no tensor, there or here"
_KERNEL_MEMORY = (SAME + "a kernel's transient workspace there; here the plain path's tensors, which the planner and "
                         "the ledger count")
_NO_FILE = SAME + "it names no file and writes none"
_DOCK_MEMORY = SAME + "their transfer dock's host buffers; here batches pass through host memory too, never the device"


def _entry(why: str, values: Optional[tuple[Any, ...]] = None, applies=None, *, memory: str = _SIZES_NOTHING,
           files: str = _NO_FILE) -> NoEffect:
    return NoEffect(why, values, applies, memory=memory, files=files)


NO_EFFECT_KEYS: dict[str, NoEffect] = {
    "megatron_training.seq_length": _entry(
        "lengths are rl_config.max_prompt_length (prompts) and generate_config.max_model_len (prompt + response)",
        memory=SAME + "activations are sized by those lengths, there (for RL) and here"),
    "megatron_training.init_method_std": _entry("weights come from the HF checkpoint; nothing is initialised"),
    "megatron_training.distributed_backend": _entry("the accelerator picks gloo/nccl/hccl from the device",
                                                    memory=SAME + "the backend's buffers are its own either way"),
    "megatron_training.no_shared_storage": _entry(
        "the driver reads the data; checkpoints name their own storage",
        files=SAME + "every rank writes its shards under actor_config.save, a path every node must reach"),
    "megatron_training.full_shuffle_instruction_dataset": _entry(
        "there are no instruction-dataset blends; megatron_training.no_shuffle and seed set the prompt order",
        (False,)),
    "megatron_training.reuse_fp32_param": _entry(
        "an NPU memory optimisation; the values computed are the same",
        memory=DIFFERS + "MindSpeed keeps the fp32 masters and the bf16 params in one buffer (2 bytes per parameter "
                         "less); here both are kept, and the planner counts both"),
    "megatron_training.no_pad_to_seq_lengths": _entry(
        "sequences are never padded to seq_length here (false, their default, at PP > 1 with "
        "rl_config.use_remove_padding: an error, as theirs)",
        memory=DIFFERS + "false pads their micro-batches to seq_length; here a micro-batch is as wide as its longest "
                         "sample (the planner's width)"),
    "megatron_training.reset_attention_mask": _entry(
        "packed samples never attend to each other here (rl_config.use_remove_padding, which with false is an error, "
        "as theirs); without packing a row holds one sample, nothing to reset"),
    "megatron_training.shape_order": _entry(_NPU_KERNEL, memory=_KERNEL_MEMORY),
    "megatron_training.moe_alltoall_overlap_comm": _entry(_MOE_KERNEL, memory=_KERNEL_MEMORY),
    "megatron_training.use_rotary_position_embeddings": _entry("every model here uses RoPE (rotary_base)", (True,)),
    "actor_config.gemm_gradient_accumulation_fusion": _entry(_NPU_KERNEL, memory=_KERNEL_MEMORY),
    "actor_config.initial_loss_scale": _entry("fp16's loss scale; bf16 and fp32 runs have none"),
    # CCLoRA overlaps the adapters' TP communication with their compute: the same adapters, outputs and gradients.
    # false stays for the schema (no line); true is listed.
    **{f"{section}.lora_fusion": _entry(
        "MindSpeed's CCLoRA, an NPU kernel overlapping the adapters' communication with their compute; the "
        "adapters compute the same without it", applies=lambda tree, value: value is False, memory=_KERNEL_MEMORY)
       for section in ("actor_config", "critic_config")},
    "actor_config.attention_mask_type": _entry("the actor's attention is causal", ("causal",)),
    "rl_config.guarantee_order": _entry("rollouts run in the driver's order; there is no asynchronous dispatch"),
    "rl_config.blocking": _entry("every phase is a blocking call of the integrated worker"),
    "rl_config.async_engine": _entry(
        "vLLM's engine API: MindSpeed-RL's multi-turn rollout needs its step-by-step engine; here every turn is one "
        "batched generate of the samples still going (trainer/multi_turn.py). With partial_rollout_max_split > 1 it "
        "has its effect (the generate stops once a global batch of groups is complete: docs/partial_rollout.md)",
        applies=lambda tree, value: value is False or _partial_rollout_on(tree),
        memory=SAME + "vLLM's KV cache is sized by generate_config either way"),
    "rl_config.gamma": _entry(
        "a discount of token returns; group_norm (GRPO), rloo and reinforce_plus_plus_baseline do not read it, in "
        "MindSpeed-RL and verl either",
        applies=lambda tree, value: _estimator(tree) in ("reinforce_plus_plus", "gae") or value == 1.0),
    "rl_config.lam": _entry("GAE's lambda; only adv_estimator gae (PPO) reads it, in MindSpeed-RL too",
                            applies=lambda tree, value: _estimator(tree) == "gae"),
    "rl_config.use_kl_in_reward": _entry("GRPO's KL is in the loss (rl_config.kl_penalty, init_kl_coef); PPO "
                                         "(adv_estimator gae) reads it", (False,),
                                         applies=lambda tree, value: _estimator(tree) == "gae"),
    **{f"critic_config.{key}": _entry(
        _CRITIC_IN_ACTOR_CHECKPOINT.format(key=key),
        files=DIFFERS + "MindSpeed-RL saves the critic under critic_config.save; here under <actor checkpoint>/critic")
       for key in ("save", "keep_last_n", "no_save_optim", "no_save_rng")},
    **{f"critic_config.{key}": _entry(_CRITIC_IN_ACTOR_CHECKPOINT.format(key=key))
       for key in ("finetune", "no_load_optim", "no_load_rng")},
    "rl_config.num_cpus_for_local_task": _entry(
        "rule rewards run in the driver, or on rewards.<name>.world_size CPU workers"),
    "rl_config.verifier_parallel": _entry("rule rewards run in the driver, or on rewards.<name>.world_size CPU workers"),
    "rl_config.use_dp_batch_balance": _entry(
        "micro-batches are balanced by token count with rl_config.use_dynamic_bsz; the loss is the same",
        memory=SAME + "rl_config's token budget (use_dynamic_bsz) bounds each micro-batch's activations, which the "
                      "planner counts"),
    "rl_config.zmq_communication": _entry(_TRANSFER_DOCK, memory=_DOCK_MEMORY),
    "rl_config.hccl_buffersize": _entry(_TRANSFER_DOCK, memory=_DOCK_MEMORY),
    # Every experience count per dispatch of MindSpeed-RL's rl_config (config_cls/rl_config.py).
    **{f"rl_config.{step}_dispatch_size": _entry(_TRANSFER_DOCK, memory=_DOCK_MEMORY)
       for step in ("actor_rollout", "actor_logprob", "ref", "reward", "dynamic_sampling", "adv", "actor_update",
                    "critic_update", "critic_value", "kl", "actor_image_embeds")},
    "rl_config.verifier_timeout": _entry(
        "read by nothing in MindSpeed-RL's source; this engine's per-sample limit is rl_config.verifier_timeout_seconds"),
    # MindSpeed-RL's GAE whitens the advantages whatever this says (trainer/utils/compute_utils.py), as this engine's
    # does (algorithms/ppo.py); group_norm, rloo and reinforce_plus_plus normalise their own way, there and here.
    "rl_config.advantage_whiten": _entry(
        "read by nothing in MindSpeed-RL's source: its GAE (adv_estimator gae) always whitens the advantages, as here; "
        "the other estimators never do, there and here"),
    "rl_config.num_samples_per_step": _entry("read by nothing in MindSpeed-RL's source"),
    # Their actor copies it into meta_info["beta"], which no GRPO/DAPO/PPO loss of theirs reads (their KL coefficient
    # is init_kl_coef); a DPO run (stage dpo) keeps it for its own section (config/dpo.py).
    "rl_config.beta": _entry(
        "copied into their actor's meta_info, which no GRPO/DAPO/PPO loss of MindSpeed-RL reads; the KL coefficient "
        "is rl_config.init_kl_coef", applies=lambda tree, value: _stage(tree) == "dpo"),
    "rl_config.tp_split_expert": _entry(
        "read by nothing in MindSpeed-RL's source; experts are split over TP here by actor_config.moe_tp_extend_ep "
        "(false: each expert split over TP)"),
    # td (transfer dock) or tq (transfer queue): how their workers hand batches to each other.
    "rl_config.data_strategy": _entry(_TRANSFER_DOCK, memory=_DOCK_MEMORY),
    **{f"rl_config.transfer_queue_data_shard_{key}": _entry(_TRANSFER_DOCK, memory=_DOCK_MEMORY)
       for key in ("num", "port_base")},
    "rl_config.runtime_env_path": _entry(
        "the Ray runtime-env YAML their launcher reads (environment variables of its workers); the ranks here "
        "inherit the launching shell's environment: export them there",
        files=SAME + "a file read at launch there; here nothing reads it and nothing is written"),
    "rl_config.num_cpus_for_placement_group": _entry(
        "Ray CPUs reserved per device bundle of their placement group; the ranks here are placed by Ray with "
        "runtime.num_threads_per_rank threads each"),
    # Their separate reference/reward workers' devices, read only without use_integrated_worker (their launcher,
    # utils.compute_tps); integrated is the only mode here. ROLL's `reference` and `rewards` sections place roles.
    **{f"rl_config.{role}_resource": _entry(
        f"the {role} runs on the actor's devices in integrated mode (the only mode here), where MindSpeed-RL does not "
        f"read {role}_resource either; ROLL's {role if role == 'reference' else 'rewards'} section places it here")
       for role in ("reference", "reward")},
    "generate_config.torchair_graph": _entry(_NPU_KERNEL, memory=_KERNEL_MEMORY),
    "generate_config.ascend_scheduler_config_enabled": _entry(_NPU_KERNEL),
    "generate_config.num_scheduler_steps": _entry("vLLM V1 schedules one step at a time", (1,)),
    "model.*.moe_grouped_gemm": _entry(_MOE_KERNEL, memory=_KERNEL_MEMORY),
    "model.*.moe_permutation_async_comm": _entry(_MOE_KERNEL, memory=_KERNEL_MEMORY),
    "model.*.moe_token_dispatcher_type": _entry(_MOE_KERNEL, memory=_KERNEL_MEMORY),
    "model.*.use_fused_moe_token_permute_and_unpermute": _entry(_MOE_KERNEL, memory=_KERNEL_MEMORY),
    "model.*.use_rotary_position_embeddings": _entry("every model here uses RoPE (rotary_base)", (True,)),
    "model.*.spec": _entry("the layers are built from the model block and the checkpoint's config.json"),
    # MindSpeed-LLM reads seq_aux only under its own router types (group_limited_greedy; none with
    # moe_aux_loss_coeff > 0), never under Megatron's seq_aux_loss, and its loss there adds the expert bias to
    # the scores, which Megatron's seq_aux_loss does not: true has no equivalent here, false is its default.
    "model.*.seq_aux": _entry(
        "MindSpeed-LLM's switch for the sequence-wise balance loss of its own router types; the loss here is "
        "moe_router_load_balancing_type (seq_aux_loss: per sequence)", (False,)),
}
# Their MegatronConfig's arguments with no counterpart here (config/their_keys.py), built with the same _entry.
NO_EFFECT_KEYS.update(megatron_argument_entries(_entry, SAME, DIFFERS))

# Keys MindSpeed-RL's model blocks carry and it reads as megatron_training's (it merges the selected block
# into the Megatron arguments): here they move there, from the selected block, unless megatron_training sets them.
MEGATRON_KEYS_IN_MODEL_BLOCKS = ("attention_softmax_in_fp32", "no_gradient_accumulation_fusion", "tokenizer_type")


def drop_no_effect_keys(tree: dict[str, Any], *, strict: bool) -> tuple[list[str], list[ConfigError]]:
    """Remove every no-effect key from ``tree``. Returns ``key (why)`` for each harmless one, and an error for
    each that is not harmless (a value with an effect, or any with ``strict``)."""
    notices, errors = [], []
    for pattern, entry in NO_EFFECT_KEYS.items():
        for key in present_keys(tree, pattern.split(".")):
            if entry.applies is not None and entry.applies(tree, _get(tree, key)):
                continue
            value = _pop(tree, key)
            if entry.values is not None and value not in entry.values:
                allowed = " or ".join(repr(allowed) for allowed in entry.values)
                errors.append(ConfigError(key, f"only {allowed} works here ({entry.why}), got {value!r}"))
            elif strict:
                errors.append(ConfigError(key, f"no effect on this engine ({entry.why}); remove it or set "
                                               f"runtime.strict_keys=false"))
            else:
                notices.append(entry.notice(key))
    # MindSpeed-RL's msprobe section: one notice for the whole section while its switch is off (config/msprobe.py).
    section_notices, section_errors = drop_msprobe_section(tree, strict=strict)
    return notices + section_notices, errors + section_errors


def lift_megatron_keys(tree: dict[str, Any]) -> list[ConfigError]:
    """Move MEGATRON_KEYS_IN_MODEL_BLOCKS from the model blocks to megatron_training, as MindSpeed-RL reads
    them: the selected block's value is used unless megatron_training sets one, which must then agree."""
    blocks = tree.get("model")
    training = tree.get("megatron_training")
    if not isinstance(blocks, dict) or not isinstance(training, dict):
        return []
    selected = training.get("model")
    errors = []
    for name, block in blocks.items():
        for key in [key for key in MEGATRON_KEYS_IN_MODEL_BLOCKS if isinstance(block, dict) and key in block]:
            value = block.pop(key)
            if name != selected:
                continue
            error = lift_value(value, training, key, source_key=f"model.{name}.{key}",
                               target_name=f"megatron_training.{key}")
            errors += [error] if error else []
    return errors


def lift_value(value: Any, target: dict[str, Any], target_key: str, *, source_key: str,
               target_name: str) -> Optional[ConfigError]:
    """Put a value MindSpeed-RL reads from another place where this engine reads it; one already there must
    agree (else the error naming both)."""
    if target_key not in target:
        target[target_key] = value
        return None
    if target[target_key] != value:
        return ConfigError(source_key, f"is {value!r} but {target_name} is {target[target_key]!r}: one value, in "
                                       "either place")
    return None


def no_effect_notice(notices: list[str]) -> Optional[str]:
    """The one line printed at start, or None."""
    return f"[config] no effect on this engine: {', '.join(notices)}" if notices else None


def _parent(tree: Mapping[str, Any], key: str) -> tuple[Any, str]:
    *parents, last = key.split(".")
    node: Any = tree
    for part in parents:
        node = node[part]
    return node, last


def _get(tree: Mapping[str, Any], key: str) -> Any:
    node, last = _parent(tree, key)
    return node[last]


def _pop(tree: Mapping[str, Any], key: str) -> Any:
    node, last = _parent(tree, key)
    return node.pop(last)
