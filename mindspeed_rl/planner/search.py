"""`cli/plan.py --search`: the layout that fits the devices with a margin and the smallest predicted iteration time.

Candidates: train TP x PP (x EP for MoE) x CP in {1, 2}, inference TP, the offload flags (as set, or all on), the
swap optimizer (off, on), and micro-batch sizes up to the config's; each is rebuilt through every check of the config
(invalid ones are skipped) and planned. Those whose peak leaves at least `margin` of the device free are ranked by the
time model below; the best few are printed, and one line `overrides: key=value ...` that applies the best.

The time model (one iteration, at the plan's longest sample, every sample that long): compute phases at the matmul
rate times the phase's efficiency, generate at the memory bandwidth times its efficiency (each decode step reads the
rank's weights and its sequences' KV cache) or at the matmul rate where that is slower, weight movement at the link
and host-to-device rates:

- update: 3 x forward FLOPs / (train ranks x rate x efficiency), x the pipeline bubble (1 + (PP - 1) / micro-batches
  per step), plus the forward's link bytes twice (`forward_link_bytes`: TP's all-reduces, CP's ring of keys and
  values, PP's stage-to-stage activations, EP's dispatch and combine);
- log-prob passes (reference, old): 1 x forward FLOPs each, alike;
- generate: response-limit steps per batch of max_num_seqs sequences per inference DP rank;
- the switch: the inference weights of a rank over the link; offload/reload: the iteration's moves (planner/switch.py)
  and, with the swap optimizer, the optimizer states in and out once per optimizer step, at the host rate.

Forward FLOPs per token: 2 x active parameters, plus causal attention 2 x 2 x layers x (q width) x tokens / 2.
`Rates.of_this_machine()` measures the matmul rate and the copy bandwidth here; the efficiencies are those
`make bench-long-iteration` measured for each phase on this machine (docs/results.md "Roofline"). For an accelerator
give its rates (`--matmul-tflops`, `--memory-gbps`; the efficiencies stay this machine's): the ranking depends on the
rates' ratios, the seconds on their values.
"""
from __future__ import annotations

import itertools
import math
import time
from dataclasses import dataclass

from mindspeed_rl.config import GRPOConfig
from mindspeed_rl.errors import ConfigError
from mindspeed_rl.memory.residency import INFER_WEIGHTS, TRAIN_OPTIMIZER
from mindspeed_rl.planner.arch import Architecture
from mindspeed_rl.planner.from_config import _apply, _divisors, _override_text, plan_config
from mindspeed_rl.planner.memory import MemoryPlan
from mindspeed_rl.planner.switch import iteration_moves

# What each phase achieved of this machine's peak in `make bench-long-iteration` (2026-11-27, docs/results.md).
UPDATE_EFFICIENCY, LOGPROB_EFFICIENCY, GENERATE_EFFICIENCY = 0.47, 0.41, 0.18


@dataclass(frozen=True, kw_only=True)
class Rates:
    matmul_flops_per_s: float
    memory_bytes_per_s: float
    link_bytes_per_s: float = 50e9
    h2d_bytes_per_s: float = 25e9
    update_efficiency: float = UPDATE_EFFICIENCY
    logprob_efficiency: float = LOGPROB_EFFICIENCY
    generate_efficiency: float = GENERATE_EFFICIENCY

    @classmethod
    def of_this_machine(cls, **links) -> "Rates":
        peaks = measure_peaks(seconds=0.5)
        return cls(matmul_flops_per_s=peaks["matmul_flops_per_s"], memory_bytes_per_s=peaks["copy_bytes_per_s"],
                   **links)


def measure_peaks(*, seconds: float = 2.0, matmul_n: int = 1024, copy_bytes: int = 256 << 20) -> dict[str, float]:
    """fp32 matmul FLOP/s and copy bytes/s (read + written) of this process with its current threads: the best of
    the repetitions that fit `seconds`."""
    import torch

    a, b = torch.randn(matmul_n, matmul_n), torch.randn(matmul_n, matmul_n)
    flops = _best_rate(lambda: torch.mm(a, b), 2 * matmul_n ** 3, seconds)
    src = torch.ones(copy_bytes, dtype=torch.uint8)
    dst = torch.empty_like(src)
    copy = _best_rate(lambda: dst.copy_(src), 2 * copy_bytes, seconds)
    return {"matmul_flops_per_s": flops, "copy_bytes_per_s": copy, "threads": torch.get_num_threads()}


def _best_rate(work, amount: float, seconds: float) -> float:
    work()  # warm-up: allocation, the thread pool
    best, end = 0.0, time.perf_counter() + seconds
    while time.perf_counter() < end:
        started = time.perf_counter()
        work()
        best = max(best, amount / (time.perf_counter() - started))
    return best


def forward_flops_per_token(arch: Architecture, tokens: int) -> float:
    return 2 * arch.active_parameter_count() + 2 * 2 * arch.num_layers * arch.q_width * tokens / 2


