"""Where the demo's iteration time goes: py-spy samples of every process, summarised per phase.

    python benchmarks/profile_demo.py [--out DIR] [--iterations 16] [--warmup 3] [--rate 100]

Starts `cli/train_grpo.py --config-name grpo_tiny_cpu` (unchanged), waits until `--warmup` iterations have
finished, then attaches py-spy (pinned in benchmarks/requirements-bench.txt; the bench venv is made on first
use) to the driver and all its descendants (Ray's Python processes and the rank actor), non-blocking, until
the run ends. Every sample is assigned to a process role and a phase by the frames on its stack:

- rank: `generate` (split into `switch` = the weight push and `vllm` = the engine's generate), `ref_logprob`,
  `old_logprob`, `update`, `rpc wrapper` (the phase_rpc decorator's moves between phases, the KV cache's
  rebuild and release among them, and its ledger, outside the method), `idle/other` (Ray's loop, heartbeats);
- driver: the function directly under `train()` (generate's batch assembly, decode, rewards, the RPC calls'
  Python side, metrics, sinks, plots);
- Ray's own Python processes (dashboard, agents, log monitor) by name.

CPU seconds per iteration = samples / rate / iterations recorded (only threads running Python code are
sampled: a process waiting on a reply costs nothing here). The summary lists, per phase, the seconds per
iteration, the top functions by self time and the innermost frames in our own code (mindspeed_rl/), which is
where a change would go. Writes DIR/summary.txt, DIR/summary.json and py-spy's raw stacks DIR/raw.txt.
"""
from __future__ import annotations

import argparse
import collections
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

BENCH_DIR = Path(__file__).resolve().parent
REPO = BENCH_DIR.parent
sys.path.insert(0, str(BENCH_DIR))

from _procmon import Launched  # noqa: E402
from bench_venv import ensure_bench_venv, py_spy  # noqa: E402

FRAME = re.compile(r"^(?P<func>.*) \((?P<file>[^()]*?)(?::(?P<line>\d+))?\)$")
# Leaves where a thread waits in native code: py-spy's --nonblocking mode cannot always tell these threads are
# idle (psutil shows the processes use ~0 CPU), so they are counted apart and left out of the phase figures.
IDLE_LEAVES = {("Worker.main_loop", "ray/_private/worker.py"), ("_PollLikeSelector.select", "selectors.py"),
               ("EpollSelector.select", "selectors.py")}
RANK_PHASES = {
    "generate_sequences": "generate", "compute_ref_log_prob": "ref_logprob", "compute_log_prob": "old_logprob",
    "update": "update", "initialize": "initialize",
}


def _args(argv):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=REPO / "outputs" / "profile")
    parser.add_argument("--iterations", type=int, default=16, help="iterations after the warm-up (default 16)")
    parser.add_argument("--warmup", type=int, default=3, help="iterations before py-spy attaches (default 3)")
    parser.add_argument("--rate", type=int, default=100, help="samples per second (default 100)")
    parser.add_argument("--top", type=int, default=8, help="functions listed per phase (default 8)")
    parser.add_argument("--raw", type=Path, help="summarise this raw file instead of running (needs --iterations)")
    parser.add_argument("--startup", action="store_true",
                        help="profile from launch to the end of iteration 1 instead: where start-up time goes, "
                             "per process, imports by top-level module")
    return parser.parse_args(argv)


def parse_frame(text: str) -> tuple[str, str, str]:
    m = FRAME.match(text.strip())
    if not m:
        return text.strip(), "", ""
    return m.group("func"), m.group("file"), m.group("line") or ""


