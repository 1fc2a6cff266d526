"""Everything the GRPO loop needs before its first iteration: assets, checks, Ray, the memory prediction. Every check
that can fail on user input runs here, before any worker starts, and raises a ConfigError naming the key or file (the
CLI prints one line and exits 2)."""
from __future__ import annotations

import copy
import json
import os
from pathlib import Path

from mindspeed_rl.checkpoint.store import is_checkpoint_dir
from mindspeed_rl.config import ConfigError, GRPOConfig

MODEL_DIR_KEY = "megatron_training.tokenizer_name_or_path"
DATA_PATH_KEY = "megatron_training.data_path"
REF_DIR_KEY = "rl_config.integrated_mode_config.ref_model_load_path"
RUN_DIR_KEY = "hydra.run.dir"
SAVE_DIR_KEY = "actor_config.save"
SAFETENSORS_INDEX = "model.safetensors.index.json"


def resolve_assets(config: GRPOConfig) -> tuple[str, str, str]:
    """(model_dir, ref_model_dir, data_path); generates the demo's assets on first use."""
    mt = config.megatron_training
    model_dir, data_path = mt.tokenizer_name_or_path, mt.data_path
    synthetic = config.synthetic_data
    if synthetic is not None and synthetic.enabled:
        made_model, made_data = _generate_synthetic_assets(synthetic)
        model_dir, data_path = str(made_model), str(made_data)
    # actor_config.load as one of our checkpoints: the engines are built from the initial HF weights and
    # the checkpoint is loaded over them (grpo_trainer); as an HF dir it is the initial weights.
    hf_load = config.actor_config.load if config.actor_config.load and not is_checkpoint_dir(config.actor_config.load) else None
    model_key = "actor_config.load" if hf_load else MODEL_DIR_KEY
    model_dir = hf_load or model_dir
    check_hf_model_dir(model_dir, model_key)
    if not Path(data_path).exists():
        raise ConfigError(DATA_PATH_KEY, f"{data_path} does not exist")
    if config.generate_config.expert_map_path:
        # vLLM here places experts evenly, but a map that would not load in MindSpeed-RL's stack (whose engine fails
        # at start without it) is refused here too, as the planner refuses it.
        from mindspeed_rl.planner.expert_map import read_expert_map

        read_expert_map(config.generate_config.expert_map_path)
    ref_dir = config.rl_config.integrated_mode_config.ref_model_load_path or model_dir
    if is_checkpoint_dir(ref_dir):
        # The reference is built from the initial HF weights, then one of our checkpoints is loaded over
        # it (reference_checkpoint); it has the actor's architecture, which find_resume_point-style checks hold.
        ref_dir = model_dir
    if ref_dir != model_dir:
        check_hf_model_dir(ref_dir, REF_DIR_KEY)
    critic = config.critic_config
    if critic is not None and critic.load and not is_checkpoint_dir(critic.load):
        check_hf_model_dir(critic.load, "critic_config.load")  # an HF reward model or causal LM
    return os.path.abspath(model_dir), os.path.abspath(ref_dir), os.path.abspath(data_path)


def reference_checkpoint(config: GRPOConfig, hf_config: dict) -> Path | None:
    """The verified checkpoint `ref_model_load_path` names when it is one of ours (not an HF dir), else None."""
    from mindspeed_rl.checkpoint.trainer_state import verify_same_model

    path = config.rl_config.integrated_mode_config.ref_model_load_path
    if not path or not is_checkpoint_dir(path) or not config.uses_reference or config.reference_is_backbone:
        return None
    return verify_same_model(path, hf_config, key=REF_DIR_KEY)


def check_hf_model_dir(model_dir: str, key: str) -> None:
    """`model_dir` must be an HF directory whose weights are whole: the engines load it inside the workers,
    where a missing or cut-off file would surface as a worker traceback after minutes of start-up."""
    directory = Path(model_dir)
    if not directory.exists():
        raise ConfigError(key, f"{directory} does not exist")
    marker = _megatron_marker(directory)
    if marker is not None:
        raise ConfigError(key, f"{directory} is a Megatron checkpoint ({marker}); an HF directory (config.json + "
                               "*.safetensors) is expected: give the HF model it was converted from")
    if not (directory / "config.json").is_file():
        raise ConfigError(key, f"{directory} is not an HF model directory (no config.json)")
    shards = sorted(directory.glob("*.safetensors"))
    if not shards and not any(directory.glob("pytorch_model*.bin")):
        raise ConfigError(key, f"{directory} has config.json but no weights (*.safetensors or pytorch_model*.bin)")
    _check_safetensors_index(directory, key)
    for shard in shards:
        check_safetensors_header(shard, key)