def predicted_seconds(config: GRPOConfig, arch: Architecture, plan: MemoryPlan, rates: Rates) -> dict[str, float]:
    """Seconds per phase of one iteration of `config` (planned as `plan`) at `rates`."""
    i = plan.inputs
    samples = config.megatron_training.global_batch_size * config.rl_config.n_samples_per_prompt
    forward = samples * i.seq_length * forward_flops_per_token(arch, i.seq_length)
    dp = i.dp
    micro_batches = max(1, i.mini_batch_samples // max(1, dp * i.micro_batch_size))
    steps = max(1, samples // max(1, i.mini_batch_samples))
    bubble = 1 + (i.pp - 1) / micro_batches
    comm = forward_link_bytes(arch, i, tokens_per_rank=samples * i.seq_length / (dp * i.cp)) / rates.link_bytes_per_s

    def compute(flops: float, efficiency: float) -> float:
        return flops / i.world_size / (rates.matmul_flops_per_s * efficiency) * bubble

    passes = int(i.policy.has_reference) + int(i.policy.has_old_logprob_pass)
    states = {k: max(r.states[k] for r in plan.ranks) for k in plan.ranks[0].states}
    pushed = max(r.pushed_weight_bytes for r in plan.ranks)  # a decode step reads as many bytes, packed or not
    moved = sum(m.onload + m.offload for m in iteration_moves(i, states) if m.onload or m.offload)
    swapped = 2 * states[TRAIN_OPTIMIZER] * steps if i.policy.swap_optimizer else 0
    return {"update": compute(3 * forward, rates.update_efficiency) + 2 * comm,  # the backward's mirrors the forward's
            "log-probs": passes * (compute(forward, rates.logprob_efficiency) + comm),
            "generate": _generate_seconds(config, arch, plan, rates, samples, pushed),
            "switch": pushed / rates.link_bytes_per_s,
            "offload": (moved + swapped) / rates.h2d_bytes_per_s}


def forward_link_bytes(arch: Architecture, i, *, tokens_per_rank: float) -> float:
    """Bytes one training rank sends over the link in one forward pass over `tokens_per_rank` tokens (bf16 activations):
    TP's two all-reduces per layer (2 (t-1)/t of the activation each), CP's ring passing its keys and values to the
    cp - 1 others per layer, PP's activations to the next stage, EP's dispatch and combine of top-k copies per MoE
    layer."""
    layers, h, e = arch.num_layers / i.pp, arch.hidden_size, 2
    tp = 2 * 2 * (i.tp - 1) / i.tp * tokens_per_rank * h * e * layers
    cp = (i.cp - 1) * 2 * arch.kv_width / i.tp * tokens_per_rank * e * layers
    pp = tokens_per_rank * h * e / i.tp if i.pp > 1 else 0.0
    moe_layers = sum(arch.is_moe_layer(layer) for layer in range(arch.num_layers)) / i.pp
    ep = 2 * (i.ep - 1) / i.ep * tokens_per_rank * arch.moe_topk * h * e * moe_layers
    return tp + cp + pp + ep


def _generate_seconds(config: GRPOConfig, arch: Architecture, plan: MemoryPlan, rates: Rates, samples: int,
                      weight_bytes: int) -> float:
    i, gen = plan.inputs, config.generate_config
    infer_dp = i.infer_dp
    per_rank = math.ceil(samples / infer_dp)
    batch = min(per_rank, gen.max_num_seqs)
    decode_steps = math.ceil(per_rank / batch) * config.response_length_limit
    context = i.seq_length - config.response_length_limit / 2  # the prompt and half the response, on average
    kv_bytes = batch * context * arch.kv_bytes_per_token(i.infer_tp, 2 if gen.dtype != "float32" else 4)
    read = (weight_bytes + kv_bytes) / (rates.memory_bytes_per_s * rates.generate_efficiency)
    flops = 2 * arch.active_parameter_count() / (i.infer_tp * i.infer_pp) * batch
    return decode_steps * max(read, flops / (rates.matmul_flops_per_s * rates.generate_efficiency))


@dataclass(frozen=True)
class Candidate:
    overrides: tuple[str, ...]
    peak_phase: str
    peak_bytes: int
    seconds: dict[str, float]

    @property
    def total_seconds(self) -> float:
        return sum(self.seconds.values())


def _knob_values(config: GRPOConfig, arch: Architecture) -> list[list[dict[str, object]]]:
    ac, gen, world = config.actor_config, config.generate_config, config.world_size
    layouts = []
    for tp, pp, cp in itertools.product(_divisors(world), _divisors(world), (1, 2)):
        if world % (tp * pp * cp):
            continue
        for ep in (_divisors(world // (tp * pp * cp)) if arch.is_moe else [1]):
            layout = {"actor_config.tensor_model_parallel_size": tp, "actor_config.pipeline_model_parallel_size": pp,
                      "actor_config.context_parallel_size": cp}
            if arch.is_moe:
                layout["actor_config.expert_model_parallel_size"] = ep
            if ac.num_layer_list is not None and pp != ac.pipeline_model_parallel_size:
                layout["actor_config.num_layer_list"] = None
            layouts.append(layout)
    infer = [{"generate_config.infer_tensor_parallel_size": tp} for tp in _divisors(world) if tp <= 8]
    offload = [{}, {f"generate_config.offload_train_{name}": True for name in ("param", "grad", "optimizer")}]
    swap = [{"megatron_training.swap_optimizer": False}, {"megatron_training.swap_optimizer": True}]
    micro = [{"actor_config.micro_batch_size": m} for m in _divisors(ac.micro_batch_size)]
    return [layouts, infer, offload, swap, micro]


def search(cfg, arch: Architecture, *, device_memory: int, rates: Rates, margin: float = 0.10,
           profile: str | None = None) -> list[Candidate]:
    """Every candidate that fits `device_memory` with `margin` to spare, fastest first."""
    from mindspeed_rl.config import load_config

    base = load_config(cfg)
    found: dict[tuple[str, ...], Candidate] = {}
    for values in itertools.product(*_knob_values(base, arch)):
        overrides = {key: value for part in values for key, value in part.items()}
        try:
            config = _apply(base, overrides)
            plan, _ = plan_config(config, arch, device_memory=device_memory, with_switch=False, profile=profile)
        except (ConfigError, ValueError):
            continue
        phase, _, peak = plan.peak()
        if plan.problems() or peak > (1 - margin) * device_memory:
            continue
        text = _override_text(overrides, cfg, base)
        found.setdefault(text, Candidate(text, phase, peak, predicted_seconds(config, arch, plan, rates)))
    return sorted(found.values(), key=lambda c: (c.total_seconds, len(c.overrides)))


def largest_consumers(plan: MemoryPlan, count: int = 3) -> list[tuple[str, int]]:
    """The `count` largest state groups (and activations) of the peak phase's largest rank."""
    phase, rank, _ = plan.peak()
    row = plan.rank_phase(next(r for r in plan.ranks if r.rank == rank), phase)
    return sorted(((name, value) for name, value in row.items() if value), key=lambda kv: -kv[1])[:count]


def search_report(cfg, arch: Architecture, plan: MemoryPlan, *, device_memory: int, rates: Rates, limit: int = 5,
                  margin: float = 0.10, profile: str | None = None) -> tuple[list[str], dict]:
    """(lines, JSON document) of `--search`: the fastest few that fit with `margin`, and the `overrides:` line of the
    best; or that none fits, with the three largest consumers of the config's own peak."""
    from mindspeed_rl.sizes import format_bytes

    found = search(cfg, arch, device_memory=device_memory, rates=rates, margin=margin, profile=profile)
    head = (f"search: {len(found)} layouts fit {format_bytes(device_memory)} with a {margin:.0%} margin; time model at "
            f"{rates.matmul_flops_per_s / 1e9:.0f} GFLOP/s and {rates.memory_bytes_per_s / 1e9:.0f} GB/s "
            f"(efficiencies update {rates.update_efficiency}, log-probs {rates.logprob_efficiency}, generate "
            f"{rates.generate_efficiency}), link {rates.link_bytes_per_s / 1e9:g} GB/s, host {rates.h2d_bytes_per_s / 1e9:g} GB/s")
    document = {"rates": rates.__dict__, "margin": margin,
                "candidates": [{"overrides": list(c.overrides), "peak_phase": c.peak_phase, "peak_bytes": c.peak_bytes,
                                "seconds": c.seconds, "total_seconds": c.total_seconds} for c in found[:limit]]}
    if not found:
        consumers = largest_consumers(plan)
        document["largest_consumers"] = dict(consumers)
        return [head, "no layout fits with that margin; the largest consumers at this config's peak: " + ", ".join(
            f"{name} {format_bytes(value)}" for name, value in consumers)], document
    lines = [head]
    for rank, c in enumerate(found[:limit], 1):
        lines.append(f"  {rank}. {c.total_seconds:.4g} s per iteration, peak {c.peak_phase} {format_bytes(c.peak_bytes)}: "
                     f"{' '.join(c.overrides) or '(the config as it is)'}")
        lines.append("     " + ", ".join(f"{phase} {seconds:.4g} s" for phase, seconds in c.seconds.items()))
    document["overrides"] = list(found[0].overrides)
    lines.append("overrides: " + " ".join(found[0].overrides))
    return lines, document


__all__ = ["Candidate", "Rates", "forward_flops_per_token", "forward_link_bytes", "largest_consumers", "measure_peaks",
           "predicted_seconds", "search", "search_report"]
