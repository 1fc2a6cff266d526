"""The planner's output: a text table and a JSON document of the same figures."""
from __future__ import annotations

from mindspeed_rl.memory.residency import (ADAPTER_PARAMS, CRITIC_GRADS, CRITIC_OPTIMIZER, CRITIC_PARAMS, INFER_WEIGHTS,
                                           KV_CACHE, REF_PARAMS, REWARD_PARAMS, TEACHER_PARAMS, TRAIN_GRADS,
                                           TRAIN_OPTIMIZER, TRAIN_PARAMS)
from mindspeed_rl.planner.from_config import Suggestion
from mindspeed_rl.planner.activations import activation_terms
from mindspeed_rl.planner.critic import critic_devices_text, critic_layout_lines
from mindspeed_rl.planner.inputs import CP_GATHER, DTYPE_BYTES
from mindspeed_rl.planner.memory import ACTIVATIONS, MemoryPlan, kv_needed_bytes
from mindspeed_rl.planner.switch import SwitchPlan, iteration_moves
from mindspeed_rl.sizes import format_bytes

ROWS = (
    (TRAIN_PARAMS, "train params"),
    (ADAPTER_PARAMS, "LoRA adapter params"),
    (TRAIN_GRADS, "train grads (fp32)"),
    (TRAIN_OPTIMIZER, "optimizer (Adam + fp32 masters)"),
    (REF_PARAMS, "reference params"),
    (REWARD_PARAMS, "reward model params"),
    (TEACHER_PARAMS, "teacher params"),
    (CRITIC_PARAMS, "critic params"),
    (CRITIC_GRADS, "critic grads (fp32)"),
    (CRITIC_OPTIMIZER, "critic optimizer"),
    (INFER_WEIGHTS, "inference weights"),
    (KV_CACHE, "KV cache"),
    (ACTIVATIONS, "activations (estimate)"),
    ("switch_staging", "switch staging buffers"),
)


# The rows of parts a run may not have (LoRA's adapters, a reward model, PPO's critic) and the push's staging: shown
# only where some phase holds bytes in them.
OPTIONAL_ROWS = (ADAPTER_PARAMS, REWARD_PARAMS, TEACHER_PARAMS, CRITIC_PARAMS, CRITIC_GRADS, CRITIC_OPTIMIZER, "switch_staging")

def count_text(count: int) -> str:
    return f"{count / 1e9:.2f}B" if count >= 1e9 else f"{count / 1e6:.2f}M"


def _layout_line(plan: MemoryPlan) -> list[str]:
    i = plan.inputs
    # CP shows where it is used; EP wherever there are experts.
    cp = f"CP{i.cp} ({i.cp_exchange})"
    sizes = [f"TP{i.tp}", f"PP{i.pp}", *[cp][:i.cp > 1], f"DP{i.dp}"]
    train = f"train {' x '.join(sizes)}" + (f" (EP{i.ep})" if i.arch.is_moe else "")
    extras = ["bf16" if i.bf16 else "fp32"]
    if i.distributed_optimizer:
        extras.append("distributed optimizer")
    if i.sequence_parallel_effective:
        extras.append("sequence parallel")
    if i.flash_attention:
        extras.append("flash attention")
    extras.append(f"{i.activation_profile} activation profile")
    stages = f" x PP{i.infer_pp}" if i.infer_pp > 1 else ""
    infer = f"infer TP{i.infer_tp}{stages} x DP{i.infer_dp}" + (" (expert parallel)" if i.infer_expert_parallel else "")
    if i.expert_slots is not None:
        infer += f", EPLB map: {i.eplb_redundant_experts} redundant experts per MoE layer"
    if i.kv.on_cpu:
        kv = f"KV cache {format_bytes(i.kv.cpu_bytes)} (cpu_kvcache_space_gb)"
    elif i.device_memory is not None:
        kv = (f"KV cache = gpu_memory_utilization {i.kv.gpu_memory_utilization} x {format_bytes(i.device_memory)} "
              "- inference weights")
    else:
        kv = f"KV cache = max_num_seqs {i.kv.max_num_seqs} x max_model_len {i.kv.max_model_len} tokens (no --device-memory)"
    flags = "/".join(str(not (s in i.policy.pinned)).lower() for s in (TRAIN_PARAMS, TRAIN_GRADS, TRAIN_OPTIMIZER))
    if i.packing_token_budget is not None:
        micro = f"update micro-batches packed to at most {i.packing_token_budget} tokens"
    else:
        micro = f"update micro-batch {i.micro_batch_size} x {i.padded_seq_length} tokens" + (" (packed)" if i.packed else "")
    return [f"  {train}, {', '.join(extras)}; {micro}, {i.micro_batches_per_step} per step per DP rank",
            f"  {infer}, {i.infer_dtype}; {kv}",
            f"  offload_train_param/grad/optimizer: {flags}; reference model: "
            f"{'yes' if i.policy.has_reference else 'no'}; reward: "
            + ("rule-based + a reward model (on the device in the reward phase only)" if i.policy.has_reward_model
               else "rule-based (no reward model on the device)")] + critic_layout_lines(i) + _teacher_lines(i)


