"""Where each phase of an iteration stands against this machine's peak, measured in the same run.

Peaks (`measure_peaks`, mindspeed_rl/planner/search.py: the rates `cli/plan.py --search` calibrates its time model
with), in the benchmark's process with every core, as the one rank runs: fp32 matmul FLOP/s (torch.mm of 1024 x 1024
blocks) and copy bytes/s (read + written, a 256 MiB tensor copied). Work per phase, from an
iteration's metrics and the model's shape (`phase_work`; counted from the iteration's mean prompt and response
lengths, so the attention term is a little low for long-tailed lengths):

- log-probs (reference, old): one forward, 2 x (matmul params per layer x layers) FLOPs per token, the
  language-model head only on response tokens (the engine computes the response rows' logits only), and causal
  attention 2 x 2 x layers x hidden x L^2 / 2 per sequence of L tokens;
- update: forward + backward, 3x the forward's FLOPs (no recompute);
- generate: bytes read, each decode step reading every weight once (fp32) and the KV cache of the live tokens;
  steps = the longest response;
- switch: the weight push's bytes (local copy read + written, and bytes received).

The ratios (achieved / peak) are what the time model of `cli/plan.py --search` would use; docs/results.md says
where each phase stands and why.
"""
from __future__ import annotations

from mindspeed_rl.planner.search import measure_peaks  # noqa: F401  (the planner's time model measures the same)


def _forward_flops(shape: dict, samples: int, prompt: float, response: float) -> float:
    h, layers, kv = shape["hidden"], shape["layers"], shape["kv_heads"] * shape["hidden"] // shape["heads"]
    per_layer = h * (h + 2 * kv) + h * h + 3 * h * shape["ffn"]
    length = prompt + response
    dense = 2 * per_layer * layers * length + 2 * h * shape["vocab"] * response
    attention = 2 * 2 * layers * h * length * length / 2
    return samples * (dense + attention)


def phase_work(record: dict, shape: dict, samples: int) -> dict[str, tuple[str, float, float]]:
    """phase -> (unit, work, seconds) of one iteration's record."""
    prompt, response = record["prompt_length/mean"], record["response_length/mean"]
    forward = _forward_flops(shape, samples, prompt, response)
    weights = shape["params"] * 4
    kv_per_token = 2 * shape["layers"] * shape["kv_heads"] * (shape["hidden"] // shape["heads"]) * 4
    steps = record["response_length/max"]
    # Each step reads the live sequences' KV: on average prompt + half the responses so far.
    generate_bytes = steps * weights + steps * samples * (prompt + response / 2) * kv_per_token
    switch_bytes = 2 * record.get("resharding/bytes_local", 0.0) + record.get("resharding/bytes_received", 0.0)
    work = {"generate": ("bytes", generate_bytes, record["timing/rollout"]),
            "switch": ("bytes", switch_bytes, record["timing/resharding_to_infer"]),
            "reference log-probs": ("flops", forward, record["timing/ref_logprob/total"]),
            "update": ("flops", 3 * forward, record["timing/update/total"])}
    if "timing/old_logprob/total" in record:
        work["old log-probs"] = ("flops", forward, record["timing/old_logprob/total"])
    return work


def roofline(rows: list[dict], shape: dict, samples: int, peaks: dict[str, float]) -> dict[str, dict]:
    """phase -> achieved rate (median over `rows`) and its share of the peak of its unit."""
    import statistics

    per_row = [phase_work(r, shape, samples) for r in rows]
    out = {}
    for phase, (unit, _, _) in per_row[0].items():
        rate = statistics.median(work / max(seconds, 1e-9) for work_by_phase in per_row
                                 for name, (_, work, seconds) in work_by_phase.items() if name == phase)
        peak = peaks["matmul_flops_per_s"] if unit == "flops" else peaks["copy_bytes_per_s"]
        out[phase] = {"unit": unit, "achieved_per_s": rate, "peak_per_s": peak, "of_peak": rate / peak}
    return out


def roofline_lines(table: dict[str, dict], peaks: dict[str, float]) -> list[str]:
    lines = [f"roofline (this machine, measured in this run with {peaks['threads']} threads): fp32 matmul "
             f"{peaks['matmul_flops_per_s'] / 1e9:.1f} GFLOP/s, copy {peaks['copy_bytes_per_s'] / 1e9:.1f} GB/s "
             "(read + written)"]
    for phase, x in table.items():
        scale, name = (1e9, "GFLOP/s") if x["unit"] == "flops" else (1e9, "GB/s")
        lines.append(f"  {phase:20s} {x['achieved_per_s'] / scale:8.2f} {name:8s} = {x['of_peak']:.2f} of the peak")
    return lines
