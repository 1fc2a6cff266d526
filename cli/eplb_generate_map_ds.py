"""EPLB's redundant-expert map from a run's own expert loads, as MindSpeed-RL's script of the same name:
``python cli/eplb_generate_map_ds.py --json_folder DIR --num_replicas N --num_groups G --num_nodes M --num_gpus D
--output_path FILE``.

Reads every ``eplb_token_collects_<rank>.json`` in ``--json_folder`` (what ``generate_config.eplb_token_collects``
saved under ``generate_config.eplb_token_save_path``; other files there are not read), adds them into per-MoE-layer
expert loads and places ``--num_replicas`` expert copies per MoE layer on ``--num_gpus`` devices (vLLM's
expert-parallel ranks: infer TP x DP), ``--num_replicas / --num_gpus`` each, by DeepSeek's EPLB policy with
``--num_groups`` expert groups over ``--num_nodes`` nodes (mindspeed_rl/planner/eplb_map_builder.py). Writes the map
in vllm-ascend's format to ``--output_path``, the file ``generate_config.expert_map_path`` names, and reads it back
as a run does. Prints per MoE layer the heaviest device's load over the mean, for experts placed evenly and for the map.

Exit codes: 0; 2 on bad input, one line ``config error: <argument>: <why>`` on stderr.
"""
from __future__ import annotations

import argparse
import sys

import numpy as np

CONFIG_ERROR_EXIT_CODE = 2


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):  # one line and exit 2, like every other bad input
        print(f"config error: arguments: {message}", file=sys.stderr)
        sys.exit(CONFIG_ERROR_EXIT_CODE)


def _parser() -> argparse.ArgumentParser:
    parser = _Parser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json_folder", required=True,
                        help="folder of the per-rank eplb_token_collects_<rank>.json files")
    parser.add_argument("--num_replicas", type=int, required=True,
                        help="expert copies per MoE layer over all devices, the logical experts included")
    parser.add_argument("--num_groups", type=int, required=True, help="expert groups of the hierarchical policy")
    parser.add_argument("--num_nodes", type=int, required=True, help="machines")
    parser.add_argument("--num_gpus", type=int, required=True, help="devices (expert-parallel ranks) in all")
    parser.add_argument("--output_path", required=True, help="the map file to write (generate_config.expert_map_path)")
    return parser


def device_load_ratios(loads: np.ndarray, placement: list[list[int]]) -> float:
    """The heaviest device's load over the mean, each expert's load shared evenly by its copies."""
    copies = np.bincount([e for device in placement for e in device], minlength=len(loads))
    per_device = [sum(loads[e] / copies[e] for e in device) for device in placement]
    mean = float(np.mean(per_device))
    return max(per_device) / mean if mean > 0 else 1.0


def main(argv: list[str] | None = None) -> int:
    from mindspeed_rl.engines.eplb_counts import aggregate_counts
    from mindspeed_rl.errors import ConfigError
    from mindspeed_rl.planner.eplb_map_builder import EplbShape, build_placement
    from mindspeed_rl.planner.expert_map import write_expert_map

    args = _parser().parse_args(argv)
    try:
        shape = EplbShape(num_replicas=args.num_replicas, num_groups=args.num_groups, num_nodes=args.num_nodes,
                          num_gpus=args.num_gpus)
        loads = aggregate_counts(args.json_folder)
        placement = build_placement(loads, shape)
        expert_map = write_expert_map(args.output_path, placement)
    except (ValueError, OSError) as error:
        key = error.key if isinstance(error, ConfigError) else "eplb_generate_map_ds"
        message = error.message if isinstance(error, ConfigError) else str(error)
        print(f"config error: {key}: {message}", file=sys.stderr)
        return CONFIG_ERROR_EXIT_CODE
    experts, slots = loads.shape[1], shape.slots_per_gpu
    even = [[e for e in range(experts) if e * shape.num_gpus // experts == device] for device in range(shape.num_gpus)]
    print(f"[eplb] {loads.shape[0]} MoE layers x {experts} experts, {int(loads.sum())} token-to-expert routings "
          f"-> {shape.num_gpus} devices x {slots} experts ({shape.num_replicas - experts} redundant per layer)")
    for layer, devices in enumerate(placement):
        before = device_load_ratios(loads[layer].astype(float), even) if experts % shape.num_gpus == 0 else float("nan")
        print(f"[eplb] MoE layer {layer}: heaviest device / mean {before:.3f} evenly, "
              f"{device_load_ratios(loads[layer].astype(float), devices):.3f} with the map")
    print(f"[eplb] wrote {expert_map.path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
