"""What the Megatron-on-CPU layer costs per train step: scoped factories vs a global TorchFunctionMode, side by side.

    python benchmarks/bench_megatron_cpu_scope.py [--json FILE] [--rounds 7] [--steps 8]

Builds the demo's model (grpo_tiny_cpu's sizes: hidden 128, ffn 256, 2 layers, 4 heads, 2 query groups) as a real
MegatronEngine on a one-rank gloo world and times `train_step` (forward, backward, Adam; 128 samples of 12 tokens
in micro-batches of 16, as the demo's update) and `compute_logprobs` in two settings, alternating round by round:

- scoped: `megatron_on_cpu()` as the engine runs it, only the factories megatron calls with device="cuda",
  `Tensor.cuda/to/type` rebound for the scope (accelerator/megatron_cpu.py);
- mode: the same plus the TorchFunctionMode the layer used before (every torch call goes through Python
  `__torch_function__`; kept here, verbatim, as the baseline).

Prints the median seconds of each and the ratio scoped / mode. Timings, not assertions.
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

import torch
from torch.overrides import TorchFunctionMode

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


class LegacyCudaToCpuMode(TorchFunctionMode):
    """The previous P3/P4 layer, the baseline."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        from mindspeed_rl.accelerator.megatron_cpu import _is_cuda_device

        kwargs = kwargs or {}
        if func is torch.Tensor.cuda:
            return args[0]
        if func is torch.Tensor.type and len(args) == 1 and not kwargs:
            name = func(*args)
            return name if ".cuda." in name else name.replace("torch.", "torch.cuda.", 1)
        if _is_cuda_device(kwargs.get("device")):
            kwargs = {**kwargs, "device": "cpu"}
        if func is torch.Tensor.to and len(args) > 1 and _is_cuda_device(args[1]):
            args = (args[0], "cpu", *args[2:])
        return func(*args, **kwargs)


def _engine():
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    from mindspeed_rl.accelerator import get_accelerator
    from mindspeed_rl.data.tiny_model import create_tiny_qwen2_checkpoint
    from mindspeed_rl.engines.megatron_engine import MegatronEngine, OptimizerSettings
    from mindspeed_rl.models.checkpoint import load_hf_checkpoint
    from mindspeed_rl.parallel import megatron_state
    from mindspeed_rl.parallel.layout import TrainLayout

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT="29517", RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
    dist.init_process_group("gloo", rank=0, world_size=1)
    parallel = megatron_state.initialize(TrainLayout(), rank=0, world_size=1, timeout_minutes=30)
    accelerator = get_accelerator("cpu")
    accelerator.seed_model_parallel_rng(1)
    hf_dir = Path(tempfile.mkdtemp(prefix="bench_scope-")) / "model"
    create_tiny_qwen2_checkpoint(hf_dir, vocab_size=16, hidden_size=128, ffn_hidden_size=256, num_layers=2,
                                 num_attention_heads=4, num_query_groups=2, seed=1)
    spec, state = load_hf_checkpoint(str(hf_dir))
    adam = OptimizerSettings(lr=1e-5, min_lr=0.0, weight_decay=0.0, adam_beta1=0.9, adam_beta2=0.95, adam_eps=1e-8,
                             clip_grad=1.0)
    return MegatronEngine(spec=spec, hf_state=state, params_dtype=torch.float32, accelerator=accelerator,
                          parallel=parallel, optimizer=adam)


def _batch(num_samples: int):
    from mindspeed_rl.protocol import RolloutBatch

    generator = torch.Generator().manual_seed(0)
    prompts = [torch.randint(1, 16, (8,), generator=generator).tolist() for _ in range(num_samples)]
    responses = [torch.randint(1, 16, (4,), generator=generator).tolist() for _ in range(num_samples)]
    return RolloutBatch.from_token_lists(prompts, responses, pad_id=0, response_width=4)


def _time_steps(engine, batch, steps: int, legacy: bool) -> tuple[float, float]:
    def loss_fn(logprobs, entropy, mb):
        loss = -(logprobs * mb.response_mask).sum() / batch.response_mask.sum()
        return loss, {"loss": loss.item()}

    mode = LegacyCudaToCpuMode() if legacy else None
    if mode is not None:
        mode.__enter__()
    try:
        started = time.perf_counter()
        for _ in range(steps):
            engine.train_step(batch, micro_batch_size=16, temperature=1.0, loss_fn=loss_fn)
        train_seconds = (time.perf_counter() - started) / steps
        started = time.perf_counter()
        for _ in range(steps):
            engine.compute_logprobs(batch, micro_batch_size=64, temperature=1.0)
        forward_seconds = (time.perf_counter() - started) / steps
    finally:
        if mode is not None:
            mode.__exit__(None, None, None)
    return train_seconds, forward_seconds


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json", type=Path)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--steps", type=int, default=8)
    args = parser.parse_args(argv)
    torch.set_num_threads(2)
    engine, batch = _engine(), _batch(128)
    _time_steps(engine, batch, 2, legacy=False)  # warm-up: first-call allocations and lazy inits
    samples = {"scoped": {"train": [], "forward": []}, "mode": {"train": [], "forward": []}}
    for _ in range(args.rounds):
        for name in ("scoped", "mode"):
            train, forward = _time_steps(engine, batch, args.steps, legacy=name == "mode")
            samples[name]["train"].append(train)
            samples[name]["forward"].append(forward)
    result = {name: {kind: statistics.median(values) for kind, values in kinds.items()} for name, kinds in samples.items()}
    result["ratio_train"] = result["scoped"]["train"] / result["mode"]["train"]
    result["ratio_forward"] = result["scoped"]["forward"] / result["mode"]["forward"]
    result["load_average"] = os.getloadavg()
    print(f"train_step (128 samples, micro-batches of 16): scoped {result['scoped']['train'] * 1e3:.1f} ms, "
          f"mode {result['mode']['train'] * 1e3:.1f} ms, scoped/mode {result['ratio_train']:.2f}")
    print(f"compute_logprobs (128 samples, micro-batches of 64): scoped {result['scoped']['forward'] * 1e3:.1f} ms, "
          f"mode {result['mode']['forward'] * 1e3:.1f} ms, scoped/mode {result['ratio_forward']:.2f}")
    print(f"medians of {args.rounds} alternating rounds x {args.steps} steps; load average {result['load_average']}")
    if args.json:
        args.json.write_text(json.dumps({"samples": samples, **result}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