def _teacher_lines(i) -> list[str]:
    """The report's line on distillation's teacher: where it is and when it is on the device."""
    if not i.policy.has_teacher:
        return []
    if not i.teacher_world_size:
        return ["  teacher: on the training ranks in the actor's layout, taking turns (on the device in its "
                "teacher_logprob phase only)"]
    first = i.world_size + i.critic_world_size
    last = first + i.teacher_world_size - 1
    numbers = f"rank {first}" if first == last else f"ranks {first}-{last}"
    dp = i.teacher_world_size // (i.teacher_tp * i.teacher_pp)
    return [f"  teacher: {i.teacher_world_size} device(s) of its own ({numbers} below), its own layout TP{i.teacher_tp}"
            f" x PP{i.teacher_pp} x DP{dp}; its params stay there in every phase"]


def text_report(plan: MemoryPlan, *, model_name: str, source: str, switch: SwitchPlan | None,
                suggestions: list[Suggestion] | None, h2d_bytes_per_second: float, link_bytes_per_second: float) -> str:
    i, arch = plan.inputs, plan.inputs.arch
    lines = [f"model {model_name}: {arch.name}, {count_text(arch.parameter_count())} parameters"
             + (f" ({count_text(arch.active_parameter_count())} active)" if arch.is_moe else "")
             + (f", MTP module ({arch.mtp_layers} layer) not counted" if arch.mtp_layers else ""),
             f"  numbers from {source}",
             f"  {arch.support}",
             f"layout: {i.world_size} device{'s' if i.world_size > 1 else ''}"
             + critic_devices_text(i) + (f" + {i.teacher_world_size} of the teacher's" if i.teacher_world_size else "")]
    lines += _layout_line(plan)
    table, totals = plan.table(), plan.totals()
    width = max(len(label) for _, label in ROWS) + 2
    phases = plan.table_phases
    column = max(14, *(len(p) + 1 for p in phases))  # teacher_logprob is wider than a byte figure
    header = "".join(f"{p:>{column}}" for p in phases)
    lines += ["", f"bytes per device (each row: its largest rank; total: the largest rank's sum)",
              f"{'':<{width}}{header}"]
    for key, label in ROWS:
        values = [table[p].get(key, 0) for p in phases]
        if key in OPTIONAL_ROWS and not any(values):
            if key == REWARD_PARAMS:
                lines.append(f"{label:<{width}}" + "".join(f"{'-':>{column}}" for _ in phases))
            continue
        lines.append(f"{label:<{width}}" + "".join(f"{format_bytes(v):>{column}}" for v in values))
    lines.append(f"{'total':<{width}}" + "".join(f"{format_bytes(totals[p][1]):>{column}}" for p in phases))
    lines.append(f"{'  on rank':<{width}}" + "".join(f"{totals[p][0]:>{column}}" for p in phases))
    phase, rank, peak = plan.peak()
    lines += ["", f"peak: {phase} on rank {rank}: {format_bytes(peak)} ({peak} bytes)"]
    if i.device_memory is None:
        lines.append("fits: no verdict (give --device-memory, e.g. --device-memory 64GiB)")
    else:
        margin = i.device_memory - peak
        problems = plan.problems()
        verdict = "FITS" if plan.fits() else "DOES NOT FIT"
        lines.append(f"device memory {format_bytes(i.device_memory)}: {verdict} "
                     f"({'margin' if margin >= 0 else 'short by'} {format_bytes(abs(margin))}"
                     f"{' at the peak' if problems else ''})")
        lines += [f"  and: {problem}" for problem in problems]
        if not i.kv.on_cpu:
            needed = kv_needed_bytes(i)
            kv = table["generate"][KV_CACHE]
            if 0 < kv < needed:
                lines.append(f"  note: the KV cache ({format_bytes(kv)}) holds {kv / needed:.0%} of max_num_seqs x "
                             f"max_model_len ({format_bytes(needed)}); vLLM runs fewer sequences at once")
    if suggestions is not None:
        if i.device_memory is not None and plan.fits() is False:
            if suggestions:
                lines += ["", "would fit with (Hydra overrides, each checked as load_config checks a config, then planned):"]
                lines += [f"  {' '.join(s.overrides)}    -> peak {s.peak_phase} {format_bytes(s.peak_bytes)}"
                          for s in suggestions]
            else:
                lines += ["", "no offload flag, micro-batch size or layout on these devices fits; more devices are needed"]
    lines += ["", _switch_text(plan, switch, link_bytes_per_second)]
    lines += _moves_text(plan, h2d_bytes_per_second)
    lines += _host_text(plan)
    lines += ["", "formulas:"] + [f"  {line}" for line in formulas(plan)]
    return "\n".join(lines)