def classify(frames: list[str]) -> tuple[str, str]:
    """(role, phase) of one stack (root first; the first frame names the process with --subprocesses)."""
    procs = [f for f in frames if f.startswith("process ")]
    head = procs[-1] if procs else ""
    parsed = [parse_frame(f) for f in frames if not f.startswith("process ")]
    files = [p[1] for p in parsed]
    funcs = [p[0] for p in parsed]
    if "train_grpo.py" in head:
        # One rank runs in the CLI's process (runtime.local_single_rank): its stacks are the rank's.
        role = "rank" if any("/workers/parts/" in f for f in files) else "driver"
    elif re.search(r"ray::\w+Worker", head):
        role = "rank"
    else:
        name = re.sub(r"^process \d+:", "", head).strip('"')
        for key in ("dashboard", "agent", "log_monitor", "monitor.py", "ray::IDLE", "ray::"):
            if key in name:
                return "ray", key
        return "other", os.path.basename(name.split()[0]) if name else "?"
    if role == "rank":
        for func, file in zip(funcs, files):
            name = func.rsplit(".", 1)[-1]
            if "/workers/parts/" in file and name in RANK_PHASES:
                phase = RANK_PHASES[name]
                if phase == "generate":
                    if any(f.endswith("vllm_engine.py") and fn.endswith("generate") for fn, f in zip(funcs, files)):
                        return role, "generate.vllm"
                    return role, "generate.other"
                return role, phase
        if any(f.endswith(("weight_push.py", "resharding/transfer.py", "fingerprint.py")) for f in files):
            return role, "generate.switch"
        if any(f.endswith("workers/phase_rpc.py") for f in files):
            return role, "rpc wrapper (onload/offload/ledger)"
        return role, "idle/other (Ray loop, heartbeat)"
    # driver: the function right under train(), or the start-up/shutdown
    for i, (func, file) in enumerate(zip(funcs, files)):
        if func == "train" and file.endswith("grpo_trainer.py"):
            below = funcs[i + 1] if i + 1 < len(funcs) else "train (self)"
            below_file = files[i + 1] if i + 1 < len(files) else ""
            return role, f"loop: {below} ({os.path.basename(below_file)})"
    return role, "outside the loop (start-up/shutdown)"


def _stacks(raw_path: Path):
    """(frames, count) per raw line; a process title holding newlines (python -c "...") spans several lines."""
    pending = ""
    for line in raw_path.read_text().splitlines():
        pending = f"{pending}\\n{line}" if pending else line
        stack, _, count = pending.rpartition(" ")
        if count.isdigit() and stack:
            yield stack.split(";"), int(count)
            pending = ""


def summarise(raw_path: Path, iterations: int, rate: int, top: int) -> dict:
    phases: dict[tuple[str, str], int] = collections.Counter()
    self_time: dict[tuple[str, str], collections.Counter] = collections.defaultdict(collections.Counter)
    ours_time: dict[tuple[str, str], collections.Counter] = collections.defaultdict(collections.Counter)
    total = idle = 0
    for frames, count in _stacks(raw_path):
        leaf_func, leaf_file, _ = parse_frame(frames[-1])
        if (leaf_func, leaf_file) in IDLE_LEAVES:
            idle += count
            continue
        key = classify(frames)
        phases[key] += count
        total += count
        self_time[key][f"{leaf_func} ({leaf_file})" if leaf_file else "(native: no Python frame)"] += count
        ours = [parse_frame(f) for f in frames if "mindspeed_rl/" in f and not f.startswith("process ")]
        if ours:
            func, file, lineno = ours[-1]
            ours_time[key][f"{func} ({file}:{lineno})"] += count
    per_iter = lambda n: n / rate / iterations  # noqa: E731
    out = {"iterations": iterations, "rate": rate, "total_samples": total,
           "cpu_seconds_per_iteration": per_iter(total), "idle_samples_left_out": idle, "phases": []}
    for (role, phase), n in sorted(phases.items(), key=lambda kv: -kv[1]):
        out["phases"].append({
            "role": role, "phase": phase, "cpu_seconds_per_iteration": per_iter(n),
            "top_self": [(name, per_iter(c)) for name, c in self_time[(role, phase)].most_common(top)],
            "top_ours": [(name, per_iter(c)) for name, c in ours_time[(role, phase)].most_common(top)],
        })
    return out


def render(summary: dict, meta: dict) -> str:
    lines = [f"py-spy profile of the demo: {summary['iterations']} iterations after {meta.get('warmup')} warm-up, "
             f"{summary['rate']} Hz, non-blocking; CPU seconds per iteration (processes running Python only)",
             f"measured iteration time while profiled (median timing/all): {meta.get('median_iteration_s', 0):.3f}s; "
             f"load average {meta.get('load')}; foreign cores busy {meta.get('foreign_cores_busy')}",
             f"total: {summary['cpu_seconds_per_iteration']:.3f} s/iteration of samples in Python-running threads "
             f"({summary['idle_samples_left_out']} samples waiting in Ray's main loop / selectors left out)",
             "CPU seconds per iteration by process (psutil, the same window): "
             + ", ".join(f"{k} {v:.3f}" for k, v in (meta.get("cpu_s_per_iteration_by_process") or {}).items()),
             "RSS (MiB) by process at the peak of the summed RSS: "
             + ", ".join(f"{k} {v}" for k, v in ((meta.get("memory") or {}).get("rss_mib_by_process_at_peak") or {}).items()),
             ""]
    for p in summary["phases"]:
        if p["cpu_seconds_per_iteration"] < 0.002:
            continue
        lines.append(f"[{p['role']}] {p['phase']}: {p['cpu_seconds_per_iteration']:.3f} s/iteration")
        lines.append("    top self time:")
        lines.extend(f"      {s:.4f}  {name}" for name, s in p["top_self"])
        if p["top_ours"]:
            lines.append("    innermost mindspeed_rl frame:")
            lines.extend(f"      {s:.4f}  {name}" for name, s in p["top_ours"])
    return "\n".join(lines)


