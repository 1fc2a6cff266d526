"""LoRA's switch at real shapes: bytes each rank receives per switch, the adapter-only plan against the full push.

    python benchmarks/bench_lora_switch.py [--json FILE]

The two plans (resharding/plan.build_plan: every weight through the resharding plan; resharding/adapter_plan:
the slices of A and B each vLLM shard needs) are pure functions of the model's config.json and the layouts, so
this computes them for the published Qwen2.5-7B and 32B configs at MindSpeed-RL's layouts (16 devices), with
adapters of rank 16 and 128 on all four linears, and prints the busiest rank's bytes (bf16) side by side. The
executed transfer receives exactly the plan's bytes (tests/test_lora_multiprocess.py, test_train_lora_e2e.py).
"""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
TARGETS = ("linear_qkv", "linear_proj", "linear_fc1", "linear_fc2")
# (model, train TP, train PP, infer TP): MindSpeed-RL's grpo_qwen25_7b_A3 and grpo_lora_qwen25_32b_A2 layouts
CASES = (("qwen25_7b", 2, 2, 1), ("qwen25_32b", 4, 4, 4))


def _spec(model: str):
    from transformers import AutoConfig

    from mindspeed_rl.models.qwen2 import Qwen2Spec

    with tempfile.TemporaryDirectory() as directory:
        (Path(directory) / "config.json").write_text((REPO / "configs/model/hf" / f"{model}.json").read_text())
        return Qwen2Spec.from_hf_config(AutoConfig.from_pretrained(directory))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    from mindspeed_rl.resharding.adapter_plan import build_adapter_plan
    from mindspeed_rl.resharding.plan import InferLayout, TrainLayout, build_plan

    rows = []
    for model, tp, pp, infer_tp in CASES:
        spec, train, infer, world = _spec(model), TrainLayout(tp=tp, pp=pp), InferLayout(tp=infer_tp), 16
        full = build_plan(spec, train, infer, world)
        full_bytes = 2 * max(full.received_numel(rank) for rank in range(world))
        for rank in (16, 128):
            adapter = build_adapter_plan(spec, train, infer, world, rank=rank, target_modules=TARGETS)
            adapter_bytes = 2 * max(adapter.received_numel(r) for r in range(world))
            rows.append(dict(model=model, train=f"TP{tp} x PP{pp}", infer=f"TP{infer_tp}", lora_r=rank,
                             full_push_bytes=full_bytes, adapter_push_bytes=adapter_bytes,
                             ratio=adapter_bytes / full_bytes))
            print(f"{model} {rows[-1]['train']} -> {rows[-1]['infer']}, r={rank}: full push {full_bytes / 1e9:.2f} GB, "
                  f"adapter-only {adapter_bytes / 1e9:.3f} GB per rank: {adapter_bytes / full_bytes:.4f}x")
    if args.json:
        args.json.write_text(json.dumps(rows, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
