"""The swap optimizer's step (memory/swap_optimizer.py) against the same step with the states kept on the device.

    python benchmarks/bench_swap_optimizer.py [--device cuda] [--hidden 2048 --layers 8] [--times 16] [--json F]

Three actors of one Qwen2-shaped model (same weights, same batch) each take `--steps` training steps; only
Megatron's `optimizer.step()` is timed (synchronized before and after; the first step, which creates Adam's states, is
not counted): the states resident on the device (the oracle), swapped one bucket at a time (`overlap_copies=False`),
and swapped with bucket k+1's copy in on the accelerator's copy stream while bucket k steps (the default; on cpu
there is no copy stream and the two swapped sides are the same path). Prints the median step seconds, the
overlapped / serial ratio, the bytes each swapped step moves each way, the most optimizer bytes it held on the
device against all of them, and whether the three actors' params end equal (torch.equal).
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import socket
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]

SIDES = ("resident", "swapped_serial", "swapped_overlapped")


def _world(device: str):
    """One rank on `device`: its accelerator and its groups (RankGroups, TP1 PP1)."""
    import torch.distributed as dist

    from mindspeed_rl.accelerator import get_accelerator
    from mindspeed_rl.parallel import megatron_state
    from mindspeed_rl.parallel.layout import TrainLayout

    accelerator = get_accelerator(device)
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
    accelerator.set_device(0)
    dist.init_process_group(accelerator.distributed_backend, rank=0, world_size=1)
    parallel = megatron_state.initialize(TrainLayout(), rank=0, world_size=1, timeout_minutes=30)
    accelerator.seed_model_parallel_rng(1)
    return accelerator, parallel


def _timed_steps(actor, accelerator, seconds: list[float]) -> None:
    step = actor.optimizer.step

    def timed():
        accelerator.synchronize()
        start = time.perf_counter()
        out = step()
        accelerator.synchronize()
        seconds.append(time.perf_counter() - start)
        return out

    actor.optimizer.step = timed


def _side(side: str, args, spec, state, accelerator, parallel, batch) -> dict:
    from mindspeed_rl.engines.megatron_engine import MegatronEngine
    from mindspeed_rl.memory.swap_optimizer import SwappedOptimizerStates
    from tiny_actor import ADAM, response_loss_fn

    dtype = getattr(torch, args.dtype)
    actor = MegatronEngine(spec=spec, hf_state=state, params_dtype=dtype, accelerator=accelerator, parallel=parallel,
                           optimizer=ADAM)
    swapped = None
    if side != "resident":
        swapped = SwappedOptimizerStates(actor.optimizer, accelerator, times=args.times,
                                         overlap_copies=side == "swapped_overlapped")
        swapped.offload()
    seconds: list[float] = []
    _timed_steps(actor, accelerator, seconds)
    for _ in range(args.steps + 1):
        actor.train_step(batch, micro_batch_size=args.micro_batch, temperature=1.0, loss_fn=response_loss_fn(batch))
    out = {"step_seconds": statistics.median(seconds[1:]), "steps": seconds[1:],
           "params": [p.detach().cpu().clone() for p in actor.module.parameters()]}
    if swapped is not None:
        out |= {"bytes_each_way_per_step": sum(swapped.bucket_bytes()), "buckets": swapped.num_buckets,
                "most_on_device_bytes": swapped.peak_since_read(), "buckets_in_flight": swapped.buckets_in_flight}
    del actor, swapped
    gc.collect()  # the bucketed step's closures keep the mirrors in a cycle with the optimizer
    accelerator.empty_cache()
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", default=None, help="bfloat16 on a device, float32 on cpu (bf16 is slow here)")
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--ffn", type=int, default=5632)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--times", type=int, default=16, help="swap_optimizer_times")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--micro-batch", type=int, default=8)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    args.dtype = args.dtype or ("bfloat16" if args.device != "cpu" else "float32")
    from mindspeed_rl.data.tiny_model import create_tiny_qwen2_checkpoint
    from mindspeed_rl.models.checkpoint import load_hf_checkpoint
    from mindspeed_rl.protocol import RolloutBatch

    accelerator, parallel = _world(args.device)
    with tempfile.TemporaryDirectory() as directory:
        create_tiny_qwen2_checkpoint(directory, vocab_size=args.vocab, hidden_size=args.hidden,
                                     ffn_hidden_size=args.ffn, num_layers=args.layers,
                                     num_attention_heads=args.hidden // 128, num_query_groups=max(args.hidden // 512, 1),
                                     seed=3)
        spec, state = load_hf_checkpoint(directory)
    g = torch.Generator().manual_seed(7)
    batch = RolloutBatch.from_token_lists([torch.randint(1, args.vocab, (64,), generator=g).tolist()] * 8,
                                          [torch.randint(1, args.vocab, (64,), generator=g).tolist()] * 8,
                                          pad_id=0, response_width=64)
    results = {side: _side(side, args, spec, state, accelerator, parallel, batch) for side in SIDES}
    params = {side: results[side].pop("params") for side in SIDES}
    report = {
        "device": torch.cuda.get_device_name() if args.device == "cuda" else args.device, "dtype": args.dtype,
        "parameters": sum(p.numel() for p in params["resident"]), "swap_optimizer_times": args.times,
        **results,
        "overlapped_vs_serial": results["swapped_overlapped"]["step_seconds"]
        / results["swapped_serial"]["step_seconds"],
        "swapped_vs_resident": results["swapped_overlapped"]["step_seconds"] / results["resident"]["step_seconds"],
        "bit_equal": all(torch.equal(a, b) for side in SIDES[1:] for a, b in zip(params[side], params["resident"])),
    }
    _print(report)
    if args.json:
        args.json.write_text(json.dumps(report, indent=2))
    return 0 if report["bit_equal"] else 1


def _print(r: dict) -> None:
    gib = 2**30
    moved = r["swapped_overlapped"]["bytes_each_way_per_step"]
    print(f"swap optimizer on {r['device']} ({r['dtype']}, {r['parameters'] / 1e6:.0f}M parameters, "
          f"swap_optimizer_times {r['swap_optimizer_times']}: {r['swapped_overlapped']['buckets']} buckets, "
          f"{moved / gib:.2f} GiB of states each way per step)")
    for side in SIDES:
        line = f"  {side:<20} step {r[side]['step_seconds'] * 1e3:8.1f} ms"
        if "most_on_device_bytes" in r[side]:
            line += (f"  at most {r[side]['most_on_device_bytes'] / gib:.2f} GiB of states on the device "
                     f"({r[side]['buckets_in_flight']} bucket(s) in flight); "
                     f"{2 * moved / r[side]['step_seconds'] / gib:.1f} GiB/s both ways")
        print(line)
    print(f"  overlapped / serial: {r['overlapped_vs_serial']:.2f}   swapped / resident: "
          f"{r['swapped_vs_resident']:.1f}   params equal on all three sides: {r['bit_equal']}")


if __name__ == "__main__":
    sys.exit(main())