def _megatron_marker(directory: Path) -> str | None:
    """What shows `directory` is a Megatron/MindSpeed-RL checkpoint, or None."""
    if (directory / "latest_checkpointed_iteration.txt").is_file():
        return "it has latest_checkpointed_iteration.txt"
    for pattern in ("iter_*/mp_rank_*", "release/mp_rank_*"):
        rank_dirs = sorted(directory.glob(pattern))
        if rank_dirs:
            return f"it has {rank_dirs[0].relative_to(directory)}"
    return None


def _check_safetensors_index(directory: Path, key: str) -> None:
    index = directory / SAFETENSORS_INDEX
    if not index.is_file():
        return
    try:
        weight_map = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
        shards = sorted({directory / name for name in weight_map.values()})
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as error:
        raise ConfigError(key, f"{index}: not a safetensors index (JSON with a weight_map) ({error})") from None
    for shard in shards:
        if not shard.is_file():
            raise ConfigError(key, f"{shard} is missing: {index} names it as a weight shard")


def check_safetensors_header(path: Path, key: str) -> None:
    """Reads only the header: the tensors of a 7B model are 15 GB. A file cut short (a copy or download that
    stopped) no longer holds the bytes its header promises."""
    size = path.stat().st_size
    if size < 8:
        raise ConfigError(key, f"{path} is truncated: {size} bytes, shorter than the 8-byte header length")
    with open(path, "rb") as handle:
        header_len = int.from_bytes(handle.read(8), "little")
        if 8 + header_len > size:
            raise ConfigError(key, f"{path} is truncated or corrupt: its header length says {header_len} bytes "
                                   f"but the file has only {size} bytes")
        end = _tensors_end(handle.read(header_len))
    if end is None:
        raise ConfigError(key, f"{path} is corrupt: its header is not safetensors JSON")
    data_size = size - 8 - header_len
    if end != data_size:
        raise ConfigError(key, f"{path} is truncated or corrupt: its header places tensor data up to byte {end} "
                               f"but the file holds {data_size} bytes of data")


def _tensors_end(raw: bytes) -> int | None:
    """The largest data_offsets end in a safetensors header, or None if it is not one."""
    try:
        header = json.loads(raw)
        ends = [entry["data_offsets"][1] for name, entry in header.items() if name != "__metadata__"]
    except (ValueError, KeyError, TypeError, IndexError, AttributeError):
        return None
    return max(ends, default=0) if all(isinstance(end, int) for end in ends) else None


def resolve_eval_data_path(config: GRPOConfig) -> str | None:
    """megatron_training.eval_data_path, or with a generated task and evaluation on, its evaluation split (math_word:
    held-out problems; arith and tool_call: each problem of the task once, as none is held out of training)."""
    mt, synthetic, rl = config.megatron_training, config.synthetic_data, config.rl_config
    if mt.eval_data_path is not None:
        if not Path(mt.eval_data_path).exists():
            raise ConfigError("megatron_training.eval_data_path", f"{mt.eval_data_path} does not exist")
        return mt.eval_data_path
    if not (rl.eval_interval or rl.eval_before_train):
        return None
    from mindspeed_rl.data import arith_task, tiny_math, tiny_tool_call

    eval_file = {"math_word": tiny_math.EVAL_FILE, "tool_call": tiny_tool_call.EVAL_FILE,
                 "search_call": tiny_tool_call.EVAL_FILE}.get(synthetic.task, arith_task.EVAL_FILE)
    return str(_generate_synthetic_assets(synthetic)[1].with_name(eval_file))  # checked in GRPOConfig: generated


