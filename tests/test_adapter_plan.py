"""LoRA's adapter-only switch plan (resharding/adapter_plan.py), checked in one process by simulating every rank at
layouts up to 8 ranks (TP2 x PP2 -> vLLM TP1 x DP4 among them): each vLLM shard, its backbone plus
(alpha/r) B A of the slices the plan brings, equals the oracle (W + (alpha/r) B A in HF form, cut the way vLLM cuts
it); each rank receives exactly the plan's adapter bytes, a small fraction of the full push's.

Runs where: in the pytest process; pure tensor code, no collectives.
"""
import pytest
import torch

from mindspeed_rl.resharding.adapter_plan import adapted_weight, adapter_layouts, build_adapter_plan
from mindspeed_rl.resharding.plan import InferLayout, TrainLayout, build_plan, train_layouts
from resharding_oracle import fill_layout, hf_adapters, merged_hf, random_hf_state, tiny_spec, vllm_shard_oracle

R, SCALE = 4, 2.0
TARGETS = ("linear_qkv", "linear_proj", "linear_fc1", "linear_fc2")
# (world, train TP, train PP, vLLM TP); at vLLM TP8 the 4 KV heads are replicated
LAYOUTS = [(2, 2, 1, 1), (2, 1, 2, 2), (4, 2, 2, 1), (4, 4, 1, 2), (4, 1, 4, 2), (8, 2, 2, 4), (8, 2, 1, 8)]


@pytest.mark.parametrize("world,tp,pp,infer_tp", LAYOUTS)
def test_the_adapter_switch_gives_every_vllm_shard_its_merged_weights(world, tp, pp, infer_tp):
    spec = tiny_spec(kv=4, heads=8, hidden=64, vocab=96)
    hf = random_hf_state(spec)
    train = TrainLayout(tp=tp, pp=pp)
    layouts, shapes = adapter_layouts(train_layouts(spec, train, world), spec, rank=R, target_modules=TARGETS)
    adapters = hf_adapters(shapes)
    plan = build_adapter_plan(spec, train, InferLayout(tp=infer_tp), world, rank=R, target_modules=TARGETS)
    sources = {rank: fill_layout(layouts[rank], adapters) for rank in range(world)}
    merged = merged_hf(hf, adapters, spec, SCALE)
    for rank in range(world):
        slices = {key: torch.zeros(t.shape) for key, t in plan.infer_tensors[rank].items()}
        for c in plan.copies_to(rank):
            slices[c.dst_tensor].narrow(c.dim, c.dst_start, c.length).copy_(
                sources[c.src_rank][c.src_tensor].narrow(c.dim, c.src_start, c.length))
        got = vllm_shard_oracle(hf, spec, infer_tp, rank % infer_tp)  # the backbone's shard
        for key, b in slices.items():
            if key.endswith(".lora_B"):
                got[adapted_weight(key)] = got[adapted_weight(key)] + SCALE * b @ slices[key[:-1] + "A"]
        expected = vllm_shard_oracle(merged, spec, infer_tp, rank % infer_tp)
        for name, tensor in expected.items():
            assert torch.allclose(got[name], tensor, atol=1e-5, rtol=1e-5), (rank, name)


@pytest.mark.parametrize("world,tp,pp,infer_tp", [(4, 2, 2, 1), (8, 2, 2, 4)])
def test_a_rank_receives_the_adapters_share_not_the_models(world, tp, pp, infer_tp):
    spec = tiny_spec(kv=4, heads=8, hidden=64, vocab=96)
    train, infer = TrainLayout(tp=tp, pp=pp), InferLayout(tp=infer_tp)
    adapter = build_adapter_plan(spec, train, infer, world, rank=R, target_modules=TARGETS)
    full = build_plan(spec, train, infer, world)
    for rank in range(world):
        assert 0 < adapter.received_numel(rank) < 0.5 * full.received_numel(rank)