def _import_target(frames: list[str]) -> str | None:
    """The top-level module of the outermost import in a stack (what a lazy import would defer), else None."""
    for f in frames:
        func, file, _ = parse_frame(f)
        if func == "_find_and_load" and "importlib" in file:
            return "import"
    return None


def summarise_startup(raw_path: Path, rate: int, top: int) -> dict:
    """Per process: seconds in imports (by the module the first non-import frame of ours/the library imports)
    and outside them, by the function under the process's entry point."""
    per_process: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
    importers: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
    for frames, count in _stacks(raw_path):
        leaf_func, leaf_file, _ = parse_frame(frames[-1])
        if (leaf_func, leaf_file) in IDLE_LEAVES:
            continue
        procs = [f for f in frames if f.startswith("process ")]
        name = re.sub(r"^process \d+:", "", procs[-1]).strip('"') if procs else "?"
        if "train_grpo.py" in name:
            proc = "driver"
        elif name.startswith("ray::"):
            proc = name.split(".")[0]
        else:
            proc = os.path.basename(name.split()[0]) if name else "?"
            for part in name.split()[:3]:
                if part.endswith(".py"):
                    proc = os.path.basename(part)
        code = [f for f in frames if not f.startswith("process ")]
        parsed = [parse_frame(f) for f in code]
        if _import_target(code):
            # the last frame before the first _find_and_load: who imports; the module: first "<module>" after it
            first = next(i for i, (fn, fl, _) in enumerate(parsed) if fn == "_find_and_load")
            importer = parsed[first - 1] if first else ("?", "?", "")
            module = next((fl for fn, fl, _ in parsed[first:] if fn == "<module>"), "?")
            top_pkg = module.split("/")[0] if "/" in module else module
            per_process[proc]["imports"] += count
            importers[proc][f"{top_pkg} (imported from {importer[0]} in {importer[1]})"] += count
        else:
            # the deepest frame of ours, else the leaf's package
            ours = [p for p in parsed if p[1].startswith("mindspeed_rl/")]
            where = f"{ours[-1][0]} ({ours[-1][1]})" if ours else f"{leaf_func} ({leaf_file.split('/')[0]})"
            per_process[proc][where] += count
    sec = lambda n: n / rate  # noqa: E731
    return {proc: {"seconds": sec(sum(c.values())), "imports_s": sec(c["imports"]),
                   "top": [(k, sec(v)) for k, v in c.most_common(top)],
                   "imports_by_module": [(k, sec(v)) for k, v in importers[proc].most_common(top)]}
            for proc, c in sorted(per_process.items(), key=lambda kv: -sum(kv[1].values()))}


def run_startup(args) -> dict:
    ensure_bench_venv()
    args.out.mkdir(parents=True, exist_ok=True)
    run_dir = args.out / "run-startup"
    if (run_dir / "metrics.jsonl").exists():
        (run_dir / "metrics.jsonl").unlink()
    raw = args.out / "raw-startup.txt"
    argv = [str(py_spy()), "record", "--subprocesses", "--nonblocking", "--format", "raw", "--rate", str(args.rate),
            "--output", str(raw), "--", sys.executable, "cli/train_grpo.py", "--config-name", "grpo_tiny_cpu",
            "megatron_training.train_iters=1", f"hydra.run.dir={run_dir}", "runtime.memory_timeline=false"]
    demo = Launched(argv, cwd=str(REPO), log_path=str(args.out / "demo-startup.log"))
    code = demo.wait(timeout=600)
    if code != 0:
        raise RuntimeError(f"py-spy/demo exited {code}; see {args.out / 'demo-startup.log'}")
    load = demo.load()
    summary = summarise_startup(raw, args.rate, args.top)
    lines = [f"py-spy from launch to the end of iteration 1 (and shutdown), {args.rate} Hz, non-blocking; wall "
             f"{demo.samples[-1]['t'] - demo.launched_at:.1f}s (profiled); load {load.get('load1_min', 0):.2f}-"
             f"{load.get('load1_max', 0):.2f}, foreign cores {load.get('foreign_cores_busy', 0):.2f}",
             "seconds of samples in Python-running threads, per process (imports = inside importlib):"]
    for proc, x in summary.items():
        if x["seconds"] < 0.05:
            continue
        lines.append(f"[{proc}] {x['seconds']:.2f}s, of which imports {x['imports_s']:.2f}s")
        lines.extend(f"      {v:6.2f}  {k}" for k, v in x["top"] if k != "imports")
        if x["imports_by_module"]:
            lines.append("    imports by top-level module:")
            lines.extend(f"      {v:6.2f}  {k}" for k, v in x["imports_by_module"])
    text = "\n".join(lines)
    (args.out / "startup.txt").write_text(text + "\n")
    (args.out / "startup.json").write_text(json.dumps({"load": load, "per_process": summary}, indent=2))
    print(text)
    print(f"\n[profile] {args.out / 'startup.txt'}, {raw}")
    return summary


