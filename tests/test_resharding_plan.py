"""The resharding plan, checked in one process by simulating every rank: each rank's resulting
vLLM shards equal the oracle (full HF tensors cut the way vLLM cuts them), and each rank receives
exactly the bytes its shard needs and does not hold.

Runs where: in the pytest process; pure tensor code, no collectives.
"""
import math

import pytest
import torch

from mindspeed_rl.models.layouts import megatron_shard_from_hf
from mindspeed_rl.models.layouts import (hf_shapes, megatron_layout, padded_vocab, parameter_shapes, tensor_view,
                                             vllm_layout)
from mindspeed_rl.resharding.plan import InferLayout, TrainLayout, build_plan
from mindspeed_rl.resharding.transfer import Transfer, split_into_rounds
from resharding_oracle import random_hf_state, tiny_moe_spec, tiny_spec, vllm_moe_shard_oracle, vllm_shard_oracle

LAYOUTS = [  # (world, train tp, train pp, infer tp)
    (1, 1, 1, 1), (2, 1, 1, 1), (2, 2, 1, 1), (2, 1, 2, 1), (2, 1, 1, 2), (2, 2, 1, 2), (2, 1, 2, 2),
    (4, 4, 1, 1), (4, 4, 1, 2), (4, 2, 2, 1), (4, 2, 2, 2), (4, 2, 2, 4), (4, 1, 4, 2), (4, 1, 1, 4),
    (8, 2, 2, 4), (8, 4, 2, 8), (8, 1, 2, 8),
]


def train_shards(hf, spec, train: TrainLayout, world: int) -> dict[int, dict[str, torch.Tensor]]:
    shards = {}
    for rank in range(world):
        tp_rank, pp_rank = train.coordinates(rank, world)
        shards[rank] = megatron_shard_from_hf(hf, spec, tp_rank=tp_rank, tp=train.tp, pp_rank=pp_rank, pp=train.pp)
    return shards


def simulate(plan, shards, spec, infer_tp):
    out = {rank: {t.name: torch.zeros(t.shape) for t in vllm_layout(spec, tp=infer_tp, tp_rank=rank % infer_tp)}
           for rank in shards}
    for c in plan.copies:
        src = shards[c.src_rank][c.src_tensor].narrow(c.dim, c.src_start, c.length)
        out[c.dst_rank][c.dst_tensor].narrow(c.dim, c.dst_start, c.length).copy_(src)
    return out


@pytest.mark.parametrize("world,tp,pp,infer_tp", LAYOUTS)
@pytest.mark.parametrize("kv", [2, 4])
def test_every_rank_gets_exactly_the_oracle(world, tp, pp, infer_tp, kv):
    if kv % tp:
        pytest.skip("megatron needs whole query groups per TP rank")
    spec = tiny_spec(kv=kv, heads=8, hidden=64, vocab=96)  # vocab 96: vLLM pads to 128
    hf = random_hf_state(spec)
    train = TrainLayout(tp=tp, pp=pp)
    plan = build_plan(spec, train, InferLayout(tp=infer_tp), world)
    got = simulate(plan, train_shards(hf, spec, train, world), spec, infer_tp)
    for rank in range(world):
        expected = vllm_shard_oracle(hf, spec, infer_tp, rank % infer_tp)
        assert set(got[rank]) == set(expected)
        for name, tensor in expected.items():
            assert torch.equal(got[rank][name], tensor), (rank, name)


@pytest.mark.parametrize("world,tp,stages,infer_tp", [(2, 1, (3, 1), 2), (4, 2, (1, 3), 1), (3, 1, (1, 2, 1), 1)])
def test_uneven_pipeline_stages_give_every_rank_the_oracle(world, tp, stages, infer_tp):
    """actor_config.num_layer_list: each stage's layers are its own count, wherever they come from."""
    from dataclasses import replace

    spec = replace(tiny_spec(kv=4, heads=8, hidden=64, vocab=96), pipeline_stage_layers=stages)
    train = TrainLayout(tp=tp, pp=len(stages))
    shards = train_shards(random_hf_state(spec), spec, train, world)
    for rank, shard in shards.items():
        layers = {int(name.split(".")[2]) for name in shard if name.startswith("decoder.layers.")}
        assert layers == set(range(stages[train.coordinates(rank, world)[1]]))
    got = simulate(build_plan(spec, train, InferLayout(tp=infer_tp), world), shards, spec, infer_tp)
    hf = random_hf_state(spec)
    for rank in range(world):
        expected = vllm_shard_oracle(hf, spec, infer_tp, rank % infer_tp)
        assert all(torch.equal(got[rank][name], tensor) for name, tensor in expected.items()), rank


