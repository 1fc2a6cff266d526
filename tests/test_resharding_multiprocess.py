"""Resharding on real gloo ranks: Megatron shards (train TP/PP/DP) -> live vLLM shards (infer TP/DP).

For every layout pair the world allows: each rank's inference weights equal the oracle (full HF
tensors cut the way vLLM cuts them) exactly, the fingerprint check passes (and catches a
corrupted weight), and each rank receives exactly the plan's bytes. With the live vLLM engine of
the spawn, vLLM's sampled-token log-probs after the push equal Megatron's (< 1e-4, fp32).

bf16 (inside the 4-rank spawn, into plain bf16 tensors of infer TP 1, 2 and 4 from train TP2 x PP2 and
TP1 x PP4): Megatron's bf16 model keeps its torch RMSNorm weights in fp32 and the rest in bf16, so every
push mixes dtypes; the inference weights must equal the oracle rounded to bf16 bit for bit, the bytes are
counted at 2 per element and the fingerprint catches a one-ulp change of a norm weight. A live bf16 vLLM at
the recipe's layout (TP1 x DP4), its log-probs within resharding_oracle.LOGPROB_TOLERANCE: test_bf16_e2e.

The two-rank spawns: a model with two KV heads, live at infer TP1; one with a single KV head, live at infer
TP2, where vLLM replicates it on both ranks (two KV heads live at TP2: the e2e runs of
grpo_tiny_cpu_pp2_infer_tp2).

LoRA (inside the 4-rank spawn): the adapter-only switch from train TP2 x PP2 into plain tensors of infer TP1 x DP4
equals the merged weights pushed whole (< 1e-6 relative, fp32), twice, with exactly the plan's adapter bytes.

Runs where: spawned process groups (2 and 4 ranks, gloo), one vLLM engine per process.
"""
import os

import torch
import torch.distributed as dist

from mindspeed_rl.parallel import megatron_state
from resharding_oracle import (
    adapter_push_check,
    assert_vllm_logprobs_match_megatron,
    free_port,
    make_checkpoint,
    perturbed_state,
    vllm_shard_oracle,
)
from preloaded import spawn_ranks



def _push(spec, engine, destinations, train, infer_tp, world, rank):
    from mindspeed_rl.resharding.fingerprint import verify_transfer
    from mindspeed_rl.resharding.plan import InferLayout, build_plan
    from mindspeed_rl.resharding.transfer import Transfer, destination_dtypes

    plan = build_plan(spec, train, InferLayout(tp=infer_tp), world)
    for d in destinations.values():
        d.zero_()
    transfer = Transfer(plan, rank=rank, bucket_bytes=32 * 1024, dtype=destination_dtypes(destinations))
    stats = transfer.run(engine.named_weights(), destinations)
    size = next(iter(destinations.values())).element_size()  # one dtype per spawn's destinations
    assert stats.bytes_received == plan.received_numel(rank) * size
    assert stats.peak_extra_bytes <= 2 * 32 * 1024 + max(t.numel() * size for t in destinations.values())
    assert verify_transfer(plan, rank, engine.named_weights(), destinations) > 0
    return plan


def _assert_oracle(destinations, hf_state, spec, infer_tp, rank, layout_name):
    expected = vllm_shard_oracle(hf_state, spec, infer_tp, rank % infer_tp)
    for name, tensor in expected.items():
        got = destinations[name]
        assert torch.equal(got, tensor.to(got.dtype)), f"{layout_name}: rank {rank} {name} ({got.dtype})"


def _add_one_ulp(tensor, index):
    """Change one element by the smallest step its dtype has (one mantissa bit)."""
    bits = {torch.float32: torch.int32, torch.bfloat16: torch.int16}[tensor.dtype]
    tensor.view(bits)[index] += 1


def _assert_fingerprint_catches_corruption(spec, engine, destinations, plan, rank):
    # A norm weight (one row of its own) and the down projection (a range of a matrix).
    for name, index in (("model.layers.0.input_layernorm.weight", (3,)), ("model.layers.0.mlp.down_proj.weight", (0, 0))):
        _check_one_corruption(engine, destinations, plan, rank, name, index)