def _switch_text(plan: MemoryPlan, switch: SwitchPlan | None, link: float) -> str:
    if not plan.inputs.policy.has_inference:
        return "switch train -> infer: none (the run generates nothing: DPO)"
    if switch is None:
        return ("switch train -> infer: not computed (the resharding plan has layouts for Qwen2 dense and "
                "Qwen3-MoE only)")
    if switch.max_received == 0 and switch.max_sent == 0:
        return "switch train -> infer (the resharding plan): the layouts agree, every rank copies locally, nothing crosses the wire"
    lines = [f"switch train -> infer (the resharding plan; {plan.inputs.infer_dtype} on the wire; "
             f"link {link / 1e9:g} GB/s): {format_bytes(switch.max_received)} received / "
             f"{format_bytes(switch.max_sent)} sent by the busiest rank, about {switch.seconds:.3f} s",
             f"  {'rank':>6}{'received':>14}{'sent':>14}{'local copy':>14}{'staging':>14}{'seconds':>10}"]
    for r in switch.ranks:
        lines.append(f"  {r.rank:>6}{format_bytes(r.received):>14}{format_bytes(r.sent):>14}"
                     f"{format_bytes(r.local):>14}{format_bytes(r.staging):>14}{max(r.received, r.sent) / link:>10.3f}")
    return "\n".join(lines)


def _moves_text(plan: MemoryPlan, h2d: float) -> list[str]:
    lines = [f"host <-> device per iteration (largest rank; copies at {h2d / 1e9:g} GB/s; grads, vLLM weights and the "
             "KV cache are dropped, not copied):"]
    shared = [r for r in plan.ranks if r.policy is None]  # a critic's own devices move nothing
    states = {k: max(r.states[k] for r in shared) for k in shared[0].states}
    total = 0.0
    for move in iteration_moves(plan.inputs, states):
        if move.onload or move.offload:
            seconds = (move.onload + move.offload) / h2d
            total += seconds
            lines.append(f"  {move.before:>13} -> {move.after:<13} onload {format_bytes(move.onload):>10}  "
                         f"offload {format_bytes(move.offload):>10}  {seconds:.3f} s")
    lines.append(f"  total {total:.3f} s")
    return lines