@pytest.mark.parametrize("world,tp,pp,infer_tp", LAYOUTS)
def test_received_bytes_are_the_minimum(world, tp, pp, infer_tp):
    """Minimum per rank = elements of its vLLM shard whose HF range it does not hold itself."""
    spec = tiny_spec(heads=8, kv=4, hidden=64, vocab=96)
    train = TrainLayout(tp=tp, pp=pp)
    plan = build_plan(spec, train, InferLayout(tp=infer_tp), world)
    for rank in range(world):
        tp_rank, pp_rank = train.coordinates(rank, world)
        held = {}
        for t in megatron_layout(spec, tp=tp, tp_rank=tp_rank, pp=pp, pp_rank=pp_rank):
            for s in t.segments:
                held.setdefault(s.hf_name, set()).update(range(s.hf_start, s.hf_start + s.length))
        hf = random_hf_state(spec)
        minimum = 0
        for t in vllm_layout(spec, tp=infer_tp, tp_rank=rank % infer_tp):
            for s in t.segments:
                unit = hf[s.hf_name].numel() // hf[s.hf_name].shape[t.dim]
                missing = set(range(s.hf_start, s.hf_start + s.length)) - held.get(s.hf_name, set())
                minimum += len(missing) * unit
        assert plan.received_numel(rank) == minimum


def test_same_layout_moves_nothing():
    spec = tiny_spec(heads=8, kv=4, vocab=128)  # no vLLM vocab padding difference
    for world, tp in ((2, 2), (4, 4), (4, 2)):
        plan = build_plan(spec, TrainLayout(tp=tp), InferLayout(tp=tp), world)
        assert all(plan.received_numel(r) == 0 for r in range(world))


def test_hf_to_megatron_and_back_through_the_layout_is_exact():
    """One description of Megatron's layout serves both directions (the engines' checkpoint load and the
    export); that it is Megatron's real layout is shown by Megatron's logits equalling HF's at TP1, TP2,
    PP2 (test_engines_single_rank, test_megatron_layouts_multiprocess)."""
    from mindspeed_rl.models.layouts import hf_from_megatron_shards

    spec = tiny_spec(heads=8, kv=4)
    hf = random_hf_state(spec)
    for tp, pp in ((1, 1), (2, 1), (4, 2), (1, 4)):
        for pp_rank in range(pp):
            shards = [megatron_shard_from_hf(hf, spec, tp_rank=tp_rank, tp=tp, pp_rank=pp_rank, pp=pp)
                      for tp_rank in range(tp)]
            layout = megatron_layout(spec, tp=tp, tp_rank=0, pp=pp, pp_rank=pp_rank)
            assert {t.name for t in layout} == set(shards[0])
            back = hf_from_megatron_shards(shards, spec, pp=pp, pp_rank=pp_rank)
            assert back and all(torch.equal(back[name], hf[name]) for name in back)


def test_rounds_respect_the_bucket_on_every_rank():
    spec = tiny_spec(heads=8, kv=4, hidden=64, vocab=96)
    plan = build_plan(spec, TrainLayout(tp=1, pp=4), InferLayout(tp=2), 4)
    remote = [c for c in plan.copies if c.src_rank != c.dst_rank]
    bucket = 3000  # elements; smaller than several copies, larger than any single row
    rounds = split_into_rounds(remote, bucket)
    for members in rounds:
        for rank in range(4):
            assert sum(c.numel for c in members if c.src_rank == rank) <= bucket
            assert sum(c.numel for c in members if c.dst_rank == rank) <= bucket
    assert sum(c.numel for r in rounds for c in r) == sum(c.numel for c in remote)


