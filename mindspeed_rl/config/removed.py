"""MindSpeed-RL keys that this engine does not have, and why.

Users bring MindSpeed-RL YAMLs; a key that would be accepted and then do nothing is worse than an
error, so these are not in the schema. The loader looks for them before the schema does, so the
message says why instead of only "unknown key". `*` stands for any one key (a model block's name).
"""

from collections.abc import Mapping
from typing import Any

from omegaconf.errors import OmegaConfBaseException

from mindspeed_rl.config.errors import ConfigError

_INTEGRATED = (
    "in integrated mode (rl_config.use_integrated_worker, the only mode of this hybrid engine) the "
    "reference and reward models reuse actor_config"
)
_KERNEL_IN_MEGATRON_TRAINING = (
    "a kernel option, not the architecture: set megatron_training.{name} (the engine reads it there)"
)
_MOE_KERNELS = (
    "the engine chooses the MoE kernels (per-expert linears and the allgather token dispatcher, which "
    "every backend supports)"
)

REMOVED_KEYS: dict[str, str] = {
    "ref_config": _INTEGRATED,
    "reward_config": _INTEGRATED,
    "megatron_training.seq_length": (
        "lengths are bounded by rl_config.max_prompt_length (prompts) and generate_config.max_model_len "
        "(prompt + response)"
    ),
    "megatron_training.init_method_std": "weights always come from the HF checkpoint, nothing is initialised",
    "megatron_training.distributed_backend": "the accelerator picks gloo/nccl/hccl from the device",
    "megatron_training.no_shared_storage": (
        "there is nothing to share between nodes: data is read by the driver and checkpoints are issue 11"
    ),
    "megatron_training.full_shuffle_instruction_dataset": (
        "there are no instruction-dataset blends; megatron_training.no_shuffle and seed set the prompt order"
    ),
    "megatron_training.reuse_fp32_param": "an NPU memory optimisation of MindSpeed that this engine does not have",
    "rl_config.guarantee_order": "rollouts run in the driver's order; there is no asynchronous dispatch to order",
    "rl_config.blocking": "every phase is a blocking call of the integrated worker",
    "rl_config.gamma": "GAE is not implemented: rl_config.adv_estimator is group_norm only",
    "rl_config.lam": "GAE is not implemented: rl_config.adv_estimator is group_norm only",
    "rl_config.num_cpus_for_local_task": (
        "rule rewards run in the driver process, or on rewards.<name>.world_size CPU workers that reserve no CPU"
    ),
    "model.*.attention_softmax_in_fp32": _KERNEL_IN_MEGATRON_TRAINING.format(name="attention_softmax_in_fp32"),
    "model.*.no_gradient_accumulation_fusion": _KERNEL_IN_MEGATRON_TRAINING.format(
        name="no_gradient_accumulation_fusion"
    ),
    "model.*.tokenizer_type": "not the architecture: set megatron_training.tokenizer_type",
    "model.*.moe_grouped_gemm": _MOE_KERNELS,
    "model.*.moe_permutation_async_comm": _MOE_KERNELS,
    "model.*.moe_token_dispatcher_type": _MOE_KERNELS,
}


def removed_key_errors(cfg: Mapping[str, Any]) -> list[ConfigError]:
    """A ConfigError ``<key>: not supported: <reason>; remove it`` for every removed key present."""
    return [
        ConfigError(key, f"not supported: {reason}; remove it")
        for pattern, reason in REMOVED_KEYS.items()
        for key in _present_keys(cfg, pattern.split("."))
    ]


def _present_keys(node: Any, parts: list[str], prefix: str = "") -> list[str]:
    if not isinstance(node, Mapping):
        return []
    head, rest = parts[0], parts[1:]
    names = [str(name) for name in node] if head == "*" else ([head] if head in node else [])
    found = []
    for name in names:
        key = f"{prefix}.{name}" if prefix else name
        # A leaf is found by its presence alone: its value may be missing (???) or an interpolation.
        found += [key] if not rest else _present_keys(_child(node, name), rest, key)
    return found


def _child(node: Mapping[str, Any], name: str) -> Any:
    try:
        return node[name]
    except OmegaConfBaseException:
        return None  # an unresolvable section: the schema step reports it
