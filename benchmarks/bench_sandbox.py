"""The wall's start cost per tool call, side by side with the unwalled run (tools/sandbox.run_python).

    python benchmarks/bench_sandbox.py [--calls 20] [--json FILE]

Each round runs the same two programs (`print(6*7)`, and `import numpy, sympy` with a line of work, ordinary tool
code) without and with the wall, alternating; medians of `--calls` rounds after one warm-up of each.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

PROGRAMS = {"print": "print(6*7)",
            "numpy+sympy": "import numpy, sympy\nprint(int(numpy.arange(10).sum()), sympy.factor(sympy.Symbol('x')**2 - 1))"}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=20)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    if args.calls < 1:
        parser.error(f"--calls: must be >= 1, got {args.calls}")
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    from mindspeed_rl.tools.sandbox import FINISHED, run_python
    from mindspeed_rl.tools.wall import wall_unavailable_reason

    reason = wall_unavailable_reason()
    if reason is not None:
        print(f"bench_sandbox: no wall on this host: {reason}", file=sys.stderr)
        return 2
    seconds: dict[str, list[float]] = {f"{name} {mode}": [] for name in PROGRAMS for mode in ("unwalled", "walled")}
    for round_index in range(args.calls + 1):
        for name, code in PROGRAMS.items():
            for mode in ("unwalled", "walled"):
                started = time.perf_counter()
                run = run_python(code, timeout_seconds=30, memory_limit_mb=1024, isolated=mode == "walled")
                assert run.status == FINISHED, run.stderr
                if round_index:  # the first round warms the page cache for both
                    seconds[f"{name} {mode}"].append(time.perf_counter() - started)
    result = {key: statistics.median(values) for key, values in seconds.items()}
    for name in PROGRAMS:
        walled, unwalled = result[f"{name} walled"], result[f"{name} unwalled"]
        print(f"{name:12s} unwalled {unwalled * 1000:7.1f} ms   walled {walled * 1000:7.1f} ms   "
              f"(+{(walled - unwalled) * 1000:.1f} ms per call)")
    if args.json:
        partial = args.json.with_name(args.json.name + ".partial")
        partial.write_text(json.dumps({"median_seconds": result, "calls": args.calls, "cpus": os.cpu_count()}, indent=2))
        os.replace(partial, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
