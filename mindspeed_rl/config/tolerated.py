"""Contradictions MindSpeed-RL's recipes carry and their stack runs anyway: here they run too, each said in one warning
line stating the exact behaviour, instead of a refusal (a refusal stays for what would crash or silently change
results). `config` is the validated GRPOConfig (not imported: it imports this module's users)."""
from __future__ import annotations


def sequence_parallel_in_effect(config) -> bool:
    """Megatron-LM turns sequence parallelism off when the tensor-parallel size is 1 (there is nothing to split the
    activations over): a recipe shrunk to TP1 keeps `sequence_parallel: true` and trains without it."""
    return config.megatron_training.sequence_parallel and config.actor_config.tensor_model_parallel_size > 1


def longest_sample_tokens(config) -> int:
    """A sample's most tokens: prompt + response, capped at generate_config.max_model_len (vLLM ends a response at
    max_model_len whatever max_tokens says, as in MindSpeed-RL)."""
    return min(config.rl_config.max_prompt_length + config.response_length_limit, config.generate_config.max_model_len)


def warning_lines(config) -> list[str]:
    """`[config] warning: ...` for each contradiction this config carries, with what the run does about it."""
    lines = []
    if config.megatron_training.sequence_parallel and not sequence_parallel_in_effect(config):
        lines.append("megatron_training.sequence_parallel: true at actor_config.tensor_model_parallel_size=1 trains "
                     "without it, as Megatron-LM does (there is no tensor-parallel group to split activations over)")
    prompt, response = config.rl_config.max_prompt_length, config.response_length_limit
    max_model_len = config.generate_config.max_model_len
    if prompt + response > max_model_len:
        lines.append(f"rl_config.max_prompt_length + {config.response_length_key} = {prompt} + {response} = "
                     f"{prompt + response} exceeds generate_config.max_model_len={max_model_len}: prompts longer than "
                     f"{max_model_len - response} tokens get a response budget of max_model_len - prompt (vLLM ends "
                     f"them there, as in MindSpeed-RL)")
    return [f"[config] warning: {line}" for line in lines]