def _host_text(plan: MemoryPlan) -> list[str]:
    """Host memory per rank: the offloaded states' mirrors and the push's host copy (LoRA's backbone)."""
    host = plan.host_table()
    held = ", ".join(f"{state} {format_bytes(value)}" for state, value in host.items() if value)
    return [f"host memory per rank (largest rank per state; pinned mirrors of the states that leave the device, and "
            f"LoRA's backbone copy): {format_bytes(sum(host.values()))}" + (f" ({held})" if held else "")]


def activations_formula(i, terms) -> str:
    e = 2 if i.bf16 else 4
    moe = f" (MoE layer {terms.moe_layer:.0f} B, an uncalibrated estimate)" if i.arch.is_moe else ""
    if i.activation_profile == "cpu":
        layer = "per layer (16+2e)h[/t with SP] + 4e q/t + 5e f/t + c a s/t"
        source = "coefficients measured on this engine's CPU path"
    else:
        layer = "per layer 4e h[/t with SP] + (2e q + 2e kv + 3e f)/t + c a s/t"
        source = ("the published count with fused RMSNorm/SwiGLU and flash attention (Korthikanti et al. 2022, "
                  "Table 2, adjusted for GQA and SwiGLU), not measured here")
    return (f"activations ({i.activation_profile} profile; update, per micro-batch token, e={e}): {layer} = "
            f"{terms.dense_layer:.0f} B{moe}; first stage +8 B; last stage +(8+e)h = {terms.last_stage:.0f} B, and "
            f"per response token + eV/t + 24 = {terms.last_stage_per_response_token:.0f} B (the logits' response "
            f"rows, vocabulary-sharded); x the micro-batch's tokens (micro_batch_size x seq, or the packing budget) x min(PP - stage, "
            f"micro-batches) in flight; {_cp_text(i, terms)}"
            f"{source} (mindspeed_rl/planner/memory.py)")


def _cp_text(i, terms) -> str:
    """The CP exchange's part of the activations formula (planner/activations.py), or nothing without CP."""
    if i.cp == 1:
        return ""
    kept = {CP_GATHER: "+ 2e kv/t (CP - 1) per layer (K and V gathered whole, this engine's)",
            "megatron_cp_algo": "ring: nothing beyond flash attention per layer, 6 x 2e kv/t in flight once",
            "ulysses_cp_algo": "Ulysses: + e q/t per layer, e (q + 2 kv)/t in flight once"}[i.cp_exchange]
    return f"CP{i.cp} over s / CP tokens: {kept} = {terms.exchange_in_flight:.0f} B in flight; "


def formulas(plan: MemoryPlan) -> list[str]:
    i = plan.inputs
    return [
        "train params: the Megatron shard's elements x 2 (bf16; RMSNorm weights 4) or 4; with the distributed "
        "optimizer the DDP param buffer, padded",
        "train grads: Megatron DDP grad buffers, fp32 (grad_reduce_in_fp32), one per dtype and expert/dense, "
        "padded with the distributed optimizer",
        "optimizer: (exp_avg + exp_avg_sq) 8 B + fp32 master 4 B (bf16 params) per optimized element; the "
        "distributed optimizer optimizes 1/DP of each buffer (expert buffers: 1/(DP/EP))",
        "reference params: the train shard's elements, unpadded (no DDP)",
        f"inference weights: the vLLM shard's elements (vocabulary padded to 64; with infer PP its stage's layers, "
        f"the embedding on the first stage, the norm and head on the last, on every stage for Qwen3-MoE as vLLM "
        f"allocates them) x {DTYPE_BYTES[i.infer_dtype]}" + ("; with the EPLB map + (the experts it places on the "
                                                            "rank - num_experts / EP) x 3 h F per MoE layer"
                                                            if i.expert_slots is not None else "")
        + ("; on this CPU host + the oneDNN-packed copies its GEMMs read (every 2-D weight but the embedding's, the "
           "head's included)" if any(r.inference_packed_bytes for r in plan.ranks) else ""),
        "KV cache: cpu_kvcache_space_gb on CPU; gpu_memory_utilization x device memory - inference weights on an "
        "accelerator (vLLM's own activation reserve not subtracted); per token 2 x layers (of the rank's vLLM stage) "
        "x KV heads per rank x head_dim x dtype (MLA: layers x (kv_lora_rank + rope dim) x dtype)",
        activations_formula(i, activation_terms(i)),
        "switch staging: min(received, bucket) + min(sent, bucket) (generate_config.resharding_bucket_mb)",
        "host: a mirror of each state's device bytes that keeps its contents when it leaves the device (train and "
        "reference params, adapters, optimizer states, reward and critic states; none where an offload flag pins "
        "it), allocated at its first offload and kept; with LoRA + the rank's inference weights (the push's "
        "backbone copy)",
    ]


