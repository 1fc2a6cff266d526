"""How a rank builds what it holds from the config: its distributed groups, the Megatron actor and reference,
the reward model, the vLLM engine, their offloadable states, the residency policy and the layouts of the weight push."""
from __future__ import annotations

import os
from typing import TYPE_CHECKING, Callable

import torch

from mindspeed_rl.config import GRPOConfig
from mindspeed_rl.config.tolerated import sequence_parallel_in_effect
from mindspeed_rl.models.checkpoint import load_hf_checkpoint

if TYPE_CHECKING:
    from mindspeed_rl.parallel.megatron_state import RankGroups


def init_distributed(accelerator, *, rank: int, world_size: int, config: GRPOConfig,
                     train_layout=None) -> RankGroups | None:
    """This rank's world; with a `train_layout` (a training rank) Megatron's groups over it and their RNG, returned
    as this rank's `RankGroups` for the engines and helpers that need them (None on a rank without a training
    layout). vLLM, under external_launcher, builds its own groups over the world it finds."""
    import torch.distributed as dist

    runtime = config.runtime
    dist.init_process_group(accelerator.distributed_backend, rank=rank, world_size=world_size,
                            timeout=set_collective_timeout(runtime.collective_timeout_seconds))
    if train_layout is None:
        return None
    from mindspeed_rl.parallel import megatron_state

    groups = megatron_state.initialize(train_layout, rank=rank, world_size=world_size,
                                       timeout_minutes=max(1, round(runtime.collective_timeout_seconds / 60)))
    accelerator.seed_model_parallel_rng(config.megatron_training.seed)
    return groups


def set_collective_timeout(seconds: float):
    """Every process group of this process times out after `seconds`: the world, Megatron's groups
    (passed explicitly) and vLLM's, which are made without a timeout and so take torch's default."""
    from datetime import timedelta

    from torch.distributed import distributed_c10d

    timeout = timedelta(seconds=seconds)
    distributed_c10d.default_pg_timeout = timeout
    if hasattr(distributed_c10d, "default_pg_nccl_timeout"):
        distributed_c10d.default_pg_nccl_timeout = timeout
    return timeout


def model_options(config: GRPOConfig, accelerator, *, announce: bool):
    """The config's model knobs, with the fused kernels this device can run; says once which it cannot."""
    from mindspeed_rl.accelerator.kernels import KernelRequest
    from mindspeed_rl.models.qwen2 import ModelOptions

    mt = config.megatron_training
    kernels = accelerator.resolve_kernels(KernelRequest.from_megatron_training(mt))
    message = kernels.message(accelerator.name)
    if message and announce:
        print(message, flush=True)
    return ModelOptions(sequence_parallel=sequence_parallel_in_effect(config), attention_dropout=mt.attention_dropout,
                        hidden_dropout=mt.hidden_dropout, attention_softmax_in_fp32=mt.attention_softmax_in_fp32,
                        kernel_fields=kernels.transformer_fields, logprob_chunk_tokens=mt.logprob_chunk_tokens,
                        packed_sequences=config.rl_config.use_remove_padding,
                        recompute_granularity=config.actor_config.recompute_granularity,
                        recompute_method=config.actor_config.recompute_method,
                        recompute_num_layers=config.actor_config.recompute_num_layers,
                        **_moe_load_balancing(config))


def _moe_load_balancing(config: GRPOConfig) -> dict:
    """The selected model block's router load balancing (MindSpeed-RL keeps it in the model block)."""
    block = config.selected_model
    if block is None or block.moe_router_load_balancing_type in (None, "none"):
        return {}
    return dict(moe_router_load_balancing_type=block.moe_router_load_balancing_type,
                moe_aux_loss_coeff=block.moe_aux_loss_coeff or 0.0)


def params_dtype(config: GRPOConfig) -> torch.dtype:
    return torch.bfloat16 if config.megatron_training.bf16 else torch.float32


def train_spec(config: GRPOConfig, spec):
    """The model as the actor's training layout holds it: with its pipeline stages (actor_config.num_layer_list),
    which the Megatron model, the HF mapping and the weight push's plan all read from the spec."""
    from dataclasses import replace

    return replace(spec, pipeline_stage_layers=config.actor_config.pipeline_stage_layers)


