"""Resharding on real gloo ranks: Megatron shards (train TP/PP/DP) -> live vLLM shards (infer TP/DP).

For every layout pair the world allows: each rank's inference weights equal the oracle (full HF
tensors cut the way vLLM cuts them) exactly, the fingerprint check passes (and catches a
corrupted weight), and each rank receives exactly the plan's bytes. With the live vLLM engine of
the spawn, vLLM's sampled-token log-probs after the push equal Megatron's (< 1e-4, fp32).

Runs where: spawned process groups (2 and 4 ranks, gloo), one vLLM engine per process.
"""
import os

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from resharding_oracle import (
    assert_vllm_logprobs_match_megatron,
    free_port,
    make_checkpoint,
    perturbed_state,
    vllm_shard_oracle,
)



def _push(spec, engine, destinations, train, infer_tp, world, rank):
    from mindspeed_rl.resharding.fingerprint import verify_transfer
    from mindspeed_rl.resharding.plan import InferLayout, build_plan
    from mindspeed_rl.resharding.transfer import Transfer

    plan = build_plan(spec, train, InferLayout(tp=infer_tp), world)
    for d in destinations.values():
        d.zero_()
    stats = Transfer(plan, rank=rank, bucket_bytes=32 * 1024, dtype=torch.float32).run(engine.named_weights(), destinations)
    assert stats.bytes_received == plan.received_numel(rank) * 4
    assert stats.peak_extra_bytes <= 2 * 32 * 1024 + max(t.numel() * 4 for t in destinations.values())
    assert verify_transfer(plan, rank, engine.named_weights(), destinations) > 0
    return plan


def _assert_oracle(destinations, hf_state, spec, infer_tp, rank, layout_name):
    expected = vllm_shard_oracle(hf_state, spec, infer_tp, rank % infer_tp)
    for name, tensor in expected.items():
        assert torch.equal(destinations[name], tensor), f"{layout_name}: rank {rank} {name}"


def _assert_fingerprint_catches_corruption(spec, engine, destinations, plan, rank):
    from mindspeed_rl.resharding.fingerprint import WeightMismatchError, verify_transfer

    name = "model.layers.0.mlp.down_proj.weight"
    saved = destinations[name][0, 0].clone()
    if rank == 0:
        destinations[name][0, 0] += 1e-3
    try:
        verify_transfer(plan, rank, engine.named_weights(), destinations)
        raised = False
    except WeightMismatchError:
        raised = True
    destinations[name][0, 0] = saved
    assert raised == (rank == 0)


def _worker(rank, world, port, checkpoint, live_infer_tp, train_layouts, oracle_infer_tps):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), LOCAL_RANK=str(rank),
                      WORLD_SIZE=str(world), VLLM_ENABLE_V1_MULTIPROCESSING="0", VLLM_LOGGING_LEVEL="ERROR")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    from megatron.core import parallel_state as ps

    from mindspeed_rl.accelerator import get_accelerator
    from mindspeed_rl.engines.megatron_engine import MegatronEngine
    from mindspeed_rl.engines.vllm_engine import VLLMEngine, VLLMEngineConfig
    from mindspeed_rl.resharding.layouts import vllm_layout
    from mindspeed_rl.resharding.plan import TrainLayout
    from mindspeed_rl.models.checkpoint import load_hf_checkpoint

    spec, state = load_hf_checkpoint(checkpoint)
    rollout = VLLMEngine(VLLMEngineConfig(
        model_dir=checkpoint, tensor_parallel_size=live_infer_tp, data_parallel_size=world // live_infer_tp,
        dtype="float32", max_model_len=32, max_num_seqs=16, max_num_batched_tokens=512, seed=0, enforce_eager=True,
        gpu_memory_utilization=0.5, cpu_kvcache_space_gb=0.03, on_cpu=True))
    acc = get_accelerator("cpu")
    for case, (tp, pp) in enumerate(train_layouts):
        ps.initialize_model_parallel(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp)
        acc.seed_model_parallel_rng(1)
        hf_state = perturbed_state(state, case)
        engine = MegatronEngine(spec=spec, hf_state=hf_state, params_dtype=torch.float32, accelerator=acc, optimizer=None)
        train = TrainLayout(tp=tp, pp=pp)
        for infer_tp in oracle_infer_tps:  # plain tensors shaped like vLLM's shards
            destinations = {t.name: torch.zeros(t.shape) for t in vllm_layout(spec, tp=infer_tp, tp_rank=rank % infer_tp)}
            plan = _push(spec, engine, destinations, train, infer_tp, world, rank)
            _assert_oracle(destinations, hf_state, spec, infer_tp, rank, f"train tp{tp} pp{pp} -> infer tp{infer_tp}")
        live = rollout.named_weights()
        plan = _push(spec, engine, live, train, live_infer_tp, world, rank)
        rollout.mark_weights_loaded()
        _assert_oracle(live, hf_state, spec, live_infer_tp, rank, f"live: train tp{tp} pp{pp} -> infer tp{live_infer_tp}")
        if case == 0:
            _assert_fingerprint_catches_corruption(spec, engine, live, plan, rank)
        assert_vllm_logprobs_match_megatron(engine, rollout, rank, world, live_infer_tp)
        ps.destroy_model_parallel()
    dist.barrier()
    dist.destroy_process_group()
    if rank == 0:
        from mindspeed_rl.engines.vllm_engine import remove_cpu_shm_segments

        remove_cpu_shm_segments()


@pytest.mark.parametrize("live_infer_tp", [2, 1])
def test_two_ranks(tmp_path, live_infer_tp):
    checkpoint = make_checkpoint(tmp_path / "model")
    mp.spawn(_worker, args=(2, free_port(), checkpoint, live_infer_tp, [(1, 1), (2, 1), (1, 2)], [1, 2]),
             nprocs=2, join=True)


def test_two_ranks_kv_heads_replicated_in_inference(tmp_path):
    """One KV head, infer TP2: vLLM replicates it on both ranks."""
    checkpoint = make_checkpoint(tmp_path / "model", num_query_groups=1)
    mp.spawn(_worker, args=(2, free_port(), checkpoint, 2, [(1, 1), (1, 2)], [1]), nprocs=2, join=True)


def test_four_ranks(tmp_path):
    checkpoint = make_checkpoint(tmp_path / "model", hidden_size=256, num_attention_heads=8, num_query_groups=4)
    mp.spawn(_worker, args=(4, free_port(), checkpoint, 4, [(4, 1), (2, 2), (1, 4), (1, 1)], [1, 2]),
             nprocs=4, join=True)