def json_report(plan: MemoryPlan, *, model_name: str, source: str, switch: SwitchPlan | None,
                suggestions: list[Suggestion] | None, h2d_bytes_per_second: float,
                link_bytes_per_second: float) -> dict:
    i, arch = plan.inputs, plan.inputs.arch
    phase, rank, peak = plan.peak()
    totals = plan.totals()
    states = {k: max(r.states[k] for r in plan.ranks) for k in plan.ranks[0].states}
    return {
        "model": {"name": model_name, "architecture": arch.name, "model_type": arch.model_type, "source": source,
                  "parameters": arch.parameter_count(), "active_parameters": arch.active_parameter_count(),
                  "mtp_layers_excluded": arch.mtp_layers, "trainable": arch.trainable, "support": arch.support},
        "layout": {"world_size": i.world_size, "critic_world_size": i.critic_world_size, "tp": i.tp, "pp": i.pp, "cp": i.cp, "dp": i.dp, "ep": i.ep,
                   "infer_tp": i.infer_tp, "infer_pp": i.infer_pp, "infer_dp": i.infer_dp,
                   "infer_expert_parallel": i.infer_expert_parallel, "cp_exchange": i.cp_exchange,
                   "eplb_redundant_experts": i.eplb_redundant_experts,
                   "bf16": i.bf16, "infer_dtype": i.infer_dtype, "distributed_optimizer": i.distributed_optimizer,
                   "sequence_parallel": i.sequence_parallel_effective, "flash_attention": i.flash_attention,
                   "activation_profile": i.activation_profile,
                   "micro_batch_size": i.micro_batch_size, "seq_length": i.padded_seq_length,
                   "micro_batches_per_step": i.micro_batches_per_step, "packed": i.packed,
                   "packing_token_budget": i.packing_token_budget,
                   "offload_train_param": TRAIN_PARAMS not in i.policy.pinned,
                   "offload_train_grad": TRAIN_GRADS not in i.policy.pinned,
                   "offload_train_optimizer": TRAIN_OPTIMIZER not in i.policy.pinned},
        "phases": {p: {**{k: v for k, v in row.items()}, "total": totals[p][1],
                       "total_rank": totals[p][0]} for p, row in plan.table().items()},
        "per_rank": [{"rank": r.rank, **r.states,
                      "phases": {p: sum(plan.rank_phase(r, p).values()) for p in plan.table_phases}}
                     for r in plan.ranks],
        "peak": {"phase": phase, "rank": rank, "bytes": peak},
        "device_memory": i.device_memory,
        "fits": plan.fits(),
        "problems": plan.problems(),
        "margin_bytes": None if i.device_memory is None else i.device_memory - peak,
        "kv_needed_bytes": kv_needed_bytes(i),
        "suggestions": [{"overrides": list(s.overrides), "peak_phase": s.peak_phase, "peak_bytes": s.peak_bytes}
                        for s in suggestions or []],
        "switch": None if switch is None else {
            "link_bytes_per_second": link_bytes_per_second, "seconds": switch.seconds,
            "ranks": [{"rank": r.rank, "received_bytes": r.received, "sent_bytes": r.sent, "local_bytes": r.local,
                       "staging_bytes": r.staging, "seconds": max(r.received, r.sent) / link_bytes_per_second}
                      for r in switch.ranks]},
        "host_bytes": plan.host_table(),
        "host_device_moves": [{"from": m.before, "to": m.after, "onload_bytes": m.onload, "offload_bytes": m.offload,
                               "seconds": (m.onload + m.offload) / h2d_bytes_per_second}
                              for m in iteration_moves(i, states)],
        "formulas": formulas(plan),
    }

