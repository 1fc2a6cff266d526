"""Offload and reload throughput of the storage offloader against a raw copy of the same bytes.

    python benchmarks/bench_offload.py --json FILE [--gib 1] [--tensors 16] [--repeats 5] [--device auto]
                                       [--no-huge-pages]

One run, side by side: a state of `--gib` GiB in `--tensors` tensors is offloaded (copy to the
host mirror, then the device storage is freed) and reloaded (storage re-acquired, copy back)
through `mindspeed_rl.memory.Offloader`; the raw reference is `dst.copy_(src)` of the same
tensors into preallocated host buffers. The first offload allocates the mirrors and is reported
apart (`*_first`); the headline figures are the median of `--repeats` steady-state rounds.
`seconds_fresh_copy` copies the same bytes into freshly allocated memory: on CPU that is the
floor for a reload, because a freed storage comes back as new pages the kernel must map and zero.
Exit code 2 on a bad argument.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path


def _args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", type=Path, help="write the figures to this file")
    parser.add_argument("--gib", type=float, default=1.0, help="state size in GiB (default 1)")
    parser.add_argument("--tensors", type=int, default=16, help="number of tensors the state is split into")
    parser.add_argument("--repeats", type=int, default=5, help="steady-state rounds (median reported)")
    parser.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda", "npu"))
    parser.add_argument("--no-huge-pages", action="store_true",
                        help="ablation: 4 KiB pages for CPU storages and mirrors, and no THP in torch's allocator")
    args = parser.parse_args(argv)
    for key, low in (("gib", 0.0), ("tensors", 0), ("repeats", 0)):
        if getattr(args, key) <= low:
            parser.error(f"--{key}: must be > {low:g}, got {getattr(args, key)}")
    return args


def _rss_bytes() -> int:
    import psutil

    return psutil.Process().memory_info().rss


def _timed(fn) -> float:
    started = time.perf_counter()
    fn()
    return time.perf_counter() - started


def _ratio_range(reference: list[float], measured: list[float]) -> list[float]:
    ratios = [r / m for r, m in zip(reference, measured)]
    return [min(ratios), max(ratios)]


def run(args: argparse.Namespace) -> dict:
    import torch

    from mindspeed_rl.accelerator import get_accelerator
    from mindspeed_rl.accelerator.host_memory import huge_pages_enabled, set_huge_pages
    from mindspeed_rl.memory import Offloader

    set_huge_pages(not args.no_huge_pages)

    acc = get_accelerator(args.device)
    numel = int(args.gib * 2**30) // 4 // args.tensors
    g = torch.Generator().manual_seed(0)
    states = [torch.randn(numel, generator=g).to(acc.device) for _ in range(args.tensors)]
    samples = [t[:: max(1, numel // 1024)].clone() for t in states]  # a cheap bit-exactness check
    nbytes = sum(t.nbytes for t in states)
    # The same kind of host memory as the mirrors (pinned, or huge pages on CPU): the fastest
    # destination this machine offers, so the raw copy is the strongest baseline.
    raw_dst = [torch.empty(0, dtype=torch.float32).set_(acc.host_buffer(t.nbytes)) for t in states]
    for dst in raw_dst:
        dst.zero_()  # touch every page: "preallocated" means already mapped

    def raw_to_host() -> None:
        for src, dst in zip(states, raw_dst):
            dst.copy_(src, non_blocking=acc.supports_pinned_memory)
        acc.synchronize()

    def raw_to_device() -> None:
        for src, dst in zip(raw_dst, states):
            dst.copy_(src, non_blocking=acc.supports_pinned_memory)
        acc.synchronize()

    def fresh_copy() -> None:
        fresh = []
        for t in states:  # new device memory from the same allocator a reload uses
            storage = torch.UntypedStorage(0, device=acc.device)
            acc.acquire_storage(storage, t.nbytes)
            fresh.append(torch.empty(0, dtype=t.dtype, device=acc.device).set_(storage))
        for src, dst in zip(raw_dst, fresh):
            dst.copy_(src)
        acc.synchronize()

    offloader = Offloader(acc)
    offloader.register("state", lambda: states)
    first_offload = _timed(lambda: offloader.offload("state"))
    first_reload = _timed(lambda: offloader.reload("state"))
    rounds: dict[str, list[float]] = {k: [] for k in ("raw", "raw_to_device", "offload", "reload", "fresh")}
    for _ in range(args.repeats):  # interleaved, so that drift hits every figure alike
        rounds["raw"].append(_timed(raw_to_host))
        rounds["raw_to_device"].append(_timed(raw_to_device))
        rss_resident = _rss_bytes()
        rounds["offload"].append(_timed(lambda: offloader.offload("state")))
        assert offloader.resident_bytes()["state"] == 0
        rss_offloaded = _rss_bytes()
        rounds["reload"].append(_timed(lambda: offloader.reload("state")))
        rounds["fresh"].append(_timed(fresh_copy))
    exact = all(torch.equal(t[:: max(1, numel // 1024)], s) for t, s in zip(states, samples))
    med = {k: statistics.median(v) for k, v in rounds.items()}
    return {
        "bytes": nbytes,
        "seconds_offload": med["offload"],
        "seconds_reload": med["reload"],
        "seconds_raw_copy": med["raw"],
        "seconds_raw_copy_to_device": med["raw_to_device"],
        "seconds_offload_first": first_offload,
        "seconds_reload_first": first_reload,
        "seconds_fresh_copy": med["fresh"],
        "offload_vs_raw": med["raw"] / med["offload"],
        "reload_vs_raw": med["raw_to_device"] / med["reload"],
        "reload_vs_fresh_copy": med["fresh"] / med["reload"],
        # Per-round ratios (each round's raw copy against the same round's offload/reload): the
        # spread shows how much the shared machine's memory speed moves within one run.
        "offload_vs_raw_range": _ratio_range(rounds["raw"], rounds["offload"]),
        "reload_vs_raw_range": _ratio_range(rounds["raw_to_device"], rounds["reload"]),
        "gib_per_second_offload": nbytes / med["offload"] / 2**30,
        "gib_per_second_reload": nbytes / med["reload"] / 2**30,
        "gib_per_second_raw_copy": nbytes / med["raw"] / 2**30,
        # On CPU the device is host memory: a storage that is really freed shows as a smaller RSS.
        "rss_freed_bytes": rss_resident - rss_offloaded,
        "steady_state": "median of --repeats rounds after the first offload allocated the mirrors",
        "bit_exact": exact,
        "device": acc.name, "pinned": acc.supports_pinned_memory, "threads": torch.get_num_threads(),
        "huge_pages": huge_pages_enabled(),
        "tensors": args.tensors, "repeats": args.repeats,
    }


def _fmt_range(bounds: list[float]) -> str:
    return f"{bounds[0]:.2f}-{bounds[1]:.2f}"


def main(argv: list[str] | None = None) -> int:
    args = _args(argv)
    # torch reads this once, at its first allocation: it must be set before torch is imported.
    os.environ["THP_MEM_ALLOC_ENABLE"] = "0" if args.no_huge_pages else os.environ.get("THP_MEM_ALLOC_ENABLE", "1")
    result = run(args)
    gib = result["bytes"] / 2**30
    print(f"{gib:.2f} GiB on {result['device']} ({result['threads']} threads, huge pages={result['huge_pages']}, "
          f"pinned={result['pinned']}), median of {result['repeats']} steady-state rounds:")
    print(f"  raw copy    {result['seconds_raw_copy']:.3f} s  ({result['gib_per_second_raw_copy']:.1f} GiB/s)")
    print(f"  offload     {result['seconds_offload']:.3f} s  ({result['gib_per_second_offload']:.1f} GiB/s)"
          f"  = {result['offload_vs_raw']:.2f} of raw copy  (rounds {_fmt_range(result['offload_vs_raw_range'])}; "
          f"first: {result['seconds_offload_first']:.3f} s)")
    print(f"  reload      {result['seconds_reload']:.3f} s  ({result['gib_per_second_reload']:.1f} GiB/s)"
          f"  = {result['reload_vs_raw']:.2f} of raw copy  (rounds {_fmt_range(result['reload_vs_raw_range'])}; "
          f"first: {result['seconds_reload_first']:.3f} s)")
    print(f"  fresh copy  {result['seconds_fresh_copy']:.3f} s  (copy into new memory; reload = "
          f"{result['reload_vs_fresh_copy']:.2f} of it)   bit-exact: {result['bit_exact']}")
    print(f"  process RSS while offloaded: {result['rss_freed_bytes'] / 2**30:.2f} GiB lower than while resident")
    if args.json:
        partial = args.json.with_name(args.json.name + ".partial")
        partial.write_text(json.dumps(result, indent=2) + "\n")
        os.replace(partial, args.json)  # never a half-written result file
    return 0 if result["bit_exact"] else 1


if __name__ == "__main__":
    sys.exit(main())
