"""Assets for the whole-iteration benchmark at the realistic shape (bench_long_iteration.py).

A Qwen2-architecture checkpoint of bench_long_responses.py's shape (vocabulary 32768, hidden 256, 4 layers,
fp32, 1024 positions) with the demo's tokenizer padded to 32768 ids (train_arith_tokenizer: a BPE over sums,
topped up with `<|unused_k|>` tokens, `<|endoftext|>` = id 0 = EOS), and prompts of 64-256 tokens: long sums
"d+d+...+d=" (every digit and every "+" one token), the answer their sum.

The response lengths. A random model of 32768 ids emits EOS about once in 32768 tokens, so every response
would run to the cap. To get RL's long tail instead, EOS's row of the output layer (lm_head) is replaced by
`beta * u`, u the unit mean of the final hidden states over random token sequences: EOS's logit is then about
`beta * |mean|` at every position, and beta is set by bisection so that the mean EOS probability per
position (teacher-forced on random sequences) is `1 / --eos-mean` (default 1/200: a geometric length of mean
~185 tokens, ~8% cut at 512). The per-position probability varies around that mean; the lengths that
occurred are read back from the runs and printed.
"""
from __future__ import annotations

import json
import random
from pathlib import Path

import torch

from bench_long_responses import FFN, HEADS, HIDDEN, KV_HEADS, LAYERS, VOCAB

MAX_POSITIONS = 1024


@torch.no_grad()
def _final_hidden(model, tokens: torch.Tensor) -> torch.Tensor:
    out = model.model(input_ids=tokens)
    return out.last_hidden_state.reshape(-1, out.last_hidden_state.shape[-1])


@torch.no_grad()
def calibrate_eos(model, eos_id: int, per_token: float, prompts: list[list[int]], seed: int = 3) -> dict:
    """Set lm_head[eos] = beta * u (see the module's docstring) on the benchmark's own contexts: each prompt
    followed by 512 uniformly drawn tokens (what a random policy samples), at the response positions."""
    g = torch.Generator().manual_seed(seed)
    hidden = []
    for ids in prompts:
        tokens = torch.cat([torch.tensor(ids), torch.randint(1, VOCAB, (512,), generator=g)]).unsqueeze(0)
        hidden.append(_final_hidden(model, tokens)[len(ids) - 1:-1])
    hidden = torch.cat(hidden)
    mean = hidden.mean(0)
    u = mean / mean.norm()
    head = model.lm_head.weight

    def eos_p(beta: float) -> torch.Tensor:
        head[eos_id] = beta * u
        return torch.softmax(hidden @ head.T, dim=-1)[:, eos_id]

    lo, hi = 0.0, 64.0
    for _ in range(40):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if eos_p(mid).mean().item() < per_token else (lo, mid)
    p = eos_p((lo + hi) / 2)  # leaves lm_head[eos] = beta * u
    survival = torch.exp(torch.cumsum(torch.log1p(-p.view(len(prompts), -1)), dim=1))  # P(no EOS up to i)
    projection = hidden @ u
    return {"beta": (lo + hi) / 2, "contexts": len(prompts), "eos_p_mean": p.mean().item(),
            "eos_p_median": p.median().item(), "eos_p_p10_p90": [p.quantile(0.1).item(), p.quantile(0.9).item()],
            "hidden_projection_mean_over_std": (projection.mean() / projection.std()).item(),
            "expected_length_on_these_contexts": survival.sum(1).mean().item(),
            "expected_share_reaching_512": survival[:, -1].mean().item()}


def make_assets(out_dir: Path, *, eos_mean: float, num_prompts: int = 64, seed: int = 1) -> dict:
    """The checkpoint (EOS calibrated) and prompts under ``out_dir``; returns their paths and the calibration."""
    from transformers import AutoModelForCausalLM

    from mindspeed_rl.data.arith_task import write_prompts_jsonl
    from mindspeed_rl.data.tiny_model import create_tiny_qwen2_checkpoint
    from mindspeed_rl.data.tokenizer import EOS_TOKEN_ID, train_arith_tokenizer

    model_dir = out_dir / "model"
    tokenizer = train_arith_tokenizer(VOCAB, seed)
    create_tiny_qwen2_checkpoint(model_dir, vocab_size=VOCAB, hidden_size=HIDDEN, ffn_hidden_size=FFN,
                                 num_layers=LAYERS, num_attention_heads=HEADS, num_query_groups=KV_HEADS,
                                 max_position_embeddings=MAX_POSITIONS, seed=seed, tokenizer=tokenizer)
    rng = random.Random(seed)
    rows = []
    for _ in range(num_prompts):
        digits = [rng.randint(0, 9) for _ in range(rng.randint(64, 256) // 2)]
        rows.append({"prompt": "+".join(map(str, digits)) + "=", "answer": str(sum(digits))})
    prompts = out_dir / "prompts.jsonl"
    write_prompts_jsonl(prompts, rows)
    encoded = [tokenizer.encode(r["prompt"]).ids for r in rows]
    lengths = [len(ids) for ids in encoded]
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    calibration = calibrate_eos(model, EOS_TOKEN_ID, 1.0 / eos_mean, encoded[:16])
    model.save_pretrained(str(model_dir))
    return {"model_dir": str(model_dir), "prompts": str(prompts), "eos_calibration": calibration,
            "prompt_tokens": {"min": min(lengths), "max": max(lengths), "mean": sum(lengths) / len(lengths)},
            "parameters": sum(p.numel() for p in model.parameters())}


if __name__ == "__main__":
    import sys
    import tempfile

    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    print(json.dumps(make_assets(Path(tempfile.mkdtemp(prefix="bench_long_assets-")), eos_mean=200.0), indent=2))
