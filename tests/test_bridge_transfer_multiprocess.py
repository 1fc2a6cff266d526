"""The disaggregated weight push over the bridge: 3 processes, training ranks 0-1 (Megatron TP2
shards) in one torch.distributed world, inference rank 2 (vLLM TP1 shard) in another, the bridge a
standalone gloo group over all 3. The pushed inference tensors equal the oracle's, the receiver got
exactly its shard's bytes, and the fingerprint check passes over the bridge (and catches a corrupted
range). Then LoRA's adapter-only push over the same bridge (resharding/adapter_push.AdapterPush), twice, the
adapters changed between: the inference weights equal W + (alpha/r) B A cut as vLLM cuts it, and after the first
push (the backbone) only the adapters' bytes cross.

Runs where: 3 spawned processes (two gloo worlds plus the bridge); plain tensors shaped like the
engines' parameters, so no Megatron or vLLM import (the live engines run in test_disaggregated_async_e2e.py and test_two_nodes_e2e.py).
"""
import os

from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist

from preloaded import spawn_ranks
from resharding_oracle import (PlainDestination, fill_layout, free_port, hf_adapters, merged_hf, random_hf_state,
                               tiny_spec, vllm_shard_oracle)

TRAIN_WORLD, INFER_WORLD = 2, 1
LORA = SimpleNamespace(rank=4, scale=2.0, target_modules=("linear_qkv", "linear_proj", "linear_fc1", "linear_fc2"))


def _adapter_pushes(rank: int, bridge, spec, hf: dict, dtypes: dict) -> dict:
    """Two adapter-only pushes over the bridge (B doubled between them): what the inference rank holds after each,
    and its received / planned bytes."""
    from mindspeed_rl.resharding.adapter_plan import adapter_layouts
    from mindspeed_rl.resharding.adapter_push import AdapterPush
    from mindspeed_rl.models.layouts import megatron_shard_from_hf
    from mindspeed_rl.resharding.plan import InferLayout, TrainLayout, train_layouts

    train = TrainLayout(tp=2)
    layouts, shapes = adapter_layouts(train_layouts(spec, train, TRAIN_WORLD), spec, rank=LORA.rank,
                                      target_modules=LORA.target_modules)
    adapters = hf_adapters(shapes)
    is_train = rank < TRAIN_WORLD
    mine = fill_layout(layouts[rank], adapters) if is_train else None
    inference = None if is_train else PlainDestination(spec, InferLayout(tp=1), 0, INFER_WORLD)
    push = AdapterPush(spec=spec, lora=LORA, train=train, infer=InferLayout(tp=1), rank=rank, world_size=TRAIN_WORLD,
                       infer_world_size=INFER_WORLD, group=bridge, dtypes=dtypes, adapter_dtype=torch.float32,
                       read_backbone=(lambda: megatron_shard_from_hf(hf, spec, tp_rank=rank, tp=2, pp_rank=0, pp=1))
                       if is_train else None, read_adapters=(lambda: mine) if is_train else None,
                       inference_model=inference, bucket_bytes=16 * 1024, check_weights=True)
    out = {"weights": [], "bytes": [], "adapters": []}
    for _ in range(2):
        metrics = push.push()
        out["bytes"].append((metrics["resharding/bytes_received"], metrics["resharding/planned_bytes_received"],
                             metrics["resharding/full_push_planned_bytes_received"]))
        if inference is not None:
            out["weights"].append({name: t.clone() for name, t in inference.weights.items()})
        out["adapters"].append(dict(adapters))
        adapters = {name: t * 2 if name.endswith("lora_B") else t for name, t in adapters.items()}
        if is_train:
            for key, tensor in fill_layout(layouts[rank], adapters).items():
                mine[key].copy_(tensor)
    return out