def _check_one_corruption(engine, destinations, plan, rank, name, index):
    from mindspeed_rl.resharding.fingerprint import WeightMismatchError, verify_transfer

    saved = destinations[name][index].clone()
    if rank == 0:
        _add_one_ulp(destinations[name], index)
    try:
        verify_transfer(plan, rank, engine.named_weights(), destinations)
        raised = False
    except WeightMismatchError:
        raised = True
    destinations[name][index] = saved
    assert raised == (rank == 0), (name, rank)


def _check_bf16_pushes(spec, state, tp, pp, infer_tps, world, rank, *, first):
    """A bf16 Megatron model (norms included) pushed into plain bf16 tensors of each infer TP: the oracle rounded
    to bf16 bit for bit; on the first layout the fingerprint catches a one-ulp change (norm and down projection)."""
    from megatron.core import parallel_state as ps

    from mindspeed_rl.accelerator import get_accelerator
    from mindspeed_rl.engines.megatron_engine import MegatronEngine
    from mindspeed_rl.models.layouts import vllm_layout
    from mindspeed_rl.resharding.plan import TrainLayout

    acc = get_accelerator("cpu")
    ps.initialize_model_parallel(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp)
    acc.seed_model_parallel_rng(1)
    hf_state = perturbed_state(state, 10 + tp)
    engine = MegatronEngine(spec=spec, hf_state=hf_state, params_dtype=torch.bfloat16, accelerator=acc,
                            parallel=megatron_state.current(), optimizer=None)
    # Every parameter in bf16, the norms too (Megatron-LM's Float16Module cast, models/megatron_build.py).
    assert {t.dtype for t in engine.named_weights().values()} == {torch.bfloat16}
    for infer_tp in infer_tps:
        destinations = {t.name: torch.zeros(t.shape, dtype=torch.bfloat16)
                        for t in vllm_layout(spec, tp=infer_tp, tp_rank=rank % infer_tp)}
        plan = _push(spec, engine, destinations, TrainLayout(tp=tp, pp=pp), infer_tp, world, rank)
        _assert_oracle(destinations, hf_state, spec, infer_tp, rank, f"bf16: train tp{tp} pp{pp} -> infer tp{infer_tp}")
        if first:
            _assert_fingerprint_catches_corruption(spec, engine, destinations, plan, rank)
    ps.destroy_model_parallel()


def _check_lora_switch(spec, state, tp, pp, infer_tp, rank):
    """LoRA's adapter-only switch (resharding/adapter_push.py) at a 4-rank layout, into plain tensors: vLLM's weights
    equal the merged weights pushed whole through the full plan, twice (the second time from the host copy, after B
    changed), and each rank receives exactly the plan's adapter bytes, fewer than the full push's."""
    from megatron.core import parallel_state as ps

    from mindspeed_rl.accelerator import get_accelerator
    from mindspeed_rl.engines.megatron_engine import MegatronEngine
    from mindspeed_rl.models.lora import LoRASettings

    acc = get_accelerator("cpu")
    ps.initialize_model_parallel(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp)
    acc.seed_model_parallel_rng(1)
    lora = LoRASettings(rank=4, alpha=8.0, target_modules=("linear_qkv", "linear_proj", "linear_fc1", "linear_fc2"),
                        seed=5)
    actor = MegatronEngine(spec=spec, hf_state=state, params_dtype=torch.float32, accelerator=acc,
                           parallel=megatron_state.current(), optimizer=None,
                           lora=lora)
    # B starts at zero: give it values, as training would, equal on the TP ranks where it is replicated (the B of a
    # row-parallel linear): one seed per pipeline stage.
    generator = torch.Generator().manual_seed(ps.get_pipeline_model_parallel_rank())
    with torch.no_grad():
        for name, param in actor.module.named_parameters():
            if name.endswith("lora_B"):
                param.copy_(0.1 * torch.randn(param.shape, generator=generator))
    result = adapter_push_check(actor, infer_tp)
    assert max(result["push_errors"]) < 1e-6, result["push_errors"]
    for received, planned, full in result["push_bytes"]:
        assert received == planned and 0 < received < full, (received, planned, full)
    ps.destroy_model_parallel()