def run(args) -> dict:
    ensure_bench_venv()
    args.out.mkdir(parents=True, exist_ok=True)
    run_dir = args.out / "run"
    if (run_dir / "metrics.jsonl").exists():
        (run_dir / "metrics.jsonl").unlink()
    total_iters = args.warmup + args.iterations
    argv = [sys.executable, "cli/train_grpo.py", "--config-name", "grpo_tiny_cpu",
            f"megatron_training.train_iters={total_iters}", f"hydra.run.dir={run_dir}"]
    demo = Launched(argv, cwd=str(REPO), log_path=str(args.out / "demo.log"))
    marker = f"[iter {args.warmup:>4}]"
    while demo.proc.poll() is None and demo.first_line(marker) is None:
        time.sleep(0.05)
    if demo.proc.poll() is not None:
        raise RuntimeError(f"the demo ended before iteration {args.warmup}; see {args.out / 'demo.log'}")
    attached = time.time()
    raw = args.out / "raw.txt"
    spy = subprocess.run([str(py_spy()), "record", "--pid", str(demo.proc.pid), "--subprocesses", "--nonblocking",
                          "--format", "raw", "--rate", str(args.rate), "--output", str(raw)],
                         capture_output=True, text=True)
    code = demo.wait(timeout=600)
    if code != 0:
        raise RuntimeError(f"the demo exited {code}; see {args.out / 'demo.log'}")
    if spy.returncode != 0 or not raw.exists():
        raise RuntimeError(f"py-spy failed ({spy.returncode}): {spy.stderr[-2000:]}")
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    profiled = [r for r in rows if r["iteration"] > args.warmup]
    times = sorted(r["timing/all"] for r in profiled)
    load = demo.load(attached, demo.first_line(f"[iter {args.warmup + args.iterations:>4}]"))
    return {"warmup": args.warmup, "iterations": len(profiled), "median_iteration_s": times[len(times) // 2],
            "load": f"{load.get('load1_min', 0):.2f}-{load.get('load1_max', 0):.2f}",
            "foreign_cores_busy": round(load.get("foreign_cores_busy") or 0, 2), "raw": str(raw),
            "cpu_s_per_iteration_by_process": {k: round(v / len(profiled), 4) for k, v in
                                               load.get("cpu_seconds_by_process", {}).items() if v / len(profiled) >= 0.0005},
            "py_spy_stderr_tail": spy.stderr[-500:],
            "memory": demo.peak_memory(),
            "phase_timings_median_s": {k: sorted(r[k] for r in profiled)[len(profiled) // 2]
                                       for k in ("timing/generate/total", "timing/resharding_to_infer",
                                                 "timing/rollout", "timing/ref_logprob/total",
                                                 "timing/old_logprob/total", "timing/update/total", "timing/all")}}


def main(argv=None) -> int:
    args = _args(argv)
    if args.startup:
        run_startup(args)
        return 0
    if args.raw:
        meta, raw = {"warmup": args.warmup}, args.raw
    else:
        meta = run(args)
        raw = Path(meta["raw"])
    summary = summarise(raw, meta.get("iterations", args.iterations), args.rate, args.top)
    text = render(summary, meta)
    out_dir = args.out
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "summary.txt").write_text(text + "\n")
    (out_dir / "summary.json").write_text(json.dumps({"meta": meta, **summary}, indent=2))
    print(text)
    print(f"\n[profile] {out_dir / 'summary.txt'}, {out_dir / 'summary.json'}, {raw}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
