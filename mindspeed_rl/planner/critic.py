"""PPO's critic in the plan: its inputs from critic_config, its three state groups and its update's activations on
the ranks that hold it, and its line of the report. The planner asks this module; nothing else of the planner
knows the critic."""
from __future__ import annotations

from pathlib import Path

from mindspeed_rl.memory.residency import CRITIC_GRADS, CRITIC_OPTIMIZER, CRITIC_PARAMS
from mindspeed_rl.planner.activations import activation_bytes
from mindspeed_rl.planner.inputs import PlanInputs
from mindspeed_rl.planner.params import stage_critic_bytes

CRITIC_ACTIVATIONS = "critic_activations"  # the critic's update's; drawn as activations in its phase


def critic_inputs(config, load_architecture) -> dict:
    """PlanInputs' critic fields: its architecture from critic_config.load's config.json where that is an HF
    directory on this machine (else the actor's; `load_architecture(path, key)` reads one), its micro-batch size and
    recompute."""
    critic = config.critic_config
    if critic is None:
        return {}
    path = Path(critic.load) / "config.json" if critic.load else None
    arch = load_architecture(path, "critic_config.load") if path is not None and path.is_file() else None
    return dict(critic_arch=arch, critic_micro_batch_size=critic.micro_batch_size,
                critic_recompute=(critic.recompute_granularity, critic.recompute_method, critic.recompute_num_layers),
                critic_world_size=config.critic_world_size if config.critic_has_own_devices else 0)


def critic_states(inputs: PlanInputs, c: dict, *, on_this_rank: bool) -> dict[str, int]:
    """The critic's three state groups and its update's activations (0 without a critic, or on the training ranks
    of a critic with devices of its own)."""
    if not inputs.policy.has_critic or not on_this_rank:
        return {CRITIC_PARAMS: 0, CRITIC_GRADS: 0, CRITIC_OPTIMIZER: 0, CRITIC_ACTIVATIONS: 0}
    critic = inputs.for_critic()
    state = stage_critic_bytes(critic.arch, tp=inputs.tp, pp=inputs.pp, pp_rank=c["pp_rank"], dp_cp=critic.dp_cp,
                               bf16=inputs.bf16, distributed_optimizer=inputs.distributed_optimizer,
                               dp_cp_rank=c["dp_cp_rank"])
    return {CRITIC_PARAMS: state.params, CRITIC_GRADS: state.grads, CRITIC_OPTIMIZER: state.optimizer,
            CRITIC_ACTIVATIONS: activation_bytes(critic, c["pp_rank"], logits=False)}


def critic_activations(inputs: PlanInputs, rank: int, states: dict[str, int], *, own_devices: bool) -> dict[str, int]:
    """The critic update's activations of plan rank `rank` at `inputs`' sequence length (none where it holds no
    critic); ranks on the critic's own devices are numbered after the training ranks."""
    if not states.get(CRITIC_ACTIVATIONS):
        return {}
    critic = inputs.for_critic()
    index = rank - inputs.world_size if own_devices else rank
    return {CRITIC_ACTIVATIONS: activation_bytes(critic, critic.rank_coordinates(index)["pp_rank"], logits=False)}


def critic_layout_lines(i: PlanInputs) -> list[str]:
    """The report's line on the critic: where it is and what stays there."""
    if not i.policy.has_critic:
        return []
    if not i.critic_world_size:
        return ["  critic: on the training ranks, taking turns (its states on the device in its two phases only)"]
    first, last = i.world_size, i.world_size + i.critic_world_size - 1
    numbers = f"rank {first}" if first == last else f"ranks {first}-{last}"
    return [f"  critic: {i.critic_world_size} device(s) of its own ({numbers} below), TP{i.tp} x PP{i.pp} x "
            f"DP{i.for_critic().dp_cp}; its states stay there in every phase"]


def critic_devices_text(i: PlanInputs) -> str:
    """The layout header's addition for a critic on devices of its own."""
    return f" + {i.critic_world_size} of the critic's" if i.critic_world_size else ""