def _worker(rank, world, port, checkpoint, live_infer_tp, train_layouts, oracle_infer_tps, bf16_layouts=(),
            lora_switch=None):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), LOCAL_RANK=str(rank),
                      WORLD_SIZE=str(world), VLLM_ENABLE_V1_MULTIPROCESSING="0", VLLM_LOGGING_LEVEL="ERROR")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    from megatron.core import parallel_state as ps

    from mindspeed_rl.accelerator import get_accelerator
    from mindspeed_rl.engines.megatron_engine import MegatronEngine
    from mindspeed_rl.engines.vllm_engine import VLLMEngine, VLLMEngineConfig
    from mindspeed_rl.models.layouts import vllm_layout
    from mindspeed_rl.resharding.plan import TrainLayout
    from mindspeed_rl.models.checkpoint import load_hf_checkpoint

    dtype = torch.float32
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
        engine = MegatronEngine(spec=spec, hf_state=hf_state, params_dtype=dtype, accelerator=acc,
                                parallel=megatron_state.current(), optimizer=None)
        train = TrainLayout(tp=tp, pp=pp)
        for infer_tp in oracle_infer_tps:  # plain tensors shaped like vLLM's shards
            destinations = {t.name: torch.zeros(t.shape, dtype=dtype)
                            for t in vllm_layout(spec, tp=infer_tp, tp_rank=rank % infer_tp)}
            plan = _push(spec, engine, destinations, train, infer_tp, world, rank)
            _assert_oracle(destinations, hf_state, spec, infer_tp, rank, f"train tp{tp} pp{pp} -> infer tp{infer_tp}")
        live = rollout.named_weights()
        assert {t.dtype for t in live.values()} == {torch.float32}
        plan = _push(spec, engine, live, train, live_infer_tp, world, rank)
        rollout.mark_weights_loaded()
        _assert_oracle(live, hf_state, spec, live_infer_tp, rank, f"live: train tp{tp} pp{pp} -> infer tp{live_infer_tp}")
        if case == 0:
            _assert_fingerprint_catches_corruption(spec, engine, live, plan, rank)
        assert_vllm_logprobs_match_megatron(engine, rollout, rank, world, live_infer_tp, dtype)
        ps.destroy_model_parallel()
    for case, (tp, pp) in enumerate(bf16_layouts):
        _check_bf16_pushes(spec, state, tp, pp, oracle_infer_tps, world, rank, first=case == 0)
    if lora_switch is not None:
        _check_lora_switch(spec, state, *lora_switch, rank)
    dist.barrier()
    dist.destroy_process_group()
    if rank == 0:
        from mindspeed_rl.engines.vllm_cpu_process import remove_cpu_shm_segments

        remove_cpu_shm_segments()


def test_two_ranks(tmp_path):
    checkpoint = make_checkpoint(tmp_path / "model")
    spawn_ranks(_worker, args=(2, free_port(), checkpoint, 1, [(1, 1), (2, 1), (1, 2)], [1, 2]), nprocs=2)


def test_two_ranks_kv_heads_replicated_in_inference(tmp_path):
    """One KV head, infer TP2: vLLM replicates it on both ranks."""
    checkpoint = make_checkpoint(tmp_path / "model", num_query_groups=1)
    spawn_ranks(_worker, args=(2, free_port(), checkpoint, 2, [(1, 1), (1, 2)], [1, 2]), nprocs=2)


def test_four_ranks(tmp_path):
    """fp32 live at infer TP4 from four train layouts; then bf16 from train TP2 x PP2 and TP1 x PP4; then LoRA's
    adapter-only switch from train TP2 x PP2 to infer TP1 x DP4 (the 7B recipe's layouts)."""
    checkpoint = make_checkpoint(tmp_path / "model", hidden_size=256, num_attention_heads=8, num_query_groups=4)
    spawn_ranks(_worker, args=(4, free_port(), checkpoint, 4, [(4, 1), (2, 2), (1, 4), (1, 1)], [1, 2, 4],
                               [(2, 2), (1, 4)], (2, 2, 1)), nprocs=4)