def _generate_synthetic_assets(synthetic) -> tuple[Path, Path]:
    sizes = dict(hidden_size=synthetic.hidden_size, ffn_hidden_size=synthetic.ffn_hidden_size,
                 num_layers=synthetic.num_layers, num_attention_heads=synthetic.num_attention_heads,
                 num_query_groups=synthetic.num_query_groups, num_prompts=synthetic.num_prompts,
                 max_operand=synthetic.max_operand, seed=synthetic.seed)
    if synthetic.task == "math_word":
        from mindspeed_rl.data.tiny_math import ensure_tiny_math_assets

        return ensure_tiny_math_assets(synthetic.data_dir, **sizes)
    if synthetic.task in ("tool_call", "search_call"):  # its questions and answer are fixed (max_operand unused)
        from mindspeed_rl.data.tiny_tool_call import ensure_tool_call_assets

        return ensure_tool_call_assets(synthetic.data_dir, task=synthetic.task,
                                       **{k: v for k, v in sizes.items() if k != "max_operand"})
    from mindspeed_rl.data.arith_task import ensure_demo_assets

    experts = dict(num_experts=synthetic.num_experts, moe_router_topk=synthetic.moe_router_topk,
                   moe_ffn_hidden_size=synthetic.moe_ffn_hidden_size)  # num_experts 0: the dense Qwen2
    return ensure_demo_assets(synthetic.data_dir, vocab_size=synthetic.vocab_size, **sizes, **experts)


def read_hf_config(model_dir: str) -> dict:
    path = Path(model_dir) / "config.json"
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as error:
        raise ConfigError(MODEL_DIR_KEY, f"{path}: not a readable JSON config ({error})") from None


def check_against_checkpoint(config: GRPOConfig, hf_config: dict, model_dir: str) -> None:
    """The checkpoint's config.json is what the engines build. A model block that describes another
    model is reported in one line; the parallel layout is then re-checked against the checkpoint's
    real architecture, so a layout that cannot shard it fails here and not inside a worker."""
    from mindspeed_rl.config.model_arch import ModelArchConfig
    from mindspeed_rl.config.model_check import check_model_block_against_hf, expert_count_key

    name = config.actor_config.model
    arch = config.selected_model
    if arch is not None:
        try:
            check_model_block_against_hf(arch, f"model.{name}", hf_config)
        except ConfigError as mismatch:
            print(f"[model] warning: {mismatch} (from {model_dir}/config.json); the checkpoint's architecture "
                  "is built and the parallel layout is checked against it", flush=True)
    if hf_config.get("num_nextn_predict_layers"):
        print(f"[model] DeepSeek-V3's multi-token prediction module ({hf_config['num_nextn_predict_layers']} layer(s) "
              "in config.json) is not trained, pushed or exported: RL trains the main model, as MindSpeed-RL does; "
              "its weights are not read and an export writes num_nextn_predict_layers: 0", flush=True)
    checkpoint_arch = ModelArchConfig(
        num_layers=hf_config["num_hidden_layers"], hidden_size=hf_config["hidden_size"],
        ffn_hidden_size=hf_config["intermediate_size"], num_attention_heads=hf_config["num_attention_heads"],
        group_query_attention=True,
        num_query_groups=hf_config.get("num_key_value_heads", hf_config["num_attention_heads"]),
        kv_channels=hf_config.get("head_dim"),
        num_experts=hf_config.get(expert_count_key(hf_config) or "num_experts") or None,
        max_position_embeddings=hf_config.get("max_position_embeddings"),
    )
    # Every layout and length check again (max_model_len against max_position_embeddings too), now on the
    # checkpoint's numbers, so the message names where they come from. Only those: the synthetic_data sizes
    # describe the generated checkpoint, which actor_config.load may have replaced.
    checked = copy.copy(config)
    checked.model = {**config.model, name: checkpoint_arch}
    try:
        checkpoint_arch.check(f"model.{name}")
        checked.check_layout()
    except ConfigError as error:
        raise ConfigError(error.key, f"{error.message} (model.{name} as built: the checkpoint's architecture from "
                                     f"{Path(model_dir) / 'config.json'})") from None


def check_tokenizer_fits_model(tokenizer, hf_config: dict, model_dir: str) -> None:
    vocab_size = hf_config.get("vocab_size")
    if vocab_size is not None and len(tokenizer) > vocab_size:
        raise ConfigError(MODEL_DIR_KEY, f"the tokenizer in {model_dir} has {len(tokenizer)} tokens but the model's "
                                         f"vocab_size is {vocab_size}: token ids past it have no embedding row")


