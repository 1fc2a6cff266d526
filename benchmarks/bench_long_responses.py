"""The update at a realistic RL shape: padded against packed micro-batches, and the log-prob path before and after.

    python benchmarks/bench_long_responses.py --json FILE [--prompts 4] [--samples 8] [--repeats 2]

A Qwen2-architecture model generated locally (vocabulary 32768, hidden 256, 4 layers, 21M parameters, fp32),
`--prompts` x `--samples` samples with prompts of 64-256 tokens and responses with RL's long tail (64 + an
exponential of mean 120 tokens, cut at 512). One GRPO optimizer step (Megatron, TP1, in this process) on the
same batch and weights, alternating padded and packed `--repeats` times each, printing side by side:

- update seconds (median) and the peak bytes autograd keeps (the ledger's activation meter), padded vs
  packed (`rl_config.use_remove_padding` + `use_dynamic_bsz`, budget `--budget` tokens), and their ratio;
- the tokens pushed through the model and the padding among them;
- the log-prob + entropy path's saved bytes on one micro-batch's logits, the previous path (an fp32 copy of every
  position's logits for Megatron's cross entropy, and the whole vocabulary's log-softmax for the entropy:
  reproduced here as it was) against engines/vocab_parallel.py, and the last stage's extra bytes per token.

A whole GRPO iteration at this shape (the phases, the planner beside the ledger, TRL's GRPOTrainer alternating
with ours): bench_long_iteration.py (`make bench-long-iteration`).
"""
from __future__ import annotations

import argparse
import itertools
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

VOCAB, HIDDEN, FFN, LAYERS, HEADS, KV_HEADS = 32768, 256, 1024, 4, 4, 2


def _batch(prompts: int, samples: int, seed: int):
    from mindspeed_rl.protocol import RolloutBatch

    g = torch.Generator().manual_seed(seed)
    prompt_ids, response_ids = [], []
    for _ in range(prompts):
        prompt = torch.randint(1, VOCAB, (int(torch.randint(64, 257, (1,), generator=g)),), generator=g).tolist()
        for _ in range(samples):
            tail = -120 * torch.log(torch.rand(1, generator=g)).item()
            prompt_ids.append(prompt)
            response_ids.append(torch.randint(1, VOCAB, (int(min(512, 64 + tail)),), generator=g).tolist())
    batch = RolloutBatch.from_token_lists(prompt_ids, response_ids, pad_id=0, response_width=512)
    mask = batch.response_mask
    batch.columns["old_logprobs"] = (-10.4 + 0.3 * torch.randn(mask.shape, generator=g)) * mask
    batch.columns["ref_logprobs"] = (-10.4 + 0.3 * torch.randn(mask.shape, generator=g)) * mask
    batch.columns["advantages"] = torch.randn(len(batch), 1, generator=g).expand_as(mask) * mask
    return batch


def _engines(world, parallel):
    from mindspeed_rl.data.tiny_model import create_tiny_qwen2_checkpoint
    from mindspeed_rl.engines.megatron_engine import MegatronEngine, OptimizerSettings
    from mindspeed_rl.models.checkpoint import load_hf_checkpoint
    from mindspeed_rl.models.qwen2 import ModelOptions

    path = Path(tempfile.mkdtemp(prefix="bench_long_")) / "model"
    create_tiny_qwen2_checkpoint(path, vocab_size=VOCAB, hidden_size=HIDDEN, ffn_hidden_size=FFN, num_layers=LAYERS,
                                 num_attention_heads=HEADS, num_query_groups=KV_HEADS, max_position_embeddings=1024,
                                 seed=1)
    spec, state = load_hf_checkpoint(str(path))
    settings = OptimizerSettings(lr=1e-6, min_lr=0.0, weight_decay=0.0, adam_beta1=0.9, adam_beta2=0.95,
                                 adam_eps=1e-8, clip_grad=1.0)
    return {packed: MegatronEngine(spec=spec, hf_state=state, params_dtype=torch.float32, accelerator=world,
                                   parallel=parallel, optimizer=settings, options=ModelOptions(packed_sequences=packed))
            for packed in (False, True)}, sum(t.numel() for t in state.values())


def _update(engine, batch, *, micro_batch_size: int, packing) -> tuple[float, int]:
    from mindspeed_rl.algorithms.grpo import GRPOLossConfig
    from mindspeed_rl.memory import ActivationMeter
    from mindspeed_rl.memory.megatron_states import grad_buffer_tensors, optimizer_state_tensors, param_tensors
    from mindspeed_rl.workers.actor_steps import train_on_mini_batch

    config = GRPOLossConfig(clip_ratio=0.2, kl_penalty="low_var_kl", kl_coef=0.01, entropy_coeff=0.0,
                            loss_agg_mode="token-mean")
    keep = itertools.chain(param_tensors(engine.module), grad_buffer_tensors(engine.model),
                           optimizer_state_tensors(engine.optimizer))
    started = time.perf_counter()
    with ActivationMeter({t.untyped_storage()._cdata for t in keep}) as meter:
        train_on_mini_batch(engine, batch, config, micro_batch_size=micro_batch_size, temperature=1.0,
                            packing=packing)
    return time.perf_counter() - started, meter.peak_bytes


