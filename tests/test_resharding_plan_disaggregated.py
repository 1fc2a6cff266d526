"""The resharding plan between DIFFERENT rank sets (disaggregated: training ranks 0..T-1, inference
ranks T..T+I-1 on the bridge): every inference rank ends with the oracle's vLLM shard, receives
exactly its shard's elements once (it holds nothing of the training layout), and no training rank
receives anything.

Runs where: in the pytest process; pure tensor code, no collectives (the bridge itself runs in
test_bridge_transfer_multiprocess.py).
"""
import math

import pytest
import torch

from mindspeed_rl.models.layouts import megatron_shard_from_hf, vllm_layout
from mindspeed_rl.resharding.plan import InferLayout, TrainLayout, build_plan
from resharding_oracle import random_hf_state, tiny_spec, vllm_shard_oracle

PAIRS = [  # (train world, train tp, train pp, infer world, infer tp)
    (1, 1, 1, 1, 1), (1, 1, 1, 2, 2), (1, 1, 1, 2, 1), (2, 2, 1, 1, 1), (2, 1, 2, 1, 1), (2, 1, 2, 2, 2),
    (4, 2, 2, 2, 1), (4, 2, 2, 4, 4), (4, 4, 1, 2, 2), (2, 1, 1, 4, 2),
]


def _simulate(plan, spec, hf, train: TrainLayout, world: int, infer_tp: int):
    shards = {}
    for rank in plan.train_ranks:
        tp_rank, pp_rank = train.coordinates(rank, world)
        shards[rank] = megatron_shard_from_hf(hf, spec, tp_rank=tp_rank, tp=train.tp, pp_rank=pp_rank, pp=train.pp)
    out = {rank: {t.name: torch.zeros(t.shape) for t in vllm_layout(spec, tp=infer_tp, tp_rank=(rank - world) % infer_tp)}
           for rank in plan.infer_ranks}
    for c in plan.copies:
        out[c.dst_rank][c.dst_tensor].narrow(c.dim, c.dst_start, c.length).copy_(
            shards[c.src_rank][c.src_tensor].narrow(c.dim, c.src_start, c.length))
    return out


@pytest.mark.parametrize("world,tp,pp,infer_world,infer_tp", PAIRS)
def test_every_inference_rank_gets_the_oracle_shard(world, tp, pp, infer_world, infer_tp):
    spec = tiny_spec(heads=8, kv=4, hidden=64, vocab=96)  # vocab 96: vLLM pads to 128
    hf = random_hf_state(spec)
    train = TrainLayout(tp=tp, pp=pp)
    plan = build_plan(spec, train, InferLayout(tp=infer_tp), world, infer_world_size=infer_world)
    assert list(plan.infer_ranks) == list(range(world, world + infer_world))
    got = _simulate(plan, spec, hf, train, world, infer_tp)
    for rank in plan.infer_ranks:
        expected = vllm_shard_oracle(hf, spec, infer_tp, (rank - world) % infer_tp)
        assert set(got[rank]) == set(expected)
        for name, tensor in expected.items():
            assert torch.equal(got[rank][name], tensor), (rank, name)


@pytest.mark.parametrize("world,tp,pp,infer_world,infer_tp", PAIRS)
def test_each_inference_rank_receives_its_shard_once_and_training_ranks_nothing(world, tp, pp, infer_world, infer_tp):
    spec = tiny_spec(heads=8, kv=4, hidden=64, vocab=96)
    hf = random_hf_state(spec)
    plan = build_plan(spec, TrainLayout(tp=tp, pp=pp), InferLayout(tp=infer_tp), world, infer_world_size=infer_world)
    assert all(c.src_rank in plan.train_ranks and c.dst_rank in plan.infer_ranks for c in plan.copies)
    for rank in plan.infer_ranks:
        # The byte minimum: every element the vLLM shard covers (padding rows receive nothing).
        shard_numel = sum(seg.length * math.prod(hf[seg.hf_name].shape) // hf[seg.hf_name].shape[t.dim]
                          for t in vllm_layout(spec, tp=infer_tp, tp_rank=(rank - world) % infer_tp) for seg in t.segments)
        assert plan.received_numel(rank) == shard_numel
        assert plan.stats[rank]["local_numel"] == 0
    assert all(plan.received_numel(rank) == 0 for rank in plan.train_ranks)


def test_senders_share_the_load_of_replicated_ranges():
    """With train DP 2, both replicas hold every range: each sends part of it rather than one sending all."""
    spec = tiny_spec(heads=8, kv=2, hidden=64, vocab=128)
    plan = build_plan(spec, TrainLayout(tp=1), InferLayout(tp=1), 2, infer_world_size=1)
    sent = [plan.stats[rank]["sent_numel"] for rank in plan.train_ranks]
    assert min(sent) > 0.3 * sum(sent)


def test_inference_tp_must_divide_the_inference_ranks():
    spec = tiny_spec(heads=8, kv=2)
    with pytest.raises(ValueError, match="infer TP=2 must divide the inference world size 3"):
        build_plan(spec, TrainLayout(tp=1), InferLayout(tp=2), 1, infer_world_size=3)
