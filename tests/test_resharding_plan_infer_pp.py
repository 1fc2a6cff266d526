"""The resharding plan into vLLM pipeline stages (infer PP 2 and 4), checked in one process by
simulating every rank: each rank's stage parameters equal the oracle (full HF tensors cut the way
vLLM cuts them, restricted to what the stage holds), each rank receives exactly the bytes its stage
needs and does not hold, and train and infer layouts that agree move nothing. The layer partition
and the rank order are compared with vLLM's own code.

Runs where: in the pytest process; pure tensor code, no collectives (one test imports vLLM).
"""
import math

import pytest
import torch

from mindspeed_rl.models.layouts import megatron_shard_from_hf, parameter_shapes, tensor_view, vllm_pp_layers
from mindspeed_rl.resharding.plan import InferLayout, TrainLayout, build_plan
from resharding_oracle import (
    random_hf_state,
    tiny_moe_spec,
    tiny_spec,
    vllm_moe_shard_oracle,
    vllm_shard_oracle,
    vllm_stage_oracle,
)

LAYOUTS = [  # (world, train tp, train pp, infer tp, infer pp, layers)
    (2, 1, 1, 1, 2, 4),  # train DP2 -> infer PP2
    (2, 2, 1, 1, 2, 4),  # train TP2 -> infer PP2
    (2, 1, 2, 1, 2, 4),  # same split: nothing crosses
    (4, 1, 2, 2, 2, 4),  # train PP2 x DP2 -> infer TP2 x PP2
    (4, 2, 2, 2, 2, 4),  # same layout: nothing crosses
    (4, 1, 4, 1, 2, 4),  # train PP4 -> infer PP2 x DP2
    (4, 1, 2, 1, 4, 4),  # train PP2 -> infer PP4
    (4, 2, 1, 1, 4, 6),  # infer PP4 split unevenly by vLLM: [1, 2, 2, 1]
    (4, 1, 2, 1, 4, 6),  # train PP2 [3, 3] -> infer PP4 [1, 2, 2, 1]
    (4, 1, 1, 2, 2, 5),  # 5 layers: vLLM [3, 2] (Megatron could not split them)
    (6, 1, 3, 1, 2, 6),  # train PP3 [2, 2, 2] -> infer PP2 [3, 3] x DP3
    (8, 2, 2, 2, 4, 8),  # train TP2 x PP2 x DP2 -> infer TP2 x PP4
    (8, 4, 2, 1, 4, 4),  # -> infer PP4 x DP2
    (8, 1, 1, 2, 2, 6),  # -> infer TP2 x PP2 x DP2
]


def _spec(layers: int, tie: bool):
    return tiny_spec(heads=8, kv=4, hidden=64, vocab=96, layers=layers, tie=tie)  # vocab 96: vLLM pads to 128


def _train_shards(hf, spec, train: TrainLayout, world: int) -> dict[int, dict[str, torch.Tensor]]:
    shards = {}
    for rank in range(world):
        tp_rank, pp_rank = train.coordinates(rank, world)
        shards[rank] = megatron_shard_from_hf(hf, spec, tp_rank=tp_rank, tp=train.tp, pp_rank=pp_rank, pp=train.pp,
                                            ep_rank=train.ep_rank(rank), ep=train.ep)
    return shards


def _simulate(plan, shards) -> dict[int, dict[str, torch.Tensor]]:
    """Every inference rank's stage parameters (zeros, then the plan's copies)."""
    out = {rank: {name: torch.zeros(shape) for name, shape in parameter_shapes(list(plan.infer_tensors[rank].values())).items()}
           for rank in plan.infer_ranks}
    for c in plan.copies:
        src = tensor_view(shards[c.src_rank], c.src_tensor).narrow(c.dim, c.src_start, c.length)
        tensor_view(out[c.dst_rank], c.dst_tensor).narrow(c.dim, c.dst_start, c.length).copy_(src)
    return out


