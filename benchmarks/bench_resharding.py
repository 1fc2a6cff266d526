"""Resharding benchmark: our planned, bucketed transfer vs the naive baseline, side by side.

For each layout pair a gloo process group of the needed size runs, on the same Megatron shards of
a >=100M-parameter Qwen2-shaped model: (1) our transfer into vLLM-shaped shards, (2) the naive
switch every peer uses (all-gather every full tensor over TP, broadcast over PP, then cut and
load). Both results are compared with the oracle (full tensors cut the way vLLM cuts them).

    python benchmarks/bench_resharding.py --json results.json [--bucket-mb 64] [--repeats 3]
"""
from __future__ import annotations

import argparse
import json
import os
import socket
import sys
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

PAIRS = [  # (name, world size, train tp, train pp, infer tp, infer pp)
    ("TP2->TP1", 2, 2, 1, 1, 1),
    ("TP2->TP2", 2, 2, 1, 2, 1),
    ("TP4->TP2", 4, 4, 1, 2, 1),
    ("PP2->TP2", 2, 1, 2, 2, 1),
    # Inference pipeline stages (issue 14): a stage receives only its layers (and the embedding / head).
    ("TP2->PP2", 2, 2, 1, 1, 2),
    ("PP2->PP2", 2, 1, 2, 1, 2),
    ("PP2->TP2xPP2", 4, 1, 2, 2, 2),
    ("TP4->PP4", 4, 4, 1, 1, 4),
]


