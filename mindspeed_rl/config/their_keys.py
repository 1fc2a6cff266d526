"""The rest of MindSpeed-RL's config classes (their config_cls/{rl_config,generate_config,megatron_config}.py; copies in
tests/data/mindspeed_rl_config_cls), key by key:

- Megatron/MindSpeed arguments of their MegatronConfig that this engine has no counterpart for: entries of the one
  no-effect table (config/no_effect.py builds them with its `_entry`, so each says why no value, no byte of memory and
  no file changes, or how memory/files differ), accepted in megatron_training and in actor_config alike, because
  MindSpeed-RL merges the two sections into one MegatronConfig.
- The multimodal keys (Qwen2.5-VL): at their defaults accepted silently; any other value is one line saying multimodal
  models are not supported yet.
- generate_config.tokenizer_name_or_path (one tokenizer for Megatron and vLLM) and generate_config.data_parallel_size
  (a derived size, checked against the inference layout).
"""
from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

from mindspeed_rl.errors import ConfigError

# The two sections MindSpeed-RL merges into one MegatronConfig ({**megatron_training, **actor_config}).
MEGATRON_SECTIONS = ("megatron_training", "actor_config")
_NPU_KERNEL = "an NPU kernel or communication-overlap choice of MindSpeed; the values computed are the same"
_COMM_OVERLAP = ("how Megatron's DDP schedules the gradient reduce / parameter gather; the same sums reach the "
                 "optimizer")
_READ_BY_NOTHING = "read by nothing in MindSpeed-RL's source or its RL loops"
_SFT_DATA = ("a MindSpeed-LLM fine-tuning dataset option; MindSpeed-RL's prompt datasets do not read it, nor do "
             "this engine's (megatron_training.data_path, map_keys)")
_NO_LLAMA3_ROPE = "Llama-3.1 RoPE scaling (rope_scaling_type llama3), which no model here has; null only"


def megatron_argument_entries(entry: Callable[..., Any], same: str, differs: str) -> dict[str, Any]:
    """The no-effect entries of their MegatronConfig's arguments, for both sections. `entry` is no_effect._entry,
    `same`/`differs` its reason prefixes (passed in: no_effect imports this module)."""
    by_key = {**_run_and_data_entries(entry, same), **_kernel_and_memory_entries(entry, same, differs)}
    entries = {f"{section}.{key}": value for section in MEGATRON_SECTIONS for key, value in by_key.items()}
    # Their model blocks are merged into the same MegatronConfig; the RoPE-scaling keys live there in model files.
    entries.update({f"model.*.{key}": by_key[key]
                    for key in ("low_freq_factor", "high_freq_factor", "original_max_position_embeddings")})
    # No-op layers are read from actor_config (config/noop_layers.py); megatron_training's default says none.
    entries["megatron_training.noop_layers"] = entry("no-op layers are read from actor_config.noop_layers; null only",
                                                     (None,))
    return entries


def _run_and_data_entries(entry: Callable[..., Any], same: str) -> dict[str, Any]:
    """Their model-shape, data, evaluation, checkpoint and run switches."""
    return {
        "low_freq_factor": entry(_NO_LLAMA3_ROPE, (None,)),
        "high_freq_factor": entry(_NO_LLAMA3_ROPE, (None,)),
        "original_max_position_embeddings": entry(_NO_LLAMA3_ROPE, (None,)),
        "log_throughput": entry("Megatron-LM's training_log line, which MindSpeed-RL's loop never calls; throughput "
                                "here is in the metrics (timing/*, rl_config.log_max_throughput)"),
        "eval_iters": entry("sizes MindSpeed-LLM's validation split, which no RL loop of theirs reads; evaluation here "
                            "is rl_config.eval_interval on megatron_training.eval_data_path"),
        "eval_interval": entry("MindSpeed-LLM's validation cadence, which no RL loop of theirs reads; evaluation here "
                               "is rl_config.eval_interval"),
        "is_instruction_dataset": entry(_SFT_DATA),
        "variable_seq_lengths": entry("Megatron's variable-shape pipeline messages; sequences here always travel with "
                                      "their own lengths"),
        "num_layers_per_virtual_pipeline_stage": entry(
            "interleaved (virtual) pipeline stages are not supported here; null only", (None,)),
        "pad_to_multiple_of": entry("MindSpeed-RL overwrites it with TP x CP whatever is written "
                                    "(config_cls/megatron_config.py), so no written value is read there either"),
        "dataloader_type": entry("Megatron's sampler kind; prompts are read in one pass per epoch, shuffled by "
                                 "megatron_training.seed unless no_shuffle (their single); null or single only",
                                 (None, "single")),
        "enable_high_availability": entry("MindIO's high availability (NPU); a failed run here restarts from its "
                                          "checkpoints with runtime.max_restarts; false only", (False,)),
        "reset_position_ids": entry(_SFT_DATA + "; packed RL samples restart their positions at each sample, there "
                                                "(use_remove_padding) and here"),
        "optimizer": entry("Megatron's Adam (AdamW with weight_decay) is the optimizer here; adam only", ("adam",)),
        "do_sample": entry("MindSpeed-LLM's text-generation option; rollouts here are vLLM's "
                           "(generate_config.sampling_config)"),
        "use_kv_cache": entry("MindSpeed-LLM's text-generation option; vLLM's KV cache is sized by generate_config",
                              memory=same + "vLLM's KV cache is sized by generate_config, there and here"),
        "use_tp_pp_dp_mapping": entry("the rank order of the parallel groups: false is Megatron's tp-cp-ep-dp-pp, "
                                      "which this engine uses; false only", (False,)),
        "log_interval": entry("MindSpeed-RL's preprocessing progress lines; the run's log cadence here is "
                              "runtime.log_interval"),
        "load_checkpoint_loosely": entry("checkpoints load strictly here (every parameter must match); false only",
                                         (False,)),
        "tokenizer_not_use_fast": entry("the tokenizer here is the checkpoint's fast (HF tokenizers) one; false only",
                                        (False,)),
        "tokenizer_padding_side": entry("the side MindSpeed-LLM's fine-tuning collator pads; RL samples here carry "
                                        "their own lengths and masks, whatever the side"),
        "num_workers": entry("DataLoader worker processes; the same prompts in the same order"),
        "skip_train": entry("Megatron-LM's evaluation-only switch; runs here train; false only", (False,)),
        "vocab_extra_ids": entry("T5's sentinel tokens; the vocabulary here is the checkpoint tokenizer's; 0 only",
                                 (0,)),
        "algorithm": entry(_READ_BY_NOTHING + "; the algorithm is rl_config.adv_estimator and the CLI "
                                              "(cli/train_grpo.py, train_dapo.py, train_ppo.py)"),
    }