def test_rounds_carry_one_wire_dtype_within_the_bucket_bytes():
    """Mixed inference dtypes (norms fp32, the rest bf16): every round carries one dtype, the
    destination's, and stays within the bucket in bytes by that dtype's itemsize."""
    spec = tiny_spec(heads=8, kv=4, hidden=64, vocab=96)
    plan = build_plan(spec, TrainLayout(tp=2, pp=2), InferLayout(tp=1), 4)
    dtypes = {t.name: torch.float32 if "norm" in t.name else torch.bfloat16 for t in vllm_layout(spec, tp=1, tp_rank=0)}
    bucket_bytes = 6000
    for rank in range(4):
        transfer = Transfer(plan, rank=rank, bucket_bytes=bucket_bytes, dtype=dtypes)
        moved = 0
        for wire, members in transfer.rounds:
            assert {dtypes[c.dst_tensor] for c in members} == {wire}
            size = 4 if wire == torch.float32 else 2
            assert sum(c.numel for c in members if c.src_rank == rank) * size <= bucket_bytes
            assert sum(c.numel for c in members if c.dst_rank == rank) * size <= bucket_bytes
            moved += sum(c.numel for c in members if c.dst_rank == rank)
        assert moved == plan.received_numel(rank)
        assert transfer.send_capacity_bytes <= bucket_bytes and transfer.recv_capacity_bytes <= bucket_bytes


def test_kv_heads_fewer_than_infer_tp_are_replicated():
    spec = tiny_spec(heads=8, kv=2, hidden=64)
    layout = {t.name: t for t in vllm_layout(spec, tp=8, tp_rank=5)}
    qkv = layout["model.layers.0.self_attn.qkv_proj.weight"]
    assert qkv.shape == ((1 + 2) * 8, 64)  # one q head, one (replicated) k and v head
    assert qkv.segments[1].hf_start == 1 * 8  # ranks 4..7 serve KV head 1


def test_impossible_layouts_are_refused_with_the_reason():
    spec = tiny_spec(heads=8, kv=4)
    with pytest.raises(ValueError, match="infer TP 3 must divide num_attention_heads=8"):
        build_plan(spec, TrainLayout(tp=1), InferLayout(tp=3), 3)
    with pytest.raises(ValueError, match="train TP=8 must divide num_key_value_heads=4"):
        build_plan(spec, TrainLayout(tp=8), InferLayout(tp=1), 8)
    assert padded_vocab(96) == 128


# -- MoE (Qwen3-MoE: experts + router, q/k norms, no qkv bias) ------------------------------------
MOE_LAYOUTS = [  # (world, train tp, pp, ep) -> (infer tp, expert parallel); the matrix plus PP/DP variants
    *[(2, 1, 1, 2, itp, iep) for itp in (1, 2) for iep in (False, True)],
    *[(4, 2, 1, 2, itp, iep) for itp in (1, 2, 4) for iep in (False, True)],
    (4, 1, 1, 2, 2, True), (4, 1, 1, 4, 1, False), (4, 1, 2, 2, 2, True), (2, 2, 1, 1, 1, True), (1, 1, 1, 1, 1, False),
]


def moe_train_shards(hf, spec, train: TrainLayout, world: int) -> dict[int, dict[str, torch.Tensor]]:
    shards = {}
    for rank in range(world):
        tp_rank, pp_rank = train.coordinates(rank, world)
        shards[rank] = megatron_shard_from_hf(hf, spec, tp_rank=tp_rank, tp=train.tp, pp_rank=pp_rank, pp=train.pp,
                                            ep_rank=train.ep_rank(rank), ep=train.ep)
    return shards


def simulate_moe(plan, shards, infer: InferLayout):
    """Every rank's vLLM parameters (3-D expert tensors included) filled by the plan's copies."""
    out = {rank: {name: torch.zeros(shape) for name, shape in parameter_shapes(list(plan.infer_tensors[rank].values())).items()}
           for rank in shards}
    for c in plan.copies:
        src = tensor_view(shards[c.src_rank], c.src_tensor).narrow(c.dim, c.src_start, c.length)
        tensor_view(out[c.dst_rank], c.dst_tensor).narrow(c.dim, c.dst_start, c.length).copy_(src)
    return out