def bench_spec():
    from mindspeed_rl.models.qwen2 import Qwen2Spec

    # ~111M parameters: 8 layers of hidden 1024 / ffn 2816, 16 heads, 8 KV heads, vocab 8192, untied.
    return Qwen2Spec(vocab_size=8192, hidden_size=1024, ffn_hidden_size=2816, num_layers=8, num_attention_heads=16,
                     num_query_groups=8, head_dim=64, rms_norm_eps=1e-6, rope_theta=1e6,
                     max_position_embeddings=4096, tie_word_embeddings=False)


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _max(value: float) -> float:
    t = torch.tensor([value], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.item()


def _rank_main(rank, world, port, pair, bucket_mb, repeats, out_path):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    from mindspeed_rl.models.layouts import megatron_shard_from_hf
    from mindspeed_rl.parallel import megatron_state
    from mindspeed_rl.resharding.fingerprint import verify_transfer
    from mindspeed_rl.models.layouts import hf_shapes, vllm_layout
    from mindspeed_rl.resharding.naive import gather_full_hf, load_full_hf, materialize
    from mindspeed_rl.resharding.plan import InferLayout, TrainLayout, build_plan
    from mindspeed_rl.resharding.transfer import Transfer, parameter_name

    name, _, tp, pp, infer_tp, infer_pp = pair
    train = TrainLayout(tp=tp, pp=pp)
    parallel = megatron_state.initialize(train, rank=rank, world_size=world, timeout_minutes=30)
    spec = bench_spec()
    g = torch.Generator().manual_seed(0)
    full = {n: torch.randn(shape, generator=g) * 0.02 for n, shape in hf_shapes(spec).items()}
    tp_rank, pp_rank = train.coordinates(rank, world)
    sources = megatron_shard_from_hf(full, spec, tp_rank=tp_rank, tp=tp, pp_rank=pp_rank, pp=pp)
    infer = InferLayout(tp=infer_tp, pp=infer_pp)
    stage = {"pp": infer_pp, "pp_rank": infer.pp_rank(rank)}
    layout = vllm_layout(spec, tp=infer_tp, tp_rank=infer.tp_rank(rank), **stage)
    oracle = {t.name: materialize(t, full, torch.float32) for t in layout}
    largest_param_bytes = max(t.numel() for t in full.values()) * 4
    del full
    destinations = {t.name: torch.zeros(t.shape) for t in layout}

    def max_abs_diff() -> float:
        return max((destinations[n] - oracle[n]).abs().max().item() for n in oracle)

    plan = build_plan(spec, train, infer, world)
    transfer = Transfer(plan, rank=rank, bucket_bytes=int(bucket_mb * 2**20), dtype=torch.float32)
    ours, naive = [], []
    for _ in range(repeats):  # interleaved, so machine noise hits both alike
        for d in destinations.values():
            d.zero_()
        dist.barrier()
        started = time.perf_counter()
        stats = transfer.run(sources, destinations)
        ours.append(_max(time.perf_counter() - started))
        diff_ours = max_abs_diff()
        for d in destinations.values():
            d.zero_()
        dist.barrier()
        started = time.perf_counter()
        gathered, naive_received = gather_full_hf(sources, spec, parallel=parallel)
        load_full_hf(destinations, gathered, spec, tp=infer_tp, tp_rank=infer.tp_rank(rank), **stage)
        naive.append(_max(time.perf_counter() - started))
        naive_peak = sum(t.numel() * t.element_size() for t in gathered.values())
        del gathered
        diff_naive = max_abs_diff()
    started = time.perf_counter()
    transfer.run(sources, destinations)
    # Every stage's parameter names (a rank sends ranges of other stages' parameters).
    dtypes = {parameter_name(key): torch.float32 for tensors in plan.infer_tensors.values() for key in tensors}
    verify_transfer(plan, rank, sources, destinations, dtypes=dtypes)
    fingerprint_seconds = _max(time.perf_counter() - started) - min(ours)
    row = {
        "pair": name,
        "train_layout": {"tp": tp, "pp": pp, "world_size": world},
        "infer_layout": {"tp": infer_tp, "pp": infer_pp, "dp": world // (infer_tp * infer_pp)},
        "params": sum(t.numel() for t in hf_shapes_numel(spec)),
        "bytes_received_per_rank_max": _max(stats.bytes_received),
        "bytes_minimum_per_rank_max": max(plan.received_numel(r) for r in range(world)) * 4,
        "bytes_naive_per_rank_max": _max(naive_received),
        "seconds": min(ours),
        "seconds_naive": min(naive),
        "seconds_fingerprint_check": max(fingerprint_seconds, 0.0),
        "peak_extra_bytes": _max(stats.peak_extra_bytes),
        "peak_extra_bytes_naive": _max(naive_peak),
        "bucket_bytes": int(bucket_mb * 2**20),
        "largest_param_bytes": largest_param_bytes,
        "max_abs_diff": _max(max(diff_ours, diff_naive)),
    }
    if rank == 0:
        with open(out_path, "w") as f:
            json.dump(row, f)
    dist.destroy_process_group()


def hf_shapes_numel(spec):
    from mindspeed_rl.models.layouts import hf_shapes

    return [torch.empty(s, device="meta") for s in hf_shapes(spec).values()]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", required=True, help="where to write the list of results")
    parser.add_argument("--bucket-mb", type=float, default=64.0)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args(argv)
    rows = []
    for pair in PAIRS:
        out_path = f"{args.json}.{pair[0].replace('>', '')}.part"
        mp.spawn(_rank_main, args=(pair[1], _free_port(), pair, args.bucket_mb, args.repeats, out_path),
                 nprocs=pair[1], join=True)
        with open(out_path) as f:
            rows.append(json.load(f))
        os.remove(out_path)
        r = rows[-1]
        print(f"{r['pair']:>12}: received {r['bytes_received_per_rank_max'] / 2**20:7.1f} MiB "
              f"(minimum {r['bytes_minimum_per_rank_max'] / 2**20:7.1f}, naive {r['bytes_naive_per_rank_max'] / 2**20:7.1f}) "
              f"time {r['seconds']:.3f}s vs naive {r['seconds_naive']:.3f}s "
              f"({r['seconds'] / r['seconds_naive']:.2f}x) peak extra {r['peak_extra_bytes'] / 2**20:.0f} MiB "
              f"(naive {r['peak_extra_bytes_naive'] / 2**20:.0f}) diff {r['max_abs_diff']}", flush=True)
    tmp = args.json + ".tmp"
    with open(tmp, "w") as f:
        json.dump(rows, f, indent=1)
    os.replace(tmp, args.json)  # never a half-written result file
    return 0


if __name__ == "__main__":
    sys.exit(main())
