"""Export a mindspeed_rl checkpoint's actor weights as an HF model directory:
``python cli/export_hf.py --checkpoint DIR --output OUT [--dtype bfloat16] [--max-shard-size-mb 5120]``.

DIR is a run's save root (its ``latest`` is exported) or one ``iter_NNNNNNN`` directory (see
mindspeed_rl/checkpoint/FORMAT.md). The weights load on one CPU process (gloo, TP1 PP1) whatever TP/PP the run
saved at, are converted to HF names through the resharding's layouts, and are written with config.json, the
tokenizer files and generation_config.json into OUT, atomically. The dtype is the training dtype unless --dtype
says otherwise. A LoRA run's checkpoint exports its adapters merged into the backbone, or with ``--peft`` as a PEFT
adapter directory (adapter_config.json + adapter_model.safetensors) for ``PeftModel.from_pretrained``; where the
checkpoint holds only the adapters (lora_filter), the backbone is the run's HF directory, or ``--base DIR``.

Exit codes: 0 on success; 2 on a user error (one line ``config error: <key>: <message>`` on stderr): a missing,
incomplete or corrupt checkpoint, an existing non-empty OUT, an unknown dtype.
"""
from __future__ import annotations

import argparse
import os
import socket
import sys

from mindspeed_rl.errors import ConfigError, error_lines

CONFIG_ERROR_EXIT_CODE = 2


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _init_single_rank():
    """This process as one rank at TP1 PP1, its groups (RankGroups): dist_checkpointing needs a process group and
    Megatron's parallel state, even on one rank."""
    import torch.distributed as dist

    from mindspeed_rl.parallel import megatron_state
    from mindspeed_rl.parallel.layout import TrainLayout

    if not dist.is_initialized():
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()), RANK="0", WORLD_SIZE="1",
                          LOCAL_RANK="0")
        dist.init_process_group("gloo", rank=0, world_size=1)
    groups = megatron_state.initialize(TrainLayout(), rank=0, world_size=1, timeout_minutes=30)
    from mindspeed_rl.accelerator import get_accelerator

    get_accelerator("cpu").seed_model_parallel_rng(0)
    return groups


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--checkpoint", required=True, help="a save root (uses its `latest`) or an iter_* dir")
    parser.add_argument("--output", required=True, help="new HF model directory (must not exist, or be empty)")
    parser.add_argument("--dtype", default=None, help="float32 | bfloat16 | float16 (default: the training dtype)")
    parser.add_argument("--max-shard-size-mb", type=int, default=5120, help="per safetensors file; default %(default)s")
    parser.add_argument("--peft", action="store_true",
                        help="LoRA: write the adapters as a PEFT adapter directory instead of the merged model")
    parser.add_argument("--base", default=None,
                        help="LoRA with lora_filter: the backbone's HF directory (default: the run's, as recorded)")
    args = parser.parse_args(argv)
    try:
        from mindspeed_rl.checkpoint.hf_export import ExportOptions, export_checkpoint, parse_dtype
        from mindspeed_rl.checkpoint.store import resolve_and_verify

        options = ExportOptions(dtype=None if args.dtype is None else parse_dtype(args.dtype),
                                max_shard_bytes=args.max_shard_size_mb * 1024 * 1024)
        if os.path.exists(args.output) and (not os.path.isdir(args.output) or os.listdir(args.output)):
            raise ConfigError("--output", f"{args.output} exists and is not an empty directory; choose a new path")
        # Verify before starting torch.distributed: a bad path fails in a second, not after the set-up.
        resolve_and_verify(args.checkpoint, key="--checkpoint")
        parallel = _init_single_rank()
        out = export_checkpoint(args.checkpoint, args.output, parallel=parallel, options=options, peft=args.peft,
                                base=args.base)
    except ConfigError as error:
        print("\n".join(error_lines(error)), file=sys.stderr)
        return CONFIG_ERROR_EXIT_CODE
    print(f"exported {args.checkpoint} -> {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