@pytest.mark.parametrize("world,tp,pp,ep,infer_tp,infer_ep", MOE_LAYOUTS)
def test_moe_every_rank_gets_exactly_the_oracle(world, tp, pp, ep, infer_tp, infer_ep):
    spec = tiny_moe_spec()
    hf = random_hf_state(spec)
    train, infer = TrainLayout(tp=tp, pp=pp, ep=ep), InferLayout(tp=infer_tp, expert_parallel=infer_ep)
    plan = build_plan(spec, train, infer, world)
    got = simulate_moe(plan, moe_train_shards(hf, spec, train, world), infer)
    for rank in range(world):
        expected = vllm_moe_shard_oracle(hf, spec, tp=infer_tp, dp=world // infer_tp, rank=rank, expert_parallel=infer_ep)
        assert set(got[rank]) == set(expected)
        for name, tensor in expected.items():
            assert torch.equal(got[rank][name], tensor), (rank, name)


@pytest.mark.parametrize("world,tp,pp,ep,infer_tp,infer_ep", MOE_LAYOUTS)
def test_moe_received_bytes_are_the_minimum(world, tp, pp, ep, infer_tp, infer_ep):
    spec = tiny_moe_spec()
    shapes = hf_shapes(spec)
    train, infer = TrainLayout(tp=tp, pp=pp, ep=ep), InferLayout(tp=infer_tp, expert_parallel=infer_ep)
    plan = build_plan(spec, train, infer, world)
    for rank in range(world):
        held = {}
        for t in plan.train_tensors[rank].values():
            for s in t.segments:
                held.setdefault(s.hf_name, set()).update(range(s.hf_start, s.hf_start + s.length))
        minimum = 0
        for t in plan.infer_tensors[rank].values():
            for s in t.segments:
                unit = math.prod(shapes[s.hf_name]) // shapes[s.hf_name][t.dim]
                minimum += len(set(range(s.hf_start, s.hf_start + s.length)) - held.get(s.hf_name, set())) * unit
        assert plan.received_numel(rank) == minimum


def test_moe_hf_to_megatron_and_back_through_the_layout_is_exact():
    from mindspeed_rl.models.layouts import hf_from_megatron_shards

    spec = tiny_moe_spec()
    hf = random_hf_state(spec)
    for tp, ep in ((1, 1), (1, 2), (2, 2), (1, 4)):
        for ep_rank in range(ep):
            shards = [megatron_shard_from_hf(hf, spec, tp_rank=tp_rank, tp=tp, ep_rank=ep_rank, ep=ep)
                      for tp_rank in range(tp)]
            back = hf_from_megatron_shards(shards, spec, ep=ep, ep_rank=ep_rank)
            experts = {name for name in back if ".experts." in name}
            assert len(experts) == 3 * spec.num_experts // ep * spec.num_layers  # gate, up, down of its experts
            assert all(torch.equal(back[name], hf[name]) for name in back)


def test_moe_expert_rank_order_follows_megatron():
    """Expert groups come from the same rank order with tp := expert TP: tp fastest, then ep."""
    train = TrainLayout(tp=2, ep=2)
    assert [train.ep_rank(r) for r in range(8)] == [0, 0, 1, 1, 0, 0, 1, 1]
    assert [InferLayout(tp=2).dp_rank(r) for r in range(4)] == [0, 0, 1, 1]


def test_moe_impossible_layouts_are_refused_with_the_reason():
    spec = tiny_moe_spec(experts=4, moe_ffn=64)
    with pytest.raises(ValueError, match="train EP=2 must divide the data-parallel size 1"):
        build_plan(spec, TrainLayout(tp=2, ep=2), InferLayout(tp=1), 2)
    with pytest.raises(ValueError, match="train EP=8 must divide num_experts=4"):
        build_plan(spec, TrainLayout(ep=8), InferLayout(tp=1), 8)
    with pytest.raises(ValueError, match=r"infer EP = TP x DP = 8 must divide num_experts=4"):
        build_plan(spec, TrainLayout(ep=4), InferLayout(tp=1, expert_parallel=True), 8)
    with pytest.raises(ValueError, match="must divide moe_intermediate_size=64"):
        build_plan(tiny_moe_spec(moe_ffn=64, experts=8), TrainLayout(ep=8), InferLayout(tp=1), 128)
    with pytest.raises(ValueError, match="needs a MoE model"):
        build_plan(tiny_spec(), TrainLayout(ep=2), InferLayout(tp=1), 2)