def check_host_capacity(config: GRPOConfig, device: str, cpu_count: int) -> None:
    """On CPU every rank is a process; beyond a few per core the run makes no progress, so say so
    at start instead of letting Ray queue the ranks or the host swap."""
    if device != "cpu":
        return
    limit = config.runtime.max_ranks_per_cpu_core * cpu_count
    if config.num_rank_processes > limit:
        raise ConfigError(
            "rl_config.actor_resource.num_npus",
            f"{config.num_rank_processes} ranks on runtime.device=cpu, but this host has {cpu_count} CPU cores and "
            f"runtime.max_ranks_per_cpu_core={config.runtime.max_ranks_per_cpu_core} allows {limit}: lower "
            "num_npus (and the parallel sizes with it) or run on the accelerators the config was written for",
        )


def check_host(config: GRPOConfig, run_dir: Path) -> None:
    """What this host must offer before anything is read or started: the device asked for, a writable run dir."""
    from mindspeed_rl.accelerator import missing_device

    reason = missing_device(config.runtime.device)
    if reason is not None:
        raise ConfigError("runtime.device", f"{config.runtime.device} was asked for, but {reason}; use "
                                            "runtime.device=cpu or auto, or run on a host that has the device")
    check_run_dir_writable(run_dir)


def check_run_dir_writable(run_dir: Path) -> None:
    # A probe file, not os.access: root passes os.access on a read-only mount, and only a real create
    # sees a full or read-only filesystem. Metrics and checkpoints are written after hours of work.
    probe = Path(run_dir) / f".write_probe_{os.getpid()}"
    try:
        probe.open("x").close()
        probe.unlink()
    except OSError as error:
        raise ConfigError(RUN_DIR_KEY, f"{run_dir} is not a writable directory ({error.strerror or error}); "
                                       "metrics.jsonl and the plots go there: choose another run directory") from None


def hold_run_directories(config: GRPOConfig, run_dir: Path, held) -> None:
    """Hold the run directory (metrics.jsonl, plots) and the save directory for this run (`held`, an
    ExitStack, lets go): two runs writing one of them would interleave their records or remove each other's
    checkpoint staging."""
    from mindspeed_rl.locks import hold_directory

    held.enter_context(hold_directory(run_dir, key=RUN_DIR_KEY))
    save = config.actor_config.save
    if save and Path(save).resolve() != Path(run_dir).resolve():
        held.enter_context(hold_directory(Path(save), key=SAVE_DIR_KEY))


def start_ray(config: GRPOConfig, device: str, threads_per_rank: int, *, attempts: int = 2) -> None:
    import ray

    if ray.is_initialized():
        return
    # The raylet waits for its Python agents; on a small, busy host they can take longer to start
    # than Ray's default allows, which fails the whole start ("node timed out during startup").
    os.environ.setdefault("RAY_agent_register_timeout_ms", "120000")
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    # A failed rank is reported once, by the driver's watchdog; Ray would print every other rank's
    # abandoned result again as an "unhandled error".
    os.environ.setdefault("RAY_IGNORE_UNHANDLED_ERRORS", "1")
    # Ray 2.54 warns on every start that it will stop overriding CUDA_VISIBLE_DEVICES for CPU-only
    # actors; opting in now changes nothing for the ranks (each asks for its device) and ends the warning.
    os.environ.setdefault("RAY_ACCEL_ENV_VAR_OVERRIDE_ON_ZERO", "0")
    # Ray prestarts idle workers for the driver's default runtime env, which no rank uses (each asks
    # for its own): one stayed for the whole demo, 122 MiB and ~1 CPU-s of start-up (docs/overhead.md, 6).
    os.environ.setdefault("RAY_prestart_worker_first_driver", "0")
    common = dict(log_to_driver=True, configure_logging=False, runtime_env={"env_vars": {"PYTHONWARNINGS": "ignore"}})
    # A cluster started with `ray start --head` / `ray start --address=HEAD:6379` on each node: runtime.ray_address,
    # else Ray's own RAY_ADDRESS variable, which `ray.init()` reads as Ray's tools do (a run that needs no Ray, one
    # rank in this process, does not join it).
    address, key = (config.runtime.ray_address, "runtime.ray_address") if config.runtime.ray_address else (
        os.environ.get("RAY_ADDRESS"), "RAY_ADDRESS (environment)")
    if address:
        _check_reachable(address, key=key)
        try:
            ray.init(address=address, **common)
        except (ConnectionError, RuntimeError) as error:
            raise ConfigError(key, f"cannot join the Ray cluster at {address}: {str(error).splitlines()[0]}") from None
        return
    for attempt in range(1, attempts + 1):
        try:
            # Logical CPUs: one per rank at least, whatever the host has (ranks are mostly idle
            # while another role runs; threads are capped separately).
            ray.init(num_cpus=max(config.num_rank_processes, os.cpu_count() or 1), include_dashboard=False, **common)
            return
        except Exception as error:  # Ray raises a bare Exception for a failed node start
            ray.shutdown()
            if attempt == attempts:
                raise
            print(f"[ray] start failed ({error}); retrying", flush=True)


