"""DeepSeek-V3 (MLA with YaRN RoPE scaling, dense first layer, sigmoid group-limited routing with expert bias,
routed scaling, shared experts) on Megatron-core and vLLM, against transformers' DeepseekV3ForCausalLM.

One spawn of 2 gloo ranks, one live vLLM engine (infer TP=2, CPU_MLA backend) per rank. Per train
layout (TP2 with sequence parallel; PP2 = dense layer | MoE layer; CP2: MLA under context parallelism): Megatron's
logits equal HF's (< 1e-4 fp32; PP and CP: log-probs; and packed micro-batches' log-probs, THD through MLA),
a GRPO update's gradient under CP2 (padded and packed) equals the same update's at DP2 without CP, the HF -> Megatron -> HF export round trip is exact, the plan's push fills
every vLLM parameter (shapes checked), the fingerprint check passes, and vLLM's sampled-token log-probs
after the push equal Megatron's (< 1e-4), and the planner's Megatron shard (planner/params.py) is the live
engine's parameters, name for name and size for size.

The checkpoint holds a multi-token-prediction layer, as DeepSeek-V3's does: it is not read (RL trains the main
model). The checkpoint uses YaRN (factor 8 over 32 original positions, mscale 1 / mscale_all_dim 0.5, so the cos/sin
factor and the softmax scale both differ from 1): with plain RoPE instead, HF's logits move by 0.21, Megatron's
YaRN is within 1e-6 of HF's at TP1.

Runs where: 2 spawned processes (torch.multiprocessing), gloo; about 60 s on 2 loaded cores.
"""
import os

import torch
import torch.distributed as dist

from mindspeed_rl.parallel import megatron_state
from resharding_oracle import assert_vllm_logprobs_match_megatron, free_port, fused_experts, perturbed_state
from preloaded import spawn_ranks

YARN = dict(rope_type="yarn", factor=8.0, original_max_position_embeddings=32, beta_fast=32.0, beta_slow=1.0,
            mscale=1.0, mscale_all_dim=0.5)
IDS = torch.tensor([[5, 9, 6, 11, 7, 9, 8, 11, 3, 4], [4, 9, 4, 11, 3, 5, 6, 7, 12, 2]])


def _hf_logits(checkpoint: str, state: dict) -> torch.Tensor:
    from transformers import AutoConfig, AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(checkpoint), dtype=torch.float32).eval()
    hf.load_state_dict(fused_experts(state), strict=True)
    with torch.no_grad():
        return hf(IDS).logits


def _check_against_hf(engine, expected_logits, pp: int, cp: int = 1) -> None:
    from megatron.core import tensor_parallel

    if pp == 1 and cp == 1:  # full logits are visible without a pipeline and without CP's chunks
        with torch.no_grad(), engine.accelerator.megatron_context():
            logits = engine.module(IDS, torch.arange(IDS.shape[1]).expand_as(IDS), None)
            logits = tensor_parallel.gather_from_tensor_model_parallel_region(logits)
        assert (logits - expected_logits).abs().max().item() < 1e-4
    assert (_logprobs(engine) - _expected_logprobs(expected_logits)).abs().max().item() < 1e-4


def _expected_logprobs(logits: torch.Tensor) -> torch.Tensor:
    expected = torch.gather(torch.log_softmax(logits, -1)[:, 2:-1], 2, IDS[:, 3:].unsqueeze(-1)).squeeze(-1)
    expected[0, -1] = 0.0  # the first sample is a token shorter (causal: its other log-probs are the same)
    return expected


def _logprobs(engine, packing=None) -> torch.Tensor:
    from mindspeed_rl.protocol import RolloutBatch

    # Two samples of 9 and 10 tokens: packed, the second starts mid-row.
    batch = RolloutBatch.from_token_lists([r[:3].tolist() for r in IDS], [IDS[0, 3:-1].tolist(), IDS[1, 3:].tolist()],
                                          pad_id=0, response_width=IDS.shape[1] - 3)
    return engine.compute_logprobs(batch, micro_batch_size=2, temperature=1.0, packing=packing)


def _check_packed_against_hf(engine, expected_logits) -> None:
    """Packed micro-batches (rl_config.use_remove_padding, their DeepSeek recipes' setting): THD through MLA."""
    from mindspeed_rl.protocol import Packing

    got = _logprobs(engine, Packing(max_tokens=64))
    assert (got - _expected_logprobs(expected_logits)).abs().max().item() < 1e-4