def previous_response_logprobs(logits, mb):
    """The log-prob path before engines/vocab_parallel.py, as it was (TP1): fp32 logits, Megatron's cross entropy
    on a clone, the whole vocabulary's log-softmax and exp for the entropy, at every position."""
    from megatron.core import tensor_parallel

    logits = logits.float()
    targets = torch.roll(mb.input_ids, shifts=-1, dims=1)
    token_logprobs = -tensor_parallel.vocab_parallel_cross_entropy(logits.clone(), targets)
    index = (mb.prompt_lengths.unsqueeze(1) - 1 + torch.arange(mb.response_width)).clamp(max=mb.input_ids.shape[1] - 1)
    logprobs = torch.gather(token_logprobs, 1, index) * mb.response_mask
    full = tensor_parallel.gather_from_tensor_model_parallel_region(logits)
    log_p = torch.log_softmax(full, dim=-1)
    entropy = torch.gather(-(log_p.exp() * log_p).sum(-1), 1, index) * mb.response_mask
    return logprobs, entropy


def _logprob_path_bytes(batch, micro_batch_size: int, parallel) -> dict:
    from mindspeed_rl.engines.vocab_parallel import response_logprobs_from_logits
    from mindspeed_rl.memory import ActivationMeter

    mb = batch.micro_batches(micro_batch_size, "cpu")[0]
    logits = torch.randn(*mb.input_ids.shape, VOCAB, requires_grad=True)
    out = {}
    for name, path in (("previous", lambda: previous_response_logprobs(logits, mb)),
                       ("vocab_parallel", lambda: response_logprobs_from_logits(logits, mb, 1.0, True, 1024,
                                                                                parallel=parallel))):
        with ActivationMeter({logits.untyped_storage()._cdata}) as meter:
            logprobs, entropy = path()
        (logprobs.sum() + entropy.sum()).backward()
        out[name] = meter.peak_bytes
    tokens = mb.input_ids.numel()
    return {"micro_batch_tokens": tokens, "response_tokens": int(mb.response_mask.sum()),
            "saved_bytes": out, "ratio_new_over_previous": out["vocab_parallel"] / out["previous"],
            "last_stage_extra_bytes_per_token": {"previous_formula": 4 * VOCAB + 8 * VOCAB,
                                                 "vocab_parallel_formula_per_response_token": 4 * VOCAB + 24}}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", type=Path)
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--samples", type=int, default=8)
    parser.add_argument("--micro-batch-size", type=int, default=8)
    parser.add_argument("--budget", type=int, default=4096, help="packed micro-batch token budget; default 4096")
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args(argv)

    sys.path.insert(0, str(REPO / "tests"))
    torch.set_num_threads(max(1, torch.get_num_threads()))
    import conftest  # noqa: F401  (the offline environment variables)

    from mindspeed_rl.protocol import Packing

    world, parallel = conftest.one_rank_world()
    engines, parameters = _engines(world, parallel)
    batch = _batch(args.prompts, args.samples, seed=2)
    real = int(batch.sample_lengths().sum())
    padded_tokens = batch.input_ids.numel()
    runs = {"padded": [], "packed": []}
    for _ in range(args.repeats):  # alternating, so that a change of load hits both alike
        runs["padded"].append(_update(engines[False], batch, micro_batch_size=args.micro_batch_size, packing=None))
        runs["packed"].append(_update(engines[True], batch, micro_batch_size=args.micro_batch_size,
                                      packing=Packing(max_tokens=args.budget)))
    seconds = {k: statistics.median(s for s, _ in v) for k, v in runs.items()}
    peak = {k: max(b for _, b in v) for k, v in runs.items()}
    result = {
        "model": {"parameters": parameters, "vocab": VOCAB, "hidden": HIDDEN, "layers": LAYERS},
        "samples": len(batch), "real_tokens": real, "padded_tokens": padded_tokens,
        "padding_share_padded": 1 - real / padded_tokens,
        "update_seconds": seconds, "update_seconds_packed_over_padded": seconds["packed"] / seconds["padded"],
        "activation_peak_bytes": peak, "activation_packed_over_padded": peak["packed"] / peak["padded"],
        "logprob_path": _logprob_path_bytes(batch, args.micro_batch_size, parallel),
        "load_average": list(__import__("os").getloadavg()),
    }
    print(json.dumps(result, indent=2))
    if args.json:
        args.json.write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
