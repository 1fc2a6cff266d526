"""Independent oracles for resharding tests: shards cut from full HF tensors with plain torch ops,
written without the layout/segment machinery under test."""
import socket

import torch

from mindspeed_rl.data.tiny_model import create_tiny_qwen2_checkpoint
from mindspeed_rl.models.qwen2 import Qwen2Spec


def tiny_spec(*, vocab=64, hidden=64, ffn=128, layers=4, heads=4, kv=2, tie=False) -> Qwen2Spec:
    return Qwen2Spec(vocab_size=vocab, hidden_size=hidden, ffn_hidden_size=ffn, num_layers=layers,
                     num_attention_heads=heads, num_query_groups=kv, head_dim=hidden // heads, rms_norm_eps=1e-6,
                     rope_theta=1e6, max_position_embeddings=128, tie_word_embeddings=tie)


def random_hf_state(spec: Qwen2Spec, seed: int = 0) -> dict[str, torch.Tensor]:
    from mindspeed_rl.models.layouts import hf_shapes

    g = torch.Generator().manual_seed(seed)
    return {name: torch.randn(shape, generator=g) for name, shape in hf_shapes(spec).items()}


def vllm_shard_oracle(hf: dict[str, torch.Tensor], spec: Qwen2Spec, tp: int, rank: int) -> dict[str, torch.Tensor]:
    """What vLLM's weight loaders put in rank `rank` of a TP=`tp` Qwen2 model."""
    hd = spec.head_dim
    heads = spec.num_attention_heads // tp
    kv = spec.num_query_groups
    if kv >= tp:
        kv_heads = list(range(rank * kv // tp, (rank + 1) * kv // tp))
    else:
        kv_heads = [rank * kv // tp]  # replicated: tp/kv consecutive ranks share one KV head

    def rows(t, idx_heads):
        return torch.cat([t[h * hd:(h + 1) * hd] for h in idx_heads])

    def vocab(t):
        padded = -(-spec.vocab_size // 64) * 64
        full = torch.zeros(padded, *t.shape[1:])
        full[: t.shape[0]] = t
        return full.chunk(tp)[rank].clone()

    out = {"model.embed_tokens.weight": vocab(hf["model.embed_tokens.weight"]), "model.norm.weight": hf["model.norm.weight"]}
    if not spec.tie_word_embeddings:
        out["lm_head.weight"] = vocab(hf["lm_head.weight"])
    q_heads = list(range(rank * heads, (rank + 1) * heads))
    for i in range(spec.num_layers):
        p = f"model.layers.{i}."
        for kind in ("weight", "bias"):
            out[f"{p}self_attn.qkv_proj.{kind}"] = torch.cat([
                rows(hf[f"{p}self_attn.q_proj.{kind}"], q_heads),
                rows(hf[f"{p}self_attn.k_proj.{kind}"], kv_heads),
                rows(hf[f"{p}self_attn.v_proj.{kind}"], kv_heads)])
        out[p + "self_attn.o_proj.weight"] = hf[p + "self_attn.o_proj.weight"].chunk(tp, dim=1)[rank]
        out[p + "mlp.gate_up_proj.weight"] = torch.cat([hf[p + "mlp.gate_proj.weight"].chunk(tp)[rank],
                                                         hf[p + "mlp.up_proj.weight"].chunk(tp)[rank]])
        out[p + "mlp.down_proj.weight"] = hf[p + "mlp.down_proj.weight"].chunk(tp, dim=1)[rank]
        out[p + "input_layernorm.weight"] = hf[p + "input_layernorm.weight"]
        out[p + "post_attention_layernorm.weight"] = hf[p + "post_attention_layernorm.weight"]
    return out


def make_checkpoint(path, **kwargs) -> str:
    sizes = dict(vocab_size=64, hidden_size=128, ffn_hidden_size=256, num_layers=4, num_attention_heads=4,
                 num_query_groups=2, seed=11)
    sizes.update(kwargs)
    create_tiny_qwen2_checkpoint(path, **sizes)
    return str(path)


# -- MoE (Qwen3-MoE) ------------------------------------------------------------------------------
def fused_experts(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Checkpoint names (one tensor per expert) -> transformers 5's in-memory fused experts."""
    out, experts = {}, {}
    for name, tensor in state.items():
        if ".mlp.experts." not in name:
            out[name] = tensor
            continue
        prefix, rest = name.split(".mlp.experts.")
        expert, kind = rest.split(".")[:2]
        experts.setdefault(prefix, {}).setdefault(int(expert), {})[kind] = tensor
    for prefix, by_expert in experts.items():
        ids = sorted(by_expert)
        out[prefix + ".mlp.experts.gate_up_proj"] = torch.stack(
            [torch.cat([by_expert[e]["gate_proj"], by_expert[e]["up_proj"]]) for e in ids])
        out[prefix + ".mlp.experts.down_proj"] = torch.stack([by_expert[e]["down_proj"] for e in ids])
    return out


def tiny_moe_spec(*, vocab=96, hidden=64, layers=2, heads=4, kv=2, head_dim=32, experts=4, topk=2, moe_ffn=64) -> Qwen2Spec:
    return Qwen2Spec(vocab_size=vocab, hidden_size=hidden, ffn_hidden_size=2 * moe_ffn, num_layers=layers,
                     num_attention_heads=heads, num_query_groups=kv, head_dim=head_dim, rms_norm_eps=1e-6,
                     rope_theta=1e6, max_position_embeddings=128, tie_word_embeddings=False, qkv_bias=False,
                     qk_layernorm=True, num_experts=experts, moe_ffn_hidden_size=moe_ffn, moe_topk=topk)


def vllm_moe_shard_oracle(hf: dict[str, torch.Tensor], spec: Qwen2Spec, *, tp: int, dp: int, rank: int,
                          expert_parallel: bool) -> dict[str, torch.Tensor]:
    """What vLLM puts in rank `rank` of a TP=`tp` x DP=`dp` Qwen3MoeForCausalLM (plain experts).

    Attention: TP over the `tp` ranks of a DP group. MoE: vLLM flattens TP x DP; rank r = dp_rank*tp +
    tp_rank holds experts [r*E/n, (r+1)*E/n) whole with expert parallelism, else every expert's r-th
    slice of the intermediate dimension (checked against live vLLM 0.32 in the multiprocess test)."""
    tp_rank, n = rank % tp, tp * dp
    kv = spec.num_query_groups
    kv_part = (lambda t: t.chunk(tp)[tp_rank]) if kv >= tp else (lambda t: t.chunk(kv)[tp_rank * kv // tp])
    padded = -(-spec.vocab_size // 64) * 64

    def vocab(t):
        full = torch.zeros(padded, *t.shape[1:])
        full[: t.shape[0]] = t
        return full.chunk(tp)[tp_rank].clone()

    out = {"model.embed_tokens.weight": vocab(hf["model.embed_tokens.weight"]), "lm_head.weight": vocab(hf["lm_head.weight"]),
           "model.norm.weight": hf["model.norm.weight"]}
    for i in range(spec.num_layers):
        p = f"model.layers.{i}."
        out[p + "self_attn.qkv_proj.weight"] = torch.cat([hf[p + "self_attn.q_proj.weight"].chunk(tp)[tp_rank],
                                                          kv_part(hf[p + "self_attn.k_proj.weight"]),
                                                          kv_part(hf[p + "self_attn.v_proj.weight"])])
        out[p + "self_attn.o_proj.weight"] = hf[p + "self_attn.o_proj.weight"].chunk(tp, dim=1)[tp_rank]
        for name in ("self_attn.q_norm.weight", "self_attn.k_norm.weight", "input_layernorm.weight",
                     "post_attention_layernorm.weight", "mlp.gate.weight"):
            out[p + name] = hf[p + name]
        e = p + "mlp.experts.{}."
        if expert_parallel:
            ids = range(rank * spec.num_experts // n, (rank + 1) * spec.num_experts // n)
            w13 = [torch.cat([hf[e.format(x) + "gate_proj.weight"], hf[e.format(x) + "up_proj.weight"]]) for x in ids]
            w2 = [hf[e.format(x) + "down_proj.weight"] for x in ids]
        else:
            ids = range(spec.num_experts)
            w13 = [torch.cat([hf[e.format(x) + "gate_proj.weight"].chunk(n)[rank],
                              hf[e.format(x) + "up_proj.weight"].chunk(n)[rank]]) for x in ids]
            w2 = [hf[e.format(x) + "down_proj.weight"].chunk(n, dim=1)[rank] for x in ids]
        out[p + "mlp.experts.routed_experts.w13_weight"] = torch.stack(w13)
        out[p + "mlp.experts.routed_experts.w2_weight"] = torch.stack(w2)
    return out


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def perturbed_state(state: dict[str, torch.Tensor], case: int) -> dict[str, torch.Tensor]:
    """Distinct weights per layout case (same on every rank), so each push has something to prove."""
    g = torch.Generator().manual_seed(100 + case)
    return {k: v + 0.02 * torch.randn(v.shape, generator=g) for k, v in state.items()}


PROMPTS = [[5, 9, 6, 11], [7, 9, 8, 11, 3], [4, 9, 4]]
MAX_TOKENS = 5


# Largest |vLLM - Megatron| sampled-token log-prob allowed, per dtype. fp32: both engines agree to
# summation order (measured 1e-6). bf16: each engine rounds activations to bf16 in its own places;
# docs/bf16_logprobs.md measures, on these random-init checkpoints (logit std ~0.6), a gap of at most
# 2.0e-2 (mean 4.6e-3), while Megatron holding stale weights (+0.02 noise, one perturbed_state step)
# is off by up to 1.9 (mean 0.44): 0.1 has 5x margin over the arithmetic and catches a wrong weight.
LOGPROB_TOLERANCE = {torch.float32: 1e-4, torch.bfloat16: 0.1}


def assert_vllm_logprobs_match_megatron(engine, rollout, rank: int, world: int, infer_tp: int,
                                        dtype: torch.dtype = torch.float32) -> None:
    """Each rank's own vLLM samples scored by the (SPMD) Megatron model of the same weights."""
    import torch.distributed as dist

    from mindspeed_rl.protocol import RolloutBatch

    gens = rollout.generate(PROMPTS, n=2, max_tokens=MAX_TOKENS, temperature=1.0, top_p=1.0, top_k=-1, min_p=0.0,
                            seed=rank // infer_tp)  # one seed per TP group: its ranks must sample alike
    mine = [(PROMPTS[g.prompt_index], g.token_ids, g.logprobs) for g in gens]
    everyone = [None] * world
    dist.all_gather_object(everyone, mine)
    for owner, samples in enumerate(everyone):  # every rank runs every batch: Megatron is SPMD
        batch = RolloutBatch.from_token_lists([p for p, _, _ in samples], [t for _, t, _ in samples], pad_id=0,
                                              response_width=MAX_TOKENS)
        got = engine.compute_logprobs(batch, micro_batch_size=2, temperature=1.0)
        if owner == rank:
            expected = torch.zeros(batch.response_logprobs_shape)
            for row, (_, _, lps) in enumerate(samples):
                expected[row, : len(lps)] = torch.tensor(lps)
            diff = ((got - expected).abs() * batch.response_mask).max().item()
            assert diff < LOGPROB_TOLERANCE[dtype], (rank, dtype, diff)


# -- inference pipeline parallelism ---------------------------------------------------------------
# vLLM 0.32's layer partition (vllm/distributed/utils.py get_pp_indices), written out per case so the
# oracle does not share code with the layout under test; test_resharding_plan_infer_pp checks the
# layout's partition against vLLM's own function.
VLLM_PP_PARTITIONS = {(4, 2): [2, 2], (4, 4): [1, 1, 1, 1], (5, 2): [3, 2], (6, 2): [3, 3], (6, 4): [1, 2, 2, 1],
                      (8, 4): [2, 2, 2, 2], (2, 2): [1, 1]}


def vllm_stage_oracle(shard: dict[str, torch.Tensor], spec: Qwen2Spec, pp: int, pp_rank: int) -> dict[str, torch.Tensor]:
    """The part of a whole-model vLLM TP shard that pipeline stage `pp_rank` fills: its layers, the
    embedding on the first stage (and on the last when the head is tied to it: Qwen2ForCausalLM
    builds embed_tokens there), the final norm and the head on the last."""
    sizes = VLLM_PP_PARTITIONS[(spec.num_layers, pp)]
    first_layer = sum(sizes[:pp_rank])
    mine = set(range(first_layer, first_layer + sizes[pp_rank]))
    first, last = pp_rank == 0, pp_rank == pp - 1
    out = {}
    for name, tensor in shard.items():
        if name.startswith("model.layers."):
            keep = int(name.split(".")[2]) in mine
        elif name == "model.embed_tokens.weight":
            keep = first or (last and spec.tie_word_embeddings)
        else:  # model.norm.weight, lm_head.weight
            keep = last
        if keep:
            out[name] = tensor
    return out


def four_sample_batch(pad: int):
    """Four samples of uneven prompt (2-5) and response (1-6) lengths over tokens below `pad`, right-padded."""
    from mindspeed_rl.protocol import RolloutBatch

    generator = torch.Generator().manual_seed(3)
    prompt_lengths, response_lengths = [3, 5, 2, 4], [4, 1, 6, 2]
    prompts = [torch.randint(0, pad, (n,), generator=generator).tolist() for n in prompt_lengths]
    responses = [torch.randint(0, pad, (n,), generator=generator).tolist() for n in response_lengths]
    return RolloutBatch.from_token_lists(prompts, responses, pad_id=pad, response_width=6)


def hf_adapters(shapes: dict, seed: int = 1) -> dict:
    """Random LoRA A/B tensors by their HF names (resharding/adapter_plan.adapter_layouts' shapes)."""
    generator = torch.Generator().manual_seed(seed)
    return {name: torch.randn(shape, generator=generator) for name, shape in sorted(shapes.items())}


def merged_hf(hf: dict, adapters: dict, spec, scale: float) -> dict:
    """W + scale B A per HF module: q/k/v share their fused linear's A, gate/up theirs."""
    from mindspeed_rl.models.lora_peft import HF_MODULES

    merged = dict(hf)
    for layer in range(spec.num_layers):
        for target, modules in HF_MODULES.items():
            for module in modules:
                prefix = f"model.layers.{layer}.{'self_attn' if target in ('linear_qkv', 'linear_proj') else 'mlp'}"
                name = f"{prefix}.{module}"
                a = adapters.get(f"{name}.lora_A", adapters.get(f"model.layers.{layer}.{target}.lora_A"))
                merged[f"{name}.weight"] = hf[f"{name}.weight"] + scale * adapters[f"{name}.lora_B"] @ a
    return merged


def fill_layout(tensors, adapters: dict) -> dict:
    """Each local tensor of a layout filled from the HF tensors its segments name."""
    out = {}
    for t in tensors:
        out[t.key] = torch.zeros(t.shape)
        for seg in t.segments:
            out[t.key].narrow(t.dim, seg.local_start, seg.length).copy_(
                adapters[seg.hf_name].narrow(t.dim, seg.hf_start, seg.length))
    return out


class PlainDestination:
    """vLLM's parameters of one rank as plain tensors (the resharding layout's names and shapes)."""

    def __init__(self, spec, infer, rank: int, world_size: int):
        from mindspeed_rl.resharding.plan import infer_layouts

        tensors = infer_layouts(spec, infer, range(world_size))[rank]
        self.weights = {t.name: torch.zeros(t.shape) for t in tensors}

    def named_weights(self):
        return self.weights

    def mark_weights_loaded(self):
        pass


def adapter_push_check(actor, infer_tp: int) -> dict:
    """The adapter-only switch against the merged weights pushed whole, twice (the second after B changed):
    `push_errors` (max relative difference per push) and `push_bytes` ((received, planned, full push's received))."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    from mindspeed_rl.resharding.adapter_push import colocated_adapter_push
    from mindspeed_rl.resharding.plan import InferLayout, TrainLayout
    from mindspeed_rl.resharding.weight_push import colocated_push

    rank, world = dist.get_rank(), dist.get_world_size()
    train = TrainLayout(tp=ps.get_tensor_model_parallel_world_size(), pp=ps.get_pipeline_model_parallel_world_size())
    infer = InferLayout(tp=infer_tp)
    merged, adapted = PlainDestination(actor.spec, infer, rank, world), PlainDestination(actor.spec, infer, rank, world)
    common = dict(actor=actor, train=train, infer=infer, rank=rank, world_size=world, bucket_bytes=1 << 16,
                  check_weights=True)
    full, adapter = colocated_push(inference_model=merged, **common), colocated_adapter_push(inference_model=adapted, **common)
    errors, received = [], []
    for _ in range(2):
        full_metrics, adapter_metrics = full.push(), adapter.push()
        errors.append(max(((adapted.weights[n] - w).abs().max() / w.abs().max().clamp(min=1e-12)).item()
                          for n, w in merged.weights.items()))
        received.append((adapter_metrics["resharding/bytes_received"],
                         adapter_metrics["resharding/planned_bytes_received"], full_metrics["resharding/bytes_received"]))
        with torch.no_grad():
            for name, p in actor.module.named_parameters():
                if name.endswith("lora_B"):
                    p.mul_(2.0)
    return dict(push_errors=errors, push_bytes=received)