def build_actor(config: GRPOConfig, accelerator, options, *, parallel: RankGroups, checkpoint,
                progress: Callable[[str], None]):
    """The actor (with Megatron's optimizer) from the HF checkpoint `checkpoint` = (spec, state), on this rank's
    place `parallel` in the training layout (init_distributed's); it replays or measures vLLM's routes where the
    run records them (records_routes)."""
    from mindspeed_rl.engines.megatron_engine import MegatronEngine
    from mindspeed_rl.workers.actor_steps import optimizer_settings

    spec, state = checkpoint
    actor = MegatronEngine(spec=train_spec(config, spec), hf_state=state, params_dtype=params_dtype(config),
                           accelerator=accelerator, parallel=parallel, optimizer=optimizer_settings(config),
                           options=options, lora=lora_settings(config), lora_filter=config.actor_config.lora_filter,
                           routing_replay=config.rl_config.routing_replay if records_routes(config, spec) else None)
    if not config.uses_reference:
        progress("Megatron actor built (no reference: init_kl_coef is 0)")
    elif config.reference_is_backbone:
        progress("Megatron actor built with LoRA adapters (the reference is its backbone: share_backbone)")
    else:
        progress("Megatron actor built")
    return actor


def build_reference(config: GRPOConfig, accelerator, options, *, parallel: RankGroups, checkpoint,
                    progress: Callable[[str], None]):
    """The reference model (no optimizer) from `checkpoint` = (spec, state), in the actor's layout (`parallel`)."""
    from mindspeed_rl.engines.megatron_engine import MegatronEngine

    spec, state = checkpoint
    reference = MegatronEngine(spec=train_spec(config, spec), hf_state=state, params_dtype=params_dtype(config),
                               accelerator=accelerator, parallel=parallel, optimizer=None, options=options)
    progress("Megatron reference built")
    return reference


def lora_settings(config: GRPOConfig):
    """actor_config's LoRA, or None without one."""
    from mindspeed_rl.models.lora import lora_settings_of

    return lora_settings_of(config.actor_config, seed=config.megatron_training.seed)


def build_reward_model(config: GRPOConfig, accelerator, options, *, parallel: RankGroups,
                       progress: Callable[[str], None]):
    """The reward model of rewards.<name>.model_path (the driver resolved the path), in the actor's TP/PP
    layout (`parallel`) and dtype; None without one."""
    if config.reward_model is None:
        return None
    from mindspeed_rl.engines.reward_model import RewardModelEngine

    model_dir = config.reward_model[1].model_path
    spec, state = load_hf_checkpoint(model_dir)
    engine = RewardModelEngine(spec=spec, hf_state=state, accelerator=accelerator, parallel=parallel,
                               model_dir=model_dir, params_dtype=params_dtype(config), options=options)
    progress("Megatron reward model built")
    return engine


def records_routes(config: GRPOConfig, spec) -> bool:
    """Whether vLLM records the experts it routes each token to: for routing replay, and for the mismatch ledger's
    routing share on an MoE model."""
    rl = config.rl_config
    return rl.routing_replay or (rl.mismatch_ledger and spec.is_moe)


def build_inference_model(config: GRPOConfig, accelerator, *, model_dir: str):
    from mindspeed_rl.engines.vllm_engine import VLLMEngine, VLLMEngineConfig
    from mindspeed_rl.models.checkpoint import read_spec

    gen = config.generate_config
    return VLLMEngine(VLLMEngineConfig(
        model_dir=model_dir, tensor_parallel_size=gen.infer_tensor_parallel_size,
        pipeline_parallel_size=gen.infer_pipeline_parallel_size,
        data_parallel_size=config.infer_data_parallel_size, dtype=gen.dtype,
        max_model_len=gen.max_model_len, max_num_seqs=gen.max_num_seqs,
        max_num_batched_tokens=gen.max_num_batched_tokens or gen.max_model_len * gen.max_num_seqs,
        seed=config.megatron_training.seed, enforce_eager=gen.enforce_eager,
        gpu_memory_utilization=gen.gpu_memory_utilization, cpu_kvcache_space_gb=gen.cpu_kvcache_space_gb,
        on_cpu=accelerator.is_host, enable_expert_parallel=gen.infer_expert_parallel_size > 1,
        trust_remote_code=gen.trust_remote_code, enable_prefix_caching=gen.enable_prefix_caching,
        return_routed_experts=records_routes(config, read_spec(model_dir)),
        # EPLB's counts directory, relative to where the run starts (engines/eplb_counts.py).
        eplb_token_save_path=os.path.abspath(gen.eplb_token_save_path) if gen.eplb_token_collects else None,
    ))


def bucket_bytes(config: GRPOConfig) -> int:
    return int(config.generate_config.resharding_bucket_mb * 2**20)
