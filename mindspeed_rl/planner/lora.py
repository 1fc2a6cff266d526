"""LoRA in the plan (actor_config.lora_*, models/lora.py): the frozen backbone and the trained adapters of each
stage, and what adapters change in a layer's activations. The planner asks this module; the rest of it does not know
LoRA."""
from __future__ import annotations

from functools import lru_cache

from mindspeed_rl.planner.arch import Architecture
from mindspeed_rl.planner.params import Param, TrainStateBytes, _stage_params, stage_train_bytes, train_state_bytes


def lora_inputs(config) -> dict:
    """PlanInputs' LoRA fields (rank 0 and no targets: none)."""
    actor = config.actor_config
    return dict(lora_rank=actor.lora_r if actor.uses_lora else 0, lora_targets=tuple(actor.lora_target_modules))


def actor_train_bytes(inputs, c: dict) -> TrainStateBytes:
    """The actor's params, grads and Adam states on a rank at coordinates `c`: the whole model's, or with LoRA the
    frozen backbone's and the adapters'."""
    if inputs.lora_targets:
        return stage_lora_train_bytes(inputs.arch, tp=inputs.tp, pp=inputs.pp, pp_rank=c["pp_rank"],
                                      dp_cp=inputs.dp_cp, bf16=inputs.bf16,
                                      distributed_optimizer=inputs.distributed_optimizer, dp_cp_rank=c["dp_cp_rank"],
                                      rank=inputs.lora_rank, targets=inputs.lora_targets)
    return stage_train_bytes(inputs.arch, tp=inputs.tp, pp=inputs.pp, pp_rank=c["pp_rank"], ep=inputs.ep,
                             dp_cp=inputs.dp_cp, bf16=inputs.bf16, distributed_optimizer=inputs.distributed_optimizer,
                             dp_cp_rank=c["dp_cp_rank"])


def push_host_copy_bytes(inputs, inference_weight_bytes: int) -> int:
    """What LoRA's push keeps on the host (resharding/adapter_push.py): the rank's inference weights as the backbone
    was first pushed, restored from there before each push adds the adapters. None without LoRA."""
    return inference_weight_bytes if inputs.lora_targets else 0


def lora_first_stage(inputs, e: int, h_split: int, *, default: float) -> float:
    """The first stage's extra bytes per token: with LoRA the frozen embedding keeps nothing (cpu: 7 e h less, the
    unfused norms'), else `default`."""
    if not inputs.lora_targets:
        return default
    return -(7 if inputs.activation_profile == "cpu" else 1) * e * inputs.arch.hidden_size / h_split


def lora_layer_change(inputs: PlanInputs, e: int, h_split: int) -> float:
    """Bytes per token a LoRA layer keeps beyond the full-parameter one: each frozen linear's input not kept, each
    adapter's A output kept (and a column-parallel adapter's input gathered over sequence parallel)."""
    arch, t, h = inputs.arch, inputs.tp, inputs.arch.hidden_size
    linear_inputs = {"linear_qkv": (e * h / h_split, True), "linear_proj": (e * arch.q_width / t, False),
                     "linear_fc1": (e * h / h_split, True), "linear_fc2": (e * arch.intermediate_size / t, False)}
    change = 0.0
    if not inputs.lora_targets:
        return change
    for target, (input_bytes, column) in linear_inputs.items():
        if target not in inputs.lora_targets:
            change -= input_bytes
        else:
            change += e * inputs.lora_rank + (e * h - input_bytes if column else 0.0)
    return change



@lru_cache(maxsize=1024)
def stage_lora_train_bytes(arch: Architecture, *, tp: int, pp: int, pp_rank: int, dp_cp: int, bf16: bool,
                           distributed_optimizer: bool, dp_cp_rank: int, rank: int,
                           targets: tuple[str, ...]) -> TrainStateBytes:
    """The actor with LoRA (models/lora.py): the frozen backbone's shard (no DDP buffer, grads or optimizer state)
    plus the adapters of the stage's target linears, trained as params are: A [r, columns] and B [rows, r] of
    each target weight shard [rows, columns] (column-parallel [out/t, in], row-parallel [out, in/t]). No
    reference params: the reference is the backbone."""
    from mindspeed_rl.models.layouts import megatron_layout

    adapters = []
    for tensor in megatron_layout(arch.to_spec(), tp=tp, tp_rank=0, pp=pp, pp_rank=pp_rank):
        module = tensor.name.removesuffix(".weight")
        if tensor.name.endswith(".weight") and module.rsplit(".", 1)[-1] in targets:
            rows, columns = tensor.shape
            adapters += [Param(f"{module}.lora_A", rank * columns), Param(f"{module}.lora_B", rows * rank)]
    e = 2 if bf16 else 4
    frozen = sum(p.numel for p in _stage_params(arch, tp, pp, pp_rank, 1)) * e
    trained = train_state_bytes(tuple(adapters), bf16=bf16, distributed_optimizer=distributed_optimizer, dp_cp=dp_cp,
                                expert_dp=dp_cp, dp_cp_rank=dp_cp_rank, expert_dp_rank=dp_cp_rank)
    return TrainStateBytes(params=frozen, grads=trained.grads, optimizer=trained.optimizer, reference=0,
                           adapter_params=trained.params)
