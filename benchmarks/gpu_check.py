"""`make gpu-check`: the checks that need a GPU, in one run, with their figures.

    python benchmarks/gpu_check.py [--out DIR] [--gib 4]

1. Offload against a raw copy of the same bytes into pinned host memory (benchmarks/bench_offload.py on
   cuda): each direction must reach 0.8 of the raw copy's speed, and the round trip must be bit-exact.
2. On CUDA (`MINDSPEED_RL_TEST_DEVICE=cuda`, a one-rank nccl world): the Megatron engine against HF's
   forward and its weights' round trip, the bit-exact offload tests (fp32, bf16, the distributed
   optimizer, the swap optimizer), and the ledger against `torch.cuda.memory_allocated` (tests/test_ledger_on_device.py).
3. The swap optimizer's step with bucket k+1's copy overlapping bucket k's step against one bucket at a time and
   against the states kept on the device (benchmarks/bench_swap_optimizer.py); the params must end equal.

Prints one markdown table of the figures (README's "Measured on GPU") and writes offload_cuda.json,
swap_optimizer_cuda.json, gpu_tests.xml and summary.md under --out. Exit 0 only when every check passed.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import xml.etree.ElementTree as ElementTree
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
MIN_RATIO_OF_RAW_COPY = 0.8
DEVICE_TESTS = [
    "tests/test_engines_single_rank.py::test_megatron_logits_equal_hf",
    "tests/test_engines_single_rank.py::test_hf_weights_round_trip_exact",
    "tests/test_offload_bit_exact.py",
    "tests/test_distributed_optimizer.py",
    "tests/test_ledger_on_device.py",
    "tests/test_swap_optimizer.py::test_the_swapped_step_is_the_unswapped_step_bit_for_bit",
    "tests/test_capacity_on_device.py",
]


def _env(**extra: str) -> dict[str, str]:
    return dict(os.environ, PYTHONPATH=f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}", **extra)


def _offload(out: Path, gib: float) -> tuple[bool, list[str]]:
    target = out / "offload_cuda.json"
    done = subprocess.run([sys.executable, str(ROOT / "benchmarks/bench_offload.py"), "--device", "cuda",
                           "--gib", str(gib), "--json", str(target)], cwd=ROOT, env=_env())
    if done.returncode != 0 or not target.exists():
        return False, [f"| offload benchmark | failed (exit {done.returncode}) |"]
    r = json.loads(target.read_text())
    ok = r["bit_exact"] and min(r["offload_vs_raw"], r["reload_vs_raw"]) >= MIN_RATIO_OF_RAW_COPY
    return ok, [
        f"| offload, {r['bytes'] / 2**30:.1f} GiB in {r['tensors']} tensors to pinned mirrors | "
        f"{r['gib_per_second_offload']:.1f} GiB/s = {r['offload_vs_raw']:.2f} of a raw copy "
        f"({r['gib_per_second_raw_copy']:.1f} GiB/s) |",
        f"| reload, the same bytes back | {r['gib_per_second_reload']:.1f} GiB/s = {r['reload_vs_raw']:.2f} of a raw "
        f"copy; bit-exact: {r['bit_exact']} |",
    ]


def _swap(out: Path) -> tuple[bool, list[str]]:
    target = out / "swap_optimizer_cuda.json"
    done = subprocess.run([sys.executable, str(ROOT / "benchmarks/bench_swap_optimizer.py"), "--device", "cuda",
                           "--json", str(target)], cwd=ROOT, env=_env())
    if not target.exists():
        return False, [f"| swap optimizer benchmark | failed (exit {done.returncode}) |"]
    r = json.loads(target.read_text())
    serial, overlapped = r["swapped_serial"], r["swapped_overlapped"]
    return r["bit_equal"], [
        f"| swap optimizer step, {r['parameters'] / 1e6:.0f}M {r['dtype']} params, "
        f"{overlapped['bytes_each_way_per_step'] / 2**30:.2f} GiB of states each way in {overlapped['buckets']} buckets "
        f"| overlapped {overlapped['step_seconds'] * 1e3:.1f} ms = {r['overlapped_vs_serial']:.2f} of one bucket at a "
        f"time ({serial['step_seconds'] * 1e3:.1f} ms); states kept on the device "
        f"{r['resident']['step_seconds'] * 1e3:.1f} ms; at most {overlapped['most_on_device_bytes'] / 2**20:.0f} MiB "
        f"of states on the device; params equal to the unswapped step's: {r['bit_equal']} |"]


def _device_tests(out: Path) -> tuple[bool, list[str]]:
    report = out / "gpu_tests.xml"
    env = _env(MINDSPEED_RL_TEST_DEVICE="cuda")
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-rs",
                           f"--junitxml={report}", *DEVICE_TESTS], cwd=ROOT, env=env)
    if not report.exists():
        return False, [f"| tests on CUDA | pytest wrote no report (exit {done.returncode}) |"]
    return done.returncode == 0, _test_rows(report)


def _test_rows(report: Path) -> list[str]:
    rows, props = [], {}
    for case in ElementTree.parse(report).iter("testcase"):
        verdict = "failed" if case.find("failure") is not None or case.find("error") is not None else (
            "skipped" if case.find("skipped") is not None else "passed")
        rows.append(f"| {case.get('classname').split('.')[-1]}::{case.get('name')} on CUDA | {verdict} |")
        props |= {p.get("name"): int(float(p.get("value"))) for p in case.iter("property")}
    if props:
        mib = 2**20
        rows.append(f"| ledger vs torch.cuda.memory_allocated (bf16 actor, distributed optimizer, reference) | "
                    f"ledger {props['ledger_bytes']} B; the engines requested {props['requested_held_bytes']} B "
                    f"({props['requested_held_bytes'] / props['ledger_bytes'] - 1:.2%} unattributed); offload frees "
                    f"{props['offload_freed_bytes']} requested B ({props['allocated_freed_bytes'] / mib:.1f} MiB of "
                    f"allocator blocks) |")
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", "gpu-check-out")))
    parser.add_argument("--gib", type=float, default=4.0, help="offload benchmark state size (default 4)")
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    import torch

    if not torch.cuda.is_available():
        print("gpu-check: no CUDA device is visible to torch; nothing to check here", file=sys.stderr)
        return 2
    offload_ok, offload_rows = _offload(args.out, args.gib)
    swap_ok, swap_rows = _swap(args.out)
    tests_ok, test_rows = _device_tests(args.out)
    summary = "\n".join([f"Measured on {torch.cuda.get_device_name()} (torch {torch.__version__}):", "",
                         "| check | result |", "| --- | --- |", *offload_rows, *swap_rows, *test_rows]) + "\n"
    (args.out / "summary.md").write_text(summary)
    print(summary)
    return 0 if offload_ok and swap_ok and tests_ok else 1


if __name__ == "__main__":
    sys.exit(main())