def _check_reachable(address: str, timeout_seconds: float = 10.0, *, key: str = "runtime.ray_address") -> None:
    """Ray retries an unreachable head for minutes; a wrong address is said in seconds instead."""
    import socket

    if address == "auto" or ":" not in address:
        return  # Ray finds the local cluster (or says there is none) by itself
    host, _, port = address.rpartition(":")
    try:
        with socket.create_connection((host, int(port)), timeout=timeout_seconds):
            return
    except (OSError, ValueError) as error:
        raise ConfigError(key, f"no Ray head answers at {address} ({error}); start one with `ray start --head` and "
                               "give its address (or auto)") from None


def threads_per_rank(config: GRPOConfig) -> int:
    if config.runtime.num_threads_per_rank > 0:
        return config.runtime.num_threads_per_rank
    return max(1, (os.cpu_count() or 1) // config.num_rank_processes)


def check_run_dir_metrics(metrics_path: Path, *, resume_iteration: int) -> None:
    """A run directory whose metrics.jsonl already has records: resume (records after the checkpoint's
    iteration are dropped then) or refuse; never append duplicate iteration numbers."""
    if resume_iteration == 0 and metrics_path.is_file() and metrics_path.stat().st_size > 0:
        raise ConfigError(RUN_DIR_KEY, f"{metrics_path} already has records; resume with "
                                       "actor_config.load=<save dir> actor_config.finetune=false, "
                                       "or choose another run directory")


def memory_prediction(config: GRPOConfig, hf_config: dict, device: str | None = None, *, quiet: bool = False):
    """The planner's MemoryPlan of this run (cli/plan.py), printed as one line per phase; None (said in one
    line) when the planner cannot size the model."""
    from mindspeed_rl.accelerator import detect_device
    from mindspeed_rl.config.partial_rollout import carried_bound
    from mindspeed_rl.planner.from_config import predict_run
    from mindspeed_rl.sizes import format_bytes

    device = device or (detect_device() if config.runtime.device == "auto" else config.runtime.device)
    try:
        plan = predict_run(config, hf_config, device=device)
    except (ConfigError, ValueError) as error:
        if not quiet:
            print(f"[plan] no memory prediction: {error}", flush=True)
        return None
    if not quiet:
        table, totals = plan.table(plan.ledger_phases), plan.totals(plan.ledger_phases)
        for phase in plan.ledger_phases:
            parts = ", ".join(f"{k} {format_bytes(v)}" for k, v in table[phase].items() if v)
            where = f" at {plan.inputs.padded_seq_length} tokens per sequence" if phase == "update" else ""
            print(f"[plan] {phase}: {format_bytes(totals[phase][1])} per device predicted{where} ({parts})", flush=True)
        if config.runtime.device_memory_limit_bytes is not None:
            print(capacity_verdict(plan, config.runtime.device_memory_limit_bytes), flush=True)
        carried = carried_bound(config)
        if carried is not None:
            print(carried.line(), flush=True)
    return plan


def capacity_verdict(plan, capacity_bytes: int) -> str:
    """One line: whether the run fits runtime.device_memory_limit, or the first phase that will not."""
    from mindspeed_rl.sizes import format_bytes

    head = f"[plan] runtime.device_memory_limit {format_bytes(capacity_bytes)}:"
    over = plan.first_over(capacity_bytes)
    if over is None:
        phase, rank, peak = plan.peak()
        return f"{head} fits (peak {format_bytes(peak)} in {phase} on rank {rank})"
    phase, rank, total = over
    return f"{head} does not fit: {phase} needs {format_bytes(total)} on rank {rank}, the first phase over"
