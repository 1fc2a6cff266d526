"""Resharding into live vLLM pipeline stages on real gloo ranks (issue 14).

vLLM runs in-process with pipeline parallelism (external_launcher, V1, gloo), one engine per rank;
each rank's live parameters are exactly its stage's layout (names and shapes). For each training
layout: Megatron shards -> the stage's live parameters through the plan; every rank's parameters
equal the oracle (full HF tensors cut the way vLLM cuts them, restricted to the stage), each rank
receives exactly the plan's bytes (none where train and infer layouts agree), the fingerprint check
passes, and vLLM's sampled-token log-probs equal Megatron's (< 1e-4, fp32).

Runs where: one spawned process group of 4 ranks (gloo), one vLLM engine per process.
"""
import os

import torch
import torch.distributed as dist

from mindspeed_rl.parallel import megatron_state
from resharding_oracle import (
    assert_vllm_logprobs_match_megatron,
    free_port,
    make_checkpoint,
    perturbed_state,
    vllm_shard_oracle,
    vllm_stage_oracle,
)
from preloaded import spawn_ranks


def _worker(rank, world, port, checkpoint, infer_tp, infer_pp, train_layouts, same_layouts):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), LOCAL_RANK=str(rank),
                      WORLD_SIZE=str(world), VLLM_ENABLE_V1_MULTIPROCESSING="0", VLLM_LOGGING_LEVEL="ERROR")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    from megatron.core import parallel_state as ps

    from mindspeed_rl.accelerator import get_accelerator
    from mindspeed_rl.engines.megatron_engine import MegatronEngine
    from mindspeed_rl.engines.vllm_cpu_process import remove_cpu_shm_segments
    from mindspeed_rl.engines.vllm_engine import VLLMEngine, VLLMEngineConfig
    from mindspeed_rl.models.checkpoint import load_hf_checkpoint
    from mindspeed_rl.resharding.fingerprint import verify_transfer
    from mindspeed_rl.resharding.plan import InferLayout, TrainLayout, build_plan
    from mindspeed_rl.resharding.transfer import Transfer
    from mindspeed_rl.resharding.weight_push import all_stage_dtypes, check_and_clear_padding

    spec, state = load_hf_checkpoint(checkpoint)
    infer = InferLayout(tp=infer_tp, pp=infer_pp)
    rollout = VLLMEngine(VLLMEngineConfig(
        model_dir=checkpoint, tensor_parallel_size=infer_tp, pipeline_parallel_size=infer_pp,
        data_parallel_size=world // (infer_tp * infer_pp), dtype="float32", max_model_len=32, max_num_seqs=16,
        max_num_batched_tokens=512, seed=0, enforce_eager=True, gpu_memory_utilization=0.5,
        cpu_kvcache_space_gb=0.03, on_cpu=True))
    live = rollout.named_weights()
    dtypes = all_stage_dtypes(live, infer)
    acc = get_accelerator("cpu")
    for case, (tp, pp) in enumerate(train_layouts):
        ps.initialize_model_parallel(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp)
        acc.seed_model_parallel_rng(1)
        hf_state = perturbed_state(state, case)
        engine = MegatronEngine(spec=spec, hf_state=hf_state, params_dtype=torch.float32, accelerator=acc,
                                parallel=megatron_state.current(),
                                optimizer=None)
        plan = build_plan(spec, TrainLayout(tp=tp, pp=pp), infer, world)
        # The stage's live parameters are exactly the layout's: nothing unfilled, nothing missing.
        assert set(live) == set(plan.infer_tensors[rank]), (rank, sorted(set(live) ^ set(plan.infer_tensors[rank])))
        check_and_clear_padding(plan, rank, live)
        transfer = Transfer(plan, rank=rank, bucket_bytes=32 * 1024, dtype=dtypes)
        stats = transfer.run(engine.named_weights(), live)
        assert stats.bytes_received == plan.received_numel(rank) * 4
        crossed = torch.tensor([stats.bytes_received])
        dist.all_reduce(crossed)
        if (tp, pp) in same_layouts:
            assert crossed.item() == 0 and stats.bytes_local > 0
        else:
            assert crossed.item() > 0
        assert verify_transfer(plan, rank, engine.named_weights(), live, dtypes=dtypes) > 0
        rollout.mark_weights_loaded()
        tp_rank, pp_rank = infer.tp_rank(rank), infer.pp_rank(rank)
        expected = vllm_stage_oracle(vllm_shard_oracle(hf_state, spec, infer_tp, tp_rank), spec, infer_pp, pp_rank)
        assert set(expected) == set(live)
        for name, tensor in expected.items():
            assert torch.equal(live[name], tensor), f"train tp{tp} pp{pp}: rank {rank} {name}"
        # Every rank of a TP x PP block generates the same samples (vLLM broadcasts the last stage's
        # output under external_launcher), so the block shares one seed.
        assert_vllm_logprobs_match_megatron(engine, rollout, rank, world, infer_tp * infer_pp)
        ps.destroy_model_parallel()
    dist.barrier()
    dist.destroy_process_group()
    if rank == 0:
        remove_cpu_shm_segments()


def test_four_ranks_infer_tp2_pp2(tmp_path):
    """Train PP2 x DP2 -> infer TP2 x PP2: Megatron's ranks 0, 1 hold stage 0's layers whole and vLLM's
    ranks 0, 1 are stage 0's TP ranks, so every stage cuts its half locally (nothing crosses); train
    PP4 -> infer TP2 x PP2: each rank receives the other layer of its stage; train TP2 x PP2 -> infer TP2 x PP2
    (the same cut: nothing crosses)."""
    checkpoint = make_checkpoint(tmp_path / "model")
    spawn_ranks(_worker, args=(4, free_port(), checkpoint, 2, 2, [(1, 2), (1, 4), (2, 2)], [(1, 2), (2, 2)]), nprocs=4)