def _push(spec, engine, rollout, train, infer, rank):
    from mindspeed_rl.resharding.fingerprint import verify_transfer
    from mindspeed_rl.models.layouts import parameter_shapes, vllm_layout
    from mindspeed_rl.resharding.plan import build_plan
    from mindspeed_rl.resharding.transfer import Transfer, destination_dtypes

    live = rollout.named_weights()
    layout = parameter_shapes(vllm_layout(spec, tp=infer.tp, tp_rank=infer.tp_rank(rank)))
    derived = {name for name in live if name.endswith((".W_UK_T", ".W_UV"))}  # refreshed from kv_b_proj
    assert set(layout) == set(live) - derived, sorted(set(layout) ^ (set(live) - derived))[:6]
    assert all(tuple(live[name].shape) == shape for name, shape in layout.items())
    plan = build_plan(spec, train, infer, 2)
    Transfer(plan, rank=rank, bucket_bytes=64 * 1024, dtype=destination_dtypes(live)).run(engine.named_weights(), live)
    assert verify_transfer(plan, rank, engine.named_weights(), live) > 0
    rollout.mark_weights_loaded()


def _check_planner_shapes(engine, checkpoint: str, tp: int, pp: int, ep: int) -> None:
    import json
    from pathlib import Path

    from megatron.core import parallel_state as ps

    from mindspeed_rl.planner.arch import from_hf_config
    from mindspeed_rl.planner.params import megatron_params

    arch = from_hf_config(json.loads((Path(checkpoint) / "config.json").read_text()))
    planned = megatron_params(arch, tp=tp, tp_rank=0, pp=pp, pp_rank=ps.get_pipeline_model_parallel_rank(), ep=ep)
    live = {name: p.numel() for name, p in engine.module.named_parameters()}
    assert {p.name: p.numel for p in planned} == live


def _update_gradients(spec, state, *, cp: int, packed: bool) -> dict[str, torch.Tensor]:
    """Every parameter's gradient after one GRPO update on a batch of six samples (each rank: the whole model)."""
    from megatron.core import parallel_state as ps

    from mindspeed_rl.accelerator import get_accelerator
    from mindspeed_rl.algorithms.grpo import GRPOLossConfig
    from mindspeed_rl.engines.megatron_engine import MegatronEngine, OptimizerSettings
    from mindspeed_rl.models.qwen2 import ModelOptions
    from mindspeed_rl.protocol import Packing
    from mindspeed_rl.workers.actor_steps import train_on_mini_batch
    from dp_share import dp_share
    from test_packing import _batch, _rollout_columns

    ps.initialize_model_parallel(context_parallel_size=cp)
    acc = get_accelerator("cpu")
    acc.seed_model_parallel_rng(1)
    settings = OptimizerSettings(lr=1e-3, min_lr=0.0, weight_decay=0.0, adam_beta1=0.9, adam_beta2=0.95,
                                 adam_eps=1e-8, clip_grad=1.0)
    engine = MegatronEngine(spec=spec, hf_state=state, params_dtype=torch.float32, accelerator=acc,
                            parallel=megatron_state.current(),
                            optimizer=settings, options=ModelOptions(packed_sequences=packed))
    loss = GRPOLossConfig(clip_ratio=0.2, kl_penalty="low_var_kl", kl_coef=0.05, entropy_coeff=0.01,
                          loss_agg_mode="token-mean")
    train_on_mini_batch(engine, dp_share(_rollout_columns(_batch(5, samples=6), seed=6)), loss, micro_batch_size=3,
                        temperature=1.0, packing=Packing(max_tokens=64) if packed else None)
    grads = {name: p.main_grad.clone() for name, p in engine.module.named_parameters()}
    ps.destroy_model_parallel()
    return grads


def _check_cp_gradients(spec, state) -> None:
    """MLA under CP: the K/V gather's backward, the chunks' rotary and the log-probs' sum over CP give the whole
    sequence's gradient, as DP2 (each rank half of the batch, Megatron's own MLA path) does."""
    want = _update_gradients(spec, state, cp=1, packed=False)
    assert all(grad.abs().max() > 0 for name, grad in want.items() if "linear_kv" in name)  # the MLA projections
    for packed in (False, True):
        got = _update_gradients(spec, state, cp=2, packed=packed)
        for name, grad in want.items():
            torch.testing.assert_close(got[name], grad, rtol=1e-4, atol=1e-6, msg=f"{name} (packed={packed})")