def _vllm_coordinates(world: int, tp: int, pp: int) -> dict[int, tuple[int, int, int]]:
    """(tp_rank, pp_rank, dp_rank) per rank from vLLM's own group construction
    (parallel_state.initialize_model_parallel: all_ranks reshaped ExternalDP x DP x PP x PCP x TP)."""
    all_ranks = torch.arange(world).reshape(-1, 1, pp, 1, tp)
    coords: dict[int, list[int]] = {r: [0, 0, 0] for r in range(world)}
    tp_groups = all_ranks.view(-1, tp).unbind(0)
    pp_groups = all_ranks.transpose(2, 4).reshape(-1, pp).unbind(0)
    # ExternalDP: every rank of a (PP x TP) block generates for the same requests; its index is the block's.
    for axis, groups in ((0, tp_groups), (1, pp_groups)):
        for group in groups:
            for position, rank in enumerate(group.tolist()):
                coords[rank][axis] = position
    for rank in range(world):
        coords[rank][2] = int((all_ranks == rank).nonzero()[0][0])
    return {r: tuple(c) for r, c in coords.items()}


@pytest.mark.parametrize("tie", [False, True])
@pytest.mark.parametrize("world,tp,pp,infer_tp,infer_pp,layers", LAYOUTS)
def test_every_stage_gets_exactly_the_oracle(world, tp, pp, infer_tp, infer_pp, layers, tie):
    spec = _spec(layers, tie)
    hf = random_hf_state(spec)
    train, infer = TrainLayout(tp=tp, pp=pp), InferLayout(tp=infer_tp, pp=infer_pp)
    plan = build_plan(spec, train, infer, world)
    got = _simulate(plan, _train_shards(hf, spec, train, world))
    coords = _vllm_coordinates(world, infer_tp, infer_pp)
    for rank in range(world):
        tp_rank, pp_rank, _ = coords[rank]
        expected = vllm_stage_oracle(vllm_shard_oracle(hf, spec, infer_tp, tp_rank), spec, infer_pp, pp_rank)
        assert set(got[rank]) == set(expected), rank
        for name, tensor in expected.items():
            assert torch.equal(got[rank][name], tensor), (rank, name)


def _assert_minimum(plan, spec) -> None:
    """Minimum per rank = elements of its stage's shard whose HF range it does not hold itself."""
    shapes = {name: tensor.shape for name, tensor in random_hf_state(spec).items()}
    for rank in plan.infer_ranks:
        held = {}
        for t in plan.train_tensors.get(rank, {}).values():
            for s in t.segments:
                held.setdefault(s.hf_name, set()).update(range(s.hf_start, s.hf_start + s.length))
        minimum = 0
        for t in plan.infer_tensors[rank].values():
            for s in t.segments:
                unit = math.prod(shapes[s.hf_name]) // shapes[s.hf_name][t.dim]
                minimum += len(set(range(s.hf_start, s.hf_start + s.length)) - held.get(s.hf_name, set())) * unit
        assert plan.received_numel(rank) == minimum, rank


@pytest.mark.parametrize("world,tp,pp,infer_tp,infer_pp,layers", LAYOUTS)
def test_received_bytes_are_the_minimum(world, tp, pp, infer_tp, infer_pp, layers):
    spec = _spec(layers, tie=False)
    _assert_minimum(build_plan(spec, TrainLayout(tp=tp, pp=pp), InferLayout(tp=infer_tp, pp=infer_pp), world), spec)


@pytest.mark.parametrize("tie", [False, True])
@pytest.mark.parametrize("world,tp,pp,infer_tp", [(2, 1, 2, 1), (4, 2, 2, 2), (4, 1, 4, 1)])
def test_same_stage_split_moves_nothing(world, tp, pp, infer_tp, tie):
    """Train PP = infer PP with the same layers per stage (and the same TP): every range is local."""
    spec = tiny_spec(heads=8, kv=4, vocab=128, layers=4, tie=tie)  # vocab 128: no vLLM padding difference
    plan = build_plan(spec, TrainLayout(tp=tp, pp=pp), InferLayout(tp=infer_tp, pp=pp), world)
    assert plan.copies and all(c.src_rank == c.dst_rank for c in plan.copies)


def test_a_stage_receives_only_its_layers():
    """Train TP2 -> infer PP2: rank 1 (last stage) receives half of layers 2-3 and the head, nothing of 0-1."""
    spec = _spec(4, tie=False)
    plan = build_plan(spec, TrainLayout(tp=2), InferLayout(pp=2), 2)
    received = {c.dst_tensor.split(".")[2] if c.dst_tensor.startswith("model.layers.") else c.dst_tensor
                for c in plan.copies_to(1) if c.src_rank == 0}
    assert received == {"2", "3", "lm_head.weight"}