def _kernel_and_memory_entries(entry: Callable[..., Any], same: str, differs: str) -> dict[str, Any]:
    """Their communication schedules, NPU kernels and memory options: the values computed are the same."""
    kernel_memory = (same + "a kernel's transient workspace there; here the plain path's tensors, which the planner "
                            "counts")
    return {
        "no_bias_dropout_fusion": entry("a fused bias-dropout kernel; the layers here add the bias and drop out "
                                        "unfused (the same values)", memory=kernel_memory),
        "ddp_bucket_size": entry(_COMM_OVERLAP, memory=same + "the gradient buffer is whole either way; buckets are "
                                                              "views of it"),
        "overlap_grad_reduce": entry(_COMM_OVERLAP),
        "overlap_param_gather": entry(_COMM_OVERLAP),
        "no_check_for_nan_in_loss_and_grad": entry("Megatron's NaN check in the gradient reduce stops a run, never "
                                                   "changes a value"),
        "accumulate_allreduce_grads_in_fp32": entry(
            "gradients are accumulated and reduced in fp32 here (grad_reduce_in_fp32), as Megatron-LM forces for bf16 "
            "there", memory=same + "fp32 gradient buffers, there (bf16 forces them) and here; the planner counts them"),
        "pretrained_checkpoint": entry("their reference/reward workers' second checkpoint key; the checkpoint here is "
                                       "actor_config.load (or the HF checkpoint); null only", (None,)),
        "npu_deterministic": entry("MindSpeed's deterministic NPU kernels are not switched on here; false only",
                                   (False,)),
        "recompute_activation_function": entry(
            "MindSpeed recomputes the MLP activation in the backward; the gradients are the same",
            memory=differs + "MindSpeed keeps no MLP activation output; here it is kept (recompute_granularity saves "
                             "memory instead), and the planner counts it"),
        "swap_attention": entry(
            "MindSpeed swaps attention activations to host memory between forward and backward; the values are the "
            "same", memory=differs + "there the attention activations wait in host memory; here they stay on the "
                                     "device (recompute_granularity saves memory instead), and the planner counts "
                                     "them"),
        "ai_framework": entry("MindSpeed-RL's MindSpore backend; the engine here is PyTorch; null only", (None,)),
        "use_cp_send_recv_overlap": entry("MindSpeed's ring-attention CP overlap; context parallelism here gathers "
                                          "each layer's keys and values (the same attention)", memory=kernel_memory),
        "use_fused_ring_attention_update": entry("MindSpeed's fused ring-attention update; context parallelism here "
                                                 "gathers each layer's keys and values (the same attention)",
                                                 memory=kernel_memory),
        **{key: entry(_NPU_KERNEL, memory=kernel_memory)
           for key in ("use_ascend_coc", "coc_mode", "coc_parallel_num", "coc_fused_kernel")},
        "transformer_impl": entry("the layer implementation: Megatron's local layers here, their default; local only",
                                  ("local",)),
    }


# Their multimodal keys (Qwen2.5-VL: a ViT part, image embeddings, per-prompt media limits) and their defaults.
MULTIMODAL_DEFAULTS: dict[str, Any] = {
    "rl_config.is_multimodal": False,
    "rl_config.vit_resource": None,
    "rl_config.vit_forward_micro_batch_size": None,
    "rl_config.colocate_actor_and_vit": False,
    "rl_config.reuse_image_embeds": False,
    "generate_config.limit_mm_image_per_prompt": 1,
    "generate_config.limit_mm_video_per_prompt": 0,
    **{f"{section}.mm_model": None for section in MEGATRON_SECTIONS},
}
MULTIMODAL_MESSAGE = "multimodal models (Qwen2.5-VL) are not supported yet"