def _worker(rank: int, ports: tuple[int, int, int], out_dir: str) -> None:
    from mindspeed_rl.resharding.bridge import BridgeGroup
    from mindspeed_rl.resharding.fingerprint import WeightMismatchError, verify_transfer
    from mindspeed_rl.models.layouts import megatron_shard_from_hf, vllm_layout
    from mindspeed_rl.resharding.plan import InferLayout, TrainLayout, build_plan
    from mindspeed_rl.resharding.transfer import Transfer

    train_port, infer_port, bridge_port = ports
    is_train = rank < TRAIN_WORLD
    local_rank, local_world = (rank, TRAIN_WORLD) if is_train else (rank - TRAIN_WORLD, INFER_WORLD)
    # Each side has its own world, as Megatron and vLLM each need the whole world they find.
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{train_port if is_train else infer_port}",
                            rank=local_rank, world_size=local_world)
    bridge = BridgeGroup(host="127.0.0.1", port=bridge_port, rank=rank, size=TRAIN_WORLD + INFER_WORLD,
                         timeout_seconds=60)
    spec = tiny_spec(heads=8, kv=2, hidden=64, vocab=96)
    hf = random_hf_state(spec)
    train = TrainLayout(tp=2)
    plan = build_plan(spec, train, InferLayout(tp=1), TRAIN_WORLD, infer_world_size=INFER_WORLD)
    dtypes = {t.name: torch.float32 for t in vllm_layout(spec, tp=1, tp_rank=0)}
    if is_train:
        sources = megatron_shard_from_hf(hf, spec, tp_rank=rank, tp=2, pp_rank=0, pp=1)
        destinations = {}
    else:
        sources = {}
        destinations = {t.name: torch.zeros(t.shape) for t in vllm_layout(spec, tp=1, tp_rank=0)}
    transfer = Transfer(plan, rank=rank, bucket_bytes=64 * 1024, dtype=dtypes, group=bridge)
    stats = transfer.run(sources, destinations)
    checked = verify_transfer(plan, rank, sources, destinations, group=bridge, dtypes=dtypes)
    caught = False
    if not is_train:
        destinations["model.layers.0.self_attn.o_proj.weight"][0, 0] += 1.0
    try:
        verify_transfer(plan, rank, sources, destinations, group=bridge, dtypes=dtypes)
    except WeightMismatchError:
        caught = True
    if not is_train:
        destinations["model.layers.0.self_attn.o_proj.weight"][0, 0] -= 1.0
        lora = _adapter_pushes(rank, bridge, spec, hf, dtypes)
        torch.save({"lora": lora, "destinations": destinations, "bytes_received": stats.bytes_received,
                    "minimum_bytes": plan.received_numel(rank) * 4, "checked": checked, "caught": caught,
                    "copies": len(plan.copies_to(rank))}, os.path.join(out_dir, "infer.pt"))
    else:
        assert stats.bytes_received == 0 and not caught
        _adapter_pushes(rank, bridge, spec, hf, dtypes)
    bridge.barrier()
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def pushed(tmp_path_factory):
    out_dir = tmp_path_factory.mktemp("bridge")
    spawn_ranks(_worker, args=((free_port(), free_port(), free_port()), str(out_dir)), nprocs=TRAIN_WORLD + INFER_WORLD)
    return torch.load(out_dir / "infer.pt")


def test_pushed_inference_weights_equal_the_oracle(pushed):
    spec = tiny_spec(heads=8, kv=2, hidden=64, vocab=96)
    expected = vllm_shard_oracle(random_hf_state(spec), spec, 1, 0)
    assert set(pushed["destinations"]) == set(expected)
    for name, tensor in expected.items():
        assert torch.equal(pushed["destinations"][name], tensor), name


def test_received_bytes_are_the_shard_once(pushed):
    assert pushed["bytes_received"] == pushed["minimum_bytes"] > 0


def test_fingerprints_cross_the_bridge_and_catch_a_changed_range(pushed):
    assert pushed["checked"] == pushed["copies"] > 0
    assert pushed["caught"]


def test_the_adapter_push_over_the_bridge_gives_the_merged_weights(pushed):
    spec = tiny_spec(heads=8, kv=2, hidden=64, vocab=96)
    hf = random_hf_state(spec)
    for weights, adapters in zip(pushed["lora"]["weights"], pushed["lora"]["adapters"]):
        expected = vllm_shard_oracle(merged_hf(hf, adapters, spec, LORA.scale), spec, 1, 0)
        assert set(weights) == set(expected)
        for name, tensor in expected.items():
            assert torch.allclose(weights[name], tensor, rtol=1e-6, atol=1e-6), name


def test_after_the_backbone_only_the_adapters_cross_the_bridge(pushed):
    (first, _, full), (second, planned, _) = pushed["lora"]["bytes"]
    assert first == second == planned > 0  # the adapter bytes of each push; the backbone's are reported apart
    assert planned < 0.25 * full