@pytest.mark.parametrize("layers,pp", [(n, p) for n in range(1, 13) for p in (1, 2, 3, 4, 8) if p <= n])
def test_layer_partition_is_vllms(layers, pp, monkeypatch):
    from vllm.distributed.utils import get_pp_indices

    monkeypatch.delenv("VLLM_PP_LAYER_PARTITION", raising=False)
    for rank in range(pp):
        start, stop = get_pp_indices(layers, rank, pp)
        assert vllm_pp_layers(layers, rank, pp) == range(start, stop), (layers, pp, rank)


def test_layer_partition_override_is_vllms(monkeypatch):
    import vllm.envs
    from vllm.distributed.utils import get_pp_indices

    # An engine built earlier in this process froze vLLM's env cache; read the variable afresh.
    vllm.envs.disable_envs_cache()
    monkeypatch.setenv("VLLM_PP_LAYER_PARTITION", "1,3,2")
    assert [vllm_pp_layers(6, r, 3) for r in range(3)] == [range(*get_pp_indices(6, r, 3)) for r in range(3)]


@pytest.mark.parametrize("world,tp,pp", [(2, 1, 2), (4, 2, 2), (8, 2, 2), (8, 1, 4), (8, 2, 4)])
def test_rank_order_follows_vllm(world, tp, pp):
    infer = InferLayout(tp=tp, pp=pp)
    assert {r: (infer.tp_rank(r), infer.pp_rank(r), infer.dp_rank(r)) for r in range(world)} == \
        _vllm_coordinates(world, tp, pp)


MOE_LAYOUTS = [  # (world, train tp, pp, ep) -> (infer tp, infer pp, expert parallel)
    (4, 1, 1, 2, 1, 2, True),  # infer PP2 x EP2 (DP2 within each stage)
    (4, 2, 1, 2, 2, 2, False),  # infer TP2 x PP2: experts split by columns over the stage's TP ranks
    (4, 1, 2, 2, 1, 2, False),  # train PP2 x EP2 -> infer PP2 x DP2
    (2, 1, 1, 2, 1, 2, False),
]


@pytest.mark.parametrize("world,tp,pp,ep,infer_tp,infer_pp,infer_ep", MOE_LAYOUTS)
def test_moe_every_stage_gets_exactly_the_oracle(world, tp, pp, ep, infer_tp, infer_pp, infer_ep):
    spec = tiny_moe_spec()
    hf = random_hf_state(spec)
    train, infer = TrainLayout(tp=tp, pp=pp, ep=ep), InferLayout(tp=infer_tp, pp=infer_pp, expert_parallel=infer_ep)
    plan = build_plan(spec, train, infer, world)
    got = _simulate(plan, _train_shards(hf, spec, train, world))
    coords = _vllm_coordinates(world, infer_tp, infer_pp)
    dp = world // (infer_tp * infer_pp)
    for rank in range(world):
        tp_rank, pp_rank, dp_rank = coords[rank]
        # MoE ranks of a stage: vLLM's EP group is DP x TP of that stage (parallel_state: transpose(1, 2)).
        whole = vllm_moe_shard_oracle(hf, spec, tp=infer_tp, dp=dp, rank=dp_rank * infer_tp + tp_rank,
                                      expert_parallel=infer_ep)
        expected = vllm_stage_oracle(whole, spec, infer_pp, pp_rank)
        assert set(got[rank]) == set(expected), rank
        for name, tensor in expected.items():
            assert torch.equal(got[rank][name], tensor), (rank, name)
    _assert_minimum(plan, spec)


def test_impossible_infer_pp_is_refused_with_the_reason():
    spec = _spec(4, tie=False)
    with pytest.raises(ValueError, match=r"infer TP\*PP=4 must divide the inference world size 2"):
        build_plan(spec, TrainLayout(), InferLayout(tp=2, pp=2), 2)
    with pytest.raises(ValueError, match="infer PP=8 must not exceed num_layers=4"):
        build_plan(spec, TrainLayout(), InferLayout(pp=8), 8)
