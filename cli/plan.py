"""Plan a run's device memory before launching it:
``python cli/plan.py --config-name NAME [key=value ...] [--device-memory 64GiB] [--json FILE|-]
[--h2d-gbps 25] [--link-gbps 50] [--profile cpu|accelerator] [--search]``.

Composes the config exactly like ``cli/train_grpo.py`` (Hydra, the same overrides, ``load_config``), then prints,
per device and per phase, the bytes of every state group (train params, grads, optimizer states, reference,
inference weights, KV cache, activations), the peak phase, whether it fits ``--device-memory`` and, if not, which
offload flags, micro-batch sizes or layouts would; and for the switch the bytes each rank sends and receives
(the resharding plan itself) with times at the stated bandwidths. Starts no Ray, no vLLM, allocates no model.
``--search`` (with ``--device-memory``): the layouts, offload flags and micro-batch sizes that fit with a 10% margin,
fastest first by a time model calibrated on this machine (mindspeed_rl/planner/search.py), and one line
``overrides: key=value ...`` that applies the best.

Exit codes: 0 (also when the plan does not fit: the verdict is in the output); 2 on bad input, one line
``config error: <key>: <message>`` on stderr.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

CONFIG_ERROR_EXIT_CODE = 2
CONFIG_DIR = Path(__file__).resolve().parents[1] / "configs"


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):  # one line and exit 2, like every other bad input
        print(f"config error: arguments: {message}", file=sys.stderr)
        sys.exit(CONFIG_ERROR_EXIT_CODE)


def _parser() -> argparse.ArgumentParser:
    parser = _Parser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config-name", default=None, help="a YAML under configs/ (default: as cli/train_grpo.py)")
    parser.add_argument("--config-dir", default=None,
                        help="a folder of the user's YAMLs, searched before configs/ (as cli/train_grpo.py)")
    parser.add_argument("overrides", nargs="*", help="Hydra overrides, key=value")
    parser.add_argument("--device-memory", default=None, help="memory of one device, e.g. 64GiB or 80GB")
    parser.add_argument("--json", default=None, metavar="FILE",
                        help="write the plan as JSON to FILE (-: to stdout, instead of the table)")
    parser.add_argument("--h2d-gbps", type=float, default=25.0,
                        help="host <-> device copy bandwidth in GB/s (1e9 bytes/s); default %(default)s")
    parser.add_argument("--link-gbps", type=float, default=50.0,
                        help="device <-> device bandwidth per rank and direction in GB/s; default %(default)s")
    parser.add_argument("--profile", choices=("cpu", "accelerator"), default=None,
                        help="whose activations the update keeps: cpu = this engine's CPU path (unfused kernels, "
                             "measured); accelerator = the published per-layer count with fused RMSNorm/SwiGLU and "
                             "flash attention (Korthikanti et al. 2022, Table 2, adjusted for GQA and SwiGLU). "
                             "Default: accelerator with --device-memory when the recipe selects use_fused_rmsnorm and "
                             "use_fused_swiglu, cpu otherwise")
    parser.add_argument("--search", action="store_true",
                        help="with --device-memory: the fastest layouts that fit with a 10%% margin, and the overrides "
                             "of the best")
    parser.add_argument("--matmul-tflops", type=float, default=None,
                        help="--search's matmul rate of one device in TFLOP/s (default: measured on this machine)")
    parser.add_argument("--memory-gbps", type=float, default=None,
                        help="--search's memory bandwidth of one device in GB/s (default: measured on this machine)")
    return parser


def _compose(config_name: str, overrides: list[str], config_dir: str | None):
    from hydra import compose, initialize_config_dir
    from hydra.errors import HydraException
    from omegaconf.errors import OmegaConfBaseException

    from mindspeed_rl.config import ConfigError
    from mindspeed_rl.config.overrides import as_upsert, search_path_override

    overrides = [as_upsert(override) for override in overrides]
    if config_dir is not None:  # the user's files win over ours, as in cli/train_grpo.py
        overrides.append(search_path_override(str(CONFIG_DIR)))
    try:
        with initialize_config_dir(config_dir=os.path.abspath(config_dir or CONFIG_DIR), version_base="1.3"):
            return compose(config_name=config_name, overrides=overrides)
    except (HydraException, OmegaConfBaseException) as error:
        first = " ".join(line.strip() for line in str(error).splitlines()[:2]) or type(error).__name__
        raise ConfigError("--config-name" if "config" in first.lower() and "override" not in first.lower()
                          else "overrides", first) from None


def _search(cfg, arch, plan, args, device_memory: int | None) -> tuple[list[str], dict]:
    from mindspeed_rl.config import ConfigError
    from mindspeed_rl.planner.search import Rates, search_report

    if device_memory is None:
        raise ConfigError("--search", "needs --device-memory (what the layouts must fit)")
    links = dict(link_bytes_per_s=args.link_gbps * 1e9, h2d_bytes_per_s=args.h2d_gbps * 1e9)
    for name in ("matmul_tflops", "memory_gbps"):
        if getattr(args, name) is not None and not getattr(args, name) > 0:
            raise ConfigError(f"--{name.replace('_', '-')}", f"must be a positive figure, got {getattr(args, name)}")
    if args.matmul_tflops is not None and args.memory_gbps is not None:
        rates = Rates(matmul_flops_per_s=args.matmul_tflops * 1e12, memory_bytes_per_s=args.memory_gbps * 1e9, **links)
    elif args.matmul_tflops is None and args.memory_gbps is None:
        rates = Rates.of_this_machine(**links)
    else:
        raise ConfigError("--matmul-tflops", "give it with --memory-gbps (a device's two rates), or neither")
    return search_report(cfg, arch, plan, device_memory=device_memory, rates=rates, profile=args.profile)


def _emit(args, plan, report_args: dict, searched: tuple[list[str], dict] | None) -> None:
    """The table (and the search's lines) on stdout, or the JSON document on stdout or in --json's file."""
    from mindspeed_rl.planner.report import json_report, text_report

    if args.json is None:
        print(text_report(plan, **report_args))
        if searched:
            print("\n" + "\n".join(searched[0]))
        return
    document = json.dumps(json_report(plan, **report_args) | ({"search": searched[1]} if searched else {}), indent=2)
    if args.json == "-":
        print(document)
        return
    Path(args.json).write_text(document + "\n", encoding="utf-8")
    print(text_report(plan, **report_args))
    print(f"\nJSON written to {args.json}")


def _print_carried_samples(config, args) -> None:
    """Partial rollout's carried samples at most (host bytes, the re-prefill), below the table."""
    from mindspeed_rl.config.partial_rollout import carried_bound

    carried = carried_bound(config)
    if carried is not None and args.json is None:
        print(carried.line())


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_intermixed_args(argv)
    from mindspeed_rl.config import ConfigError, default_config_name, error_lines, load_config

    try:
        device_memory = None
        if args.device_memory is not None:
            from mindspeed_rl.sizes import parse_bytes

            try:
                device_memory = parse_bytes(args.device_memory)
            except ValueError as error:
                raise ConfigError("--device-memory", str(error)) from None
        for name in ("h2d_gbps", "link_gbps"):
            if not getattr(args, name) > 0:
                raise ConfigError(f"--{name.replace('_', '-')}", f"must be a positive GB/s figure, got {getattr(args, name)}")
        cfg = _compose(args.config_name or default_config_name(), args.overrides, args.config_dir)
        notices: list[str] = []
        config = load_config(cfg, notices=notices)
        if notices:
            from mindspeed_rl.config.no_effect import no_effect_notice

            print(no_effect_notice(notices), file=sys.stderr)
        from mindspeed_rl.config.tolerated import warning_lines

        for line in warning_lines(config):
            print(line, file=sys.stderr)
        expert_map = config.generate_config.expert_map_path
        if expert_map and not Path(expert_map).exists():
            print(f"[plan] note: generate_config.expert_map_path: {expert_map} is not here (EPLB's map is made from "
                  "the user's own rollouts, MindSpeed-RL's cli/eplb_generate_map_ds.py): planned with each device's "
                  "even share of the experts; with the map, its redundant copies add to the inference weights (a run "
                  "needs the file)", file=sys.stderr)

        from mindspeed_rl.planner.from_config import architecture, plan_config, resolve_hf_config, suggest

        source = resolve_hf_config(config)
        arch = architecture(source)
        link, h2d = args.link_gbps * 1e9, args.h2d_gbps * 1e9
        try:
            plan, switch = plan_config(config, arch, device_memory=device_memory, link_bytes_per_second=link,
                                       profile=args.profile)
        except ConfigError:
            raise  # a ConfigError is a ValueError: it names its own key (generate_config.expert_map_path)
        except ValueError as error:
            raise ConfigError("actor_config", str(error)) from None
        suggestions = None
        if device_memory is not None and plan.fits() is False:
            suggestions = suggest(cfg, arch, device_memory=device_memory, profile=args.profile)
        report_args = dict(model_name=config.actor_config.model, source=source.source, switch=switch,
                           suggestions=suggestions, h2d_bytes_per_second=h2d, link_bytes_per_second=link)
        _emit(args, plan, report_args, _search(cfg, arch, plan, args, device_memory) if args.search else None)
        _print_carried_samples(config, args)
    except ConfigError as error:
        print("\n".join(error_lines(error)), file=sys.stderr)
        return CONFIG_ERROR_EXIT_CODE
    return 0


if __name__ == "__main__":
    sys.exit(main())
