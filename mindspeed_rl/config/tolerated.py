"""Contradictions MindSpeed-RL's recipes carry and their stack runs anyway: here they run too, each said in one warning
line stating the exact behaviour, instead of a refusal (a refusal stays for what would crash or silently change
results). Also the keys this engine plans for but runs its own way (planner/from_config.py planned_for_their_stack),
each said in one line. `config` is the validated GRPOConfig (not imported: it imports this module's users)."""
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
    """`[config] warning: ...` for each contradiction this config carries, with what the run does about it,
    `[config] deprecated: ...` for each older verl name it reads (config/rollout_correction.py), then `[config] note:
    ...` for each key planned for but run this engine's way."""
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
    deprecated = [f"[config] deprecated: {line}" for line in config.rl_config.rollout_correction.deprecations]
    return ([f"[config] warning: {line}" for line in lines] + deprecated
            + [f"[config] note: {line}" for line in planned_for_lines(config)])


def planned_for_lines(config) -> list[str]:
    """The keys the planner counts for the user's devices while this engine computes the same its own way."""
    lines = []
    algo = config.actor_config.context_parallel_algo
    if algo is not None and config.actor_config.context_parallel_size > 1:
        lines.append(f"actor_config.context_parallel_algo: {algo} is planned for (cli/plan.py counts its buffers on an "
                     "accelerator); this engine's context parallelism gathers each layer's keys and values over the "
                     "CP ranks instead (the same attention; models/context_parallel.py)")
    if config.actor_config.moe_tp_extend_ep:
        lines.append("actor_config.moe_tp_extend_ep: true is planned for (cli/plan.py counts each TP rank's own s/TP "
                     "tokens dispatched to the experts, on an accelerator); this engine splits each expert over TP "
                     "instead (the same weights per rank, the same results)")
    if config.generate_config.expert_map_path:
        lines.append(f"generate_config.expert_map_path: {config.generate_config.expert_map_path} is planned for "
                     "(cli/plan.py counts the redundant experts' weights on the ranks the map puts them on, on an "
                     "accelerator); vLLM here places the experts evenly (num_experts / EP per rank) and holds no "
                     "redundant copies")
    return lines
