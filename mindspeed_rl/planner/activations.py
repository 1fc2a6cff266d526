"""The update's activations: bytes autograd keeps for backward on a rank, per pipeline stage.

Activations (the update phase; forward-only phases save nothing for backward), bytes per token of a
micro-batch of `micro_batch_size x seq_length` tokens, `e` the param dtype's bytes, `t` the train TP, two
profiles (`PlanInputs.activation_profile`):

cpu (what this engine's CPU path keeps: Megatron's local spec, torch norms, unfused attention; measured)
    per layer   (16 + 2e) h [/t with sequence parallel] + 4e q/t + 5e f/t + c a/t s
accelerator (the published count, Korthikanti et al. 2022 "Reducing Activation Recomputation in Large
Transformer Models", Table 2: 34 s b h / t with sequence parallel, adjusted for GQA, SwiGLU, RMSNorm and
no dropout, with the fused kernels MindSpeed/TE select: fused RMSNorm and SwiGLU keep their input only,
flash attention its output and a logsumexp)
    per layer   4e h [/t with sequence parallel] + (2e q + 2e kv + 3e f) / t + c a/t s
                (the two norms' inputs 2eh, the QKV and fc1 inputs eh each; Q eq, K and V 2e kv, the
                attention output eq; fc1's gate and up 2ef, fc2's input ef)
both
    first stage + 8 (the token ids the embedding keeps)
    last stage  + (8 + e) h, and per response token + e V/t + 24 (the response rows of the logits, in their own
                dtype and vocabulary-sharded, and four numbers per token: engines/vocab_parallel.py)
LoRA (actor_config.lora_*; models/lora.py): a frozen linear keeps no input (Megatron's LinearWithFrozenWeight), an
adapted one keeps it for A (column-parallel: gathered over sequence parallel, e h per token) and A's output for B
(e r); and nothing upstream of the first adapter needs a gradient, so the first stage keeps neither the token ids
nor the first layer's input norm (cpu: 7 e h, measured; accelerator: its input e h) [/t with sequence parallel].
Measured on CPU in fp32 (h 128/256, f 256/512, r 16, adapters on all four linears or on one): within 1% of the
ledger with linear_qkv among the targets; without it the first layer keeps less than this (an upper bound).
with q = heads x head_dim, kv = KV heads x head_dim, f the MLP width (MoE layers: top-k x the expert width +
the shared experts' width, + 8 E for the router's fp32 logits and probabilities + 2e k h for the dispatched
tokens), c = 4 in fp32 and 4 + e otherwise (the attention probabilities in fp32; 0 with flash attention on
an accelerator or with packed sequences, whose per-sample attention keeps none: measured within 4%). A
micro-batch holds micro_batch_size x seq_length tokens, or with use_dynamic_bsz its token budget. A pipeline
stage p of PP holds min(PP - p, micro-batches per step) micro-batches (1F1B).
Context parallelism (CP ranks, s / CP tokens each): per layer + the exchange's kept bytes, and once, for the layer
whose backward runs, its buffers in flight (`cp_exchange_kept`, `cp_exchange_in_flight`): this engine's gather keeps
each layer's K and V over the whole sequence, 2e kv/t (CP - 1), measured; MindSpeed's ring (megatron_cp_algo) keeps
nothing more than flash attention and holds 6 x 2e kv/t in flight; Ulysses (ulysses_cp_algo) keeps + e q/t and holds
e (q + 2 kv)/t in flight (read from MindSpeed's implementations, not measured). `PlanInputs.cp_exchange` says which:
planner/from_config.py gives the accelerator profile the configured actor_config.context_parallel_algo (the plan is for
the user's devices) and the cpu profile this engine's gather.
The cpu coefficients were measured on this engine's path (`with_entropy=True` in the loss) by varying each
of h, f, head_dim, heads, seq, V, TP, PP and dtype on CPU; they reproduce the demos' measured
`memory/update/activations_bytes` within 3%. The accelerator profile is the formula, not a measurement
(no accelerator here); MoE and MLA terms are estimates, not calibrated.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from mindspeed_rl.planner.inputs import CP_GATHER
from mindspeed_rl.planner.lora import lora_first_stage, lora_layer_change
from mindspeed_rl.planner.params import stage_layers

if TYPE_CHECKING:
    from mindspeed_rl.planner.inputs import PlanInputs


@dataclass(frozen=True)
class ActivationTerms:
    """Bytes per token (see the module docstring)."""

    dense_layer: float
    moe_layer: float
    first_stage: float
    last_stage: float
    last_stage_per_response_token: float
    # Held once, by the one layer whose backward runs: context parallelism's exchange buffers (cp_exchange_in_flight).
    exchange_in_flight: float = 0.0


def activation_terms(inputs: PlanInputs) -> ActivationTerms:
    arch, t = inputs.arch, inputs.tp
    e = 2 if inputs.bf16 else 4
    h, s = arch.hidden_size, inputs.padded_seq_length
    h_split = t if inputs.sequence_parallel_effective else 1
    # Flash attention, the packed path's per-sample attention, selective recompute and the context-parallel
    # attention (torch's fused kernel) keep no score matrix.
    no_scores = (inputs.flash_attention or inputs.packed or inputs.recompute_granularity == "selective"
                 or inputs.cp > 1)
    scores = 0.0 if no_scores else (4 if e == 4 else 4 + e) * arch.num_attention_heads / t * s
    scores += cp_exchange_kept(inputs, e)
    if inputs.activation_profile == "cpu":
        attention = (16 + 2 * e) * h / h_split + 4 * e * arch.q_width / t + scores
        mlp_per_width = 5 * e
    else:
        attention = 4 * e * h / h_split + (2 * e * arch.q_width + 2 * e * arch.kv_width) / t + scores
        mlp_per_width = 3 * e
    dense = attention + mlp_per_width * arch.intermediate_size / t + lora_layer_change(inputs, e, h_split)
    first_stage = lora_first_stage(inputs, e, h_split, default=8.0)
    moe = attention
    if arch.is_moe:
        moe += mlp_per_width * (arch.moe_topk * arch.moe_intermediate_size + arch.shared_expert_size) / t
        # the dispatched tokens: k copies of each token the rank dispatches (MindSpeed's moe_tp_extend_ep: its own)
        moe += 8 * arch.num_experts + 2 * e * arch.moe_topk * h / (t if inputs.moe_tokens_split_over_tp else 1)
    return ActivationTerms(dense_layer=dense, moe_layer=moe, first_stage=first_stage, last_stage=(8 + e) * h,
                           last_stage_per_response_token=e * arch.vocab_size / t + 24,
                           exchange_in_flight=cp_exchange_in_flight(inputs, e))


def cp_exchange_kept(inputs: PlanInputs, e: int) -> float:
    """Bytes per token and layer that context parallelism's exchange adds to what the layer keeps for backward.
    gather (this engine, models/context_parallel.py): each layer's K and V gathered over the whole sequence, cp times
    a rank's own; ring (megatron_cp_algo): nothing, flash attention keeps the rank's own Q, K, V, output and
    logsumexp, and backward passes K and V round the ring again; Ulysses: the attention output twice, flash
    attention's in the heads layout (the full sequence, heads / cp) and linear_proj's input after the all-to-all
    back (the rank's tokens, every head of the TP rank): + e q / t."""
    if inputs.cp == 1:
        return 0.0
    kv_per_rank = inputs.arch.kv_width / inputs.tp
    return {CP_GATHER: 2 * e * kv_per_rank * (inputs.cp - 1), "megatron_cp_algo": 0.0,
            "ulysses_cp_algo": e * inputs.arch.q_width / inputs.tp}[inputs.cp_exchange]


def cp_exchange_in_flight(inputs: PlanInputs, e: int) -> float:
    """Bytes per token held once, by the layer whose backward runs. ring (MindSpeed's ring_context_parallel.py): its
    backward holds three K/V pairs of a chunk (the current one, the next of the ring, the next round's:
    ContextParallelKVCache) and three of their gradients (cur_dkv, next_dkv, next_round_dkv): 6 x 2e kv / t; Ulysses
    (ulysses_context_parallel.py): an all-to-all's input and output coexist, Q, K and V in the sequence layout
    beside the heads layout's: e (q + 2 kv) / t; gather: the gathered K and V are kept, nothing more."""
    if inputs.cp == 1 or inputs.cp_exchange == CP_GATHER:
        return 0.0
    q, kv = inputs.arch.q_width / inputs.tp, inputs.arch.kv_width / inputs.tp
    return 6 * 2 * e * kv if inputs.cp_exchange == "megatron_cp_algo" else e * (q + 2 * kv)


def activation_bytes(inputs: PlanInputs, pp_rank: int, *, logits: bool = True) -> int:
    """Peak bytes autograd keeps for backward on a rank of pipeline stage `pp_rank` during the update; without
    `logits` (the critic's value head) the last stage keeps no vocabulary-sized rows."""
    terms = activation_terms(inputs)
    layers = stage_layers(inputs.arch, pp_rank, inputs.pp)
    per_token, recomputing = _recomputed_layers(
        inputs, [terms.moe_layer if inputs.arch.is_moe_layer(i) else terms.dense_layer for i in layers])
    if pp_rank == 0:
        per_token += terms.first_stage
        recomputing += terms.first_stage if recomputing else 0.0
    if pp_rank == inputs.pp - 1:
        response = min(inputs.seq_length, inputs.response_length or inputs.seq_length)
        per_token += terms.last_stage + (terms.last_stage_per_response_token * response / inputs.padded_seq_length
                                         if logits else 0.0)
    in_flight = min(inputs.pp - pp_rank, inputs.micro_batches_per_step)
    # One micro-batch at a time runs its backward, and recomputes there: the others keep what forward left; the
    # layer running holds CP's exchange buffers.
    running = max(per_token, recomputing) + terms.exchange_in_flight
    return int(((in_flight - 1) * per_token + running) * inputs.tokens_per_micro_batch)


def _recomputed_layers(inputs: PlanInputs, layer_terms: list[float]) -> tuple[float, float]:
    """Bytes per token a stage's layers keep after a micro-batch's forward, and the peak while its backward
    recomputes (0 without full recompute). Full recompute keeps a recomputed chunk's input only (`uniform`:
    chunks of n layers; `block`: the first n layers one by one) and rebuilds the chunk in backward, when the
    layers after it have been freed and those before it still hold what forward kept (measured on CPU)."""
    if inputs.recompute_granularity != "full":
        return sum(layer_terms), 0.0
    layer_input = (2 if inputs.bf16 else 4) * inputs.arch.hidden_size / (
        inputs.tp if inputs.sequence_parallel_effective else 1)
    n = inputs.recompute_num_layers or 1
    if inputs.recompute_method == "uniform":
        chunks = [sum(layer_terms[i:i + n]) for i in range(0, len(layer_terms), n)]
        return len(chunks) * layer_input, max((j * layer_input + chunk for j, chunk in enumerate(chunks)), default=0.0)
    recomputed = min(n, len(layer_terms))
    kept = recomputed * layer_input + sum(layer_terms[recomputed:])
    return kept, max((j * layer_input + term for j, term in enumerate(layer_terms[:recomputed])), default=0.0)