def multimodal_errors(tree: dict[str, Any]) -> list[ConfigError]:
    """Remove the multimodal keys: silently at their defaults (a text-only run of theirs), else ONE error naming
    the first key set otherwise and listing the rest."""
    changed = []
    for key, default in MULTIMODAL_DEFAULTS.items():
        section, name = key.split(".")
        node = tree.get(section)
        if isinstance(node, dict) and name in node and node.pop(name) != default:
            changed.append(key)
    if not changed:
        return []
    also = f" (also set: {', '.join(changed[1:])})" if changed[1:] else ""
    return [ConfigError(changed[0], f"{MULTIMODAL_MESSAGE}{also}; leave the multimodal keys at their defaults")]


# Their GenerateConfig's default: a placeholder nothing of theirs reads (their vLLM engine reads megatron_training's).
TOKENIZER_PLACEHOLDER = "/path/to/tokenizer"


def lift_generate_tokenizer(tree: dict[str, Any]) -> list[ConfigError]:
    """generate_config.tokenizer_name_or_path: MindSpeed-RL's vLLM engine tokenizes with megatron_training's
    tokenizer (workers/actor_hybrid_worker.py), and so does this engine: one tokenizer for both. The key is accepted
    when it names the same path (or is their placeholder default) and refused when it names another."""
    generate, training = tree.get("generate_config"), tree.get("megatron_training")
    if not isinstance(generate, dict) or "tokenizer_name_or_path" not in generate:
        return []
    value = generate.pop("tokenizer_name_or_path")
    if value == TOKENIZER_PLACEHOLDER or not isinstance(training, dict):
        return []
    if "tokenizer_name_or_path" not in training:
        training["tokenizer_name_or_path"] = value
        return []
    training_value = training["tokenizer_name_or_path"]
    if _same_path(value, training_value):
        return []
    return [ConfigError("generate_config.tokenizer_name_or_path",
                        f"must equal megatron_training.tokenizer_name_or_path ({training_value!r}), got {value!r}: one "
                        "tokenizer serves Megatron and vLLM (MindSpeed-RL's vLLM engine reads megatron_training's "
                        "too); leave it out or set the same path")]


def _same_path(first: Any, second: Any) -> bool:
    if isinstance(first, str) and isinstance(second, str) and first and second:
        return os.path.normpath(first) == os.path.normpath(second)
    return first == second


def check_generate_data_parallel_size(config) -> None:
    """generate_config.data_parallel_size: MindSpeed-RL derives it (actor devices / (infer TP x PP)) and overwrites
    what is written; here a value written must equal the inference layout's DP, else the run would not be the one
    the user sized. `config` is the GRPOConfig."""
    written = config.generate_config.data_parallel_size
    if written is not None and written != config.infer_data_parallel_size:
        gen = config.generate_config
        raise ConfigError("generate_config.data_parallel_size",
                          f"must equal the inference data-parallel size {config.infer_data_parallel_size} (inference "
                          f"devices {config.infer_world_size} / (infer_tensor_parallel_size "
                          f"{gen.infer_tensor_parallel_size} x infer_pipeline_parallel_size "
                          f"{gen.infer_pipeline_parallel_size})), got {written}; or leave it null (derived)")


def their_key_errors(tree: dict[str, Any]) -> list[ConfigError]:
    """Before the schema: the multimodal keys (removed; one error when any is set), generate_config's tokenizer
    (removed when it agrees with megatron_training's), and packing's requirements on two MegatronConfig flags."""
    return multimodal_errors(tree) + lift_generate_tokenizer(tree) + packing_flag_errors(tree)


def packing_flag_errors(tree: dict[str, Any]) -> list[ConfigError]:
    """MindSpeed-RL's validate_config: rl_config.use_remove_padding needs reset_attention_mask true, and at PP > 1
    no_pad_to_seq_lengths true. Without packing either value computes the same (config/no_effect.py)."""
    rl = tree.get("rl_config")
    if not (isinstance(rl, dict) and rl.get("use_remove_padding") is True):
        return []
    merged = {key: value for section in MEGATRON_SECTIONS if isinstance(tree.get(section), dict)
              for key, value in tree[section].items()}
    errors = []
    for section in MEGATRON_SECTIONS:
        values = tree.get(section) if isinstance(tree.get(section), dict) else {}
        if values.get("reset_attention_mask") is False:
            errors.append(ConfigError(f"{section}.reset_attention_mask", "must be true with rl_config.use_remove_padding "
                                                                         "(as MindSpeed-RL's validate_config requires)"))
        if values.get("no_pad_to_seq_lengths") is False and (merged.get("pipeline_model_parallel_size") or 1) > 1:
            errors.append(ConfigError(f"{section}.no_pad_to_seq_lengths", "must be true with rl_config."
                                                                          "use_remove_padding at PP > 1 (as "
                                                                          "MindSpeed-RL's validate_config requires)"))
    return errors