def _worker(rank, port, checkpoint, layouts):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), LOCAL_RANK=str(rank),
                      WORLD_SIZE="2", VLLM_ENABLE_V1_MULTIPROCESSING="0", VLLM_LOGGING_LEVEL="ERROR")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=2)
    from megatron.core import parallel_state as ps

    from mindspeed_rl.accelerator import get_accelerator
    from mindspeed_rl.checkpoint.hf_export import hf_weights_from_megatron
    from mindspeed_rl.engines.megatron_engine import MegatronEngine
    from mindspeed_rl.engines.vllm_cpu_process import remove_cpu_shm_segments
    from mindspeed_rl.engines.vllm_engine import VLLMEngine, VLLMEngineConfig
    from mindspeed_rl.models.checkpoint import load_hf_checkpoint
    from mindspeed_rl.models.qwen2 import ModelOptions
    from mindspeed_rl.resharding.plan import InferLayout, TrainLayout

    spec, state = load_hf_checkpoint(checkpoint)
    assert spec.deepseek is not None and spec.deepseek.num_groups > 1 and spec.deepseek.yarn is not None
    rollout = VLLMEngine(VLLMEngineConfig(
        model_dir=checkpoint, tensor_parallel_size=2, dtype="float32", max_model_len=32, max_num_seqs=16,
        max_num_batched_tokens=512, seed=0, enforce_eager=True, gpu_memory_utilization=0.5,
        cpu_kvcache_space_gb=0.03, on_cpu=True))
    acc = get_accelerator("cpu")
    for case, (tp, pp, ep, cp) in enumerate(layouts):
        ps.initialize_model_parallel(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
                                     expert_model_parallel_size=ep, context_parallel_size=cp)
        acc.seed_model_parallel_rng(1)
        hf_state = perturbed_state(state, case)
        engine = MegatronEngine(spec=spec, hf_state=hf_state, params_dtype=torch.float32, accelerator=acc,
                                parallel=megatron_state.current(),
                                optimizer=None)
        _check_against_hf(engine, _hf_logits(checkpoint, hf_state), pp, cp)
        packed = MegatronEngine(spec=spec, hf_state=hf_state, params_dtype=torch.float32, accelerator=acc,
                                parallel=megatron_state.current(),
                                optimizer=None, options=ModelOptions(packed_sequences=True))
        _check_packed_against_hf(packed, _hf_logits(checkpoint, hf_state))
        _check_planner_shapes(engine, checkpoint, tp, pp, ep)
        if ep == 1:  # the export gathers over TP and PP (not EP)
            exported = hf_weights_from_megatron(engine.named_weights(), spec, parallel=engine.parallel)
            assert set(exported) == set(hf_state) and all(torch.equal(exported[k], v) for k, v in hf_state.items())
        _push(spec, engine, rollout, TrainLayout(tp=tp, pp=pp, ep=ep), InferLayout(tp=2), rank)
        assert_vllm_logprobs_match_megatron(engine, rollout, rank, 2, 2)
        ps.destroy_model_parallel()
    _check_cp_gradients(spec, state)
    dist.barrier()
    dist.destroy_process_group()
    if rank == 0:
        remove_cpu_shm_segments()


def test_megatron_and_vllm_match_hf_on_two_ranks(tmp_path):
    from mindspeed_rl.data.tiny_deepseek_v3 import create_tiny_deepseek_v3_checkpoint

    # 8 experts in 4 groups, 2 groups and 4 experts per token: Megatron's group score (top topk/topk_group) is
    # then HF's (top 2).
    # With DeepSeek-V3's multi-token-prediction layer (model.layers.2.*, num_nextn_predict_layers 1), which the
    # reader skips: every check below runs on the main model, as HF's (which builds no MTP module) does.
    checkpoint = str(create_tiny_deepseek_v3_checkpoint(tmp_path / "ds", n_routed_experts=8, n_group=4, topk_group=2,
                                                        num_experts_per_tok=4, seed=3, rope_scaling=YARN, mtp_layers=1))
    _check_the_mtp_layer_is_in_the_checkpoint_and_not_read(checkpoint)
    spawn_ranks(_worker, args=(free_port(), checkpoint, [(2, 1, 1, 1), (1, 2, 1, 1), (1, 1, 1, 2)]), nprocs=2)


def _check_the_mtp_layer_is_in_the_checkpoint_and_not_read(checkpoint: str) -> None:
    from safetensors import safe_open

    from mindspeed_rl.models.checkpoint import load_hf_checkpoint

    with safe_open(f"{checkpoint}/model.safetensors", framework="pt") as tensors:
        mtp = [name for name in tensors.keys() if name.startswith("model.layers.2.")]
    assert "model.layers.2.eh_proj.weight" in mtp and len(mtp) > 10
    spec, state = load_hf_checkpoint(checkpoint)
    assert spec.num_layers == 2 and not any(name.startswith("model.layers.2.") for name in state)
