"""Start checks on the model directories, the run directory and the device: each bad input is one ConfigError
naming the key and the file, raised before Ray starts (the CLI turns it into one line and exit 2)."""
import json
import shutil
import time
from pathlib import Path

import pytest
import torch
from hydra import compose, initialize_config_dir

from cli_runner import REPO, run_cli
from mindspeed_rl.config import ConfigError, load_config
from mindspeed_rl.trainer import setup

REF_KEY = "rl_config.integrated_mode_config.ref_model_load_path"


@pytest.fixture(scope="module")
def demo(tmp_path_factory) -> tuple[Path, Path]:
    """The arith demo's model dir and prompts (grpo_tiny_cpu's sizes), generated once for the module."""
    from mindspeed_rl.data.arith_task import ensure_demo_assets

    return ensure_demo_assets(tmp_path_factory.mktemp("demo"), vocab_size=16, hidden_size=128, ffn_hidden_size=256,
                              num_layers=2, num_attention_heads=4, num_query_groups=2, num_prompts=16,
                              max_operand=4, seed=1)


@pytest.fixture
def model(demo, tmp_path) -> Path:
    """A private copy of the demo's HF dir, free to damage."""
    return Path(shutil.copytree(demo[0], tmp_path / "model"))


def tiny_config(model_dir: Path, data_path: Path, *overrides: str):
    with initialize_config_dir(config_dir=str(REPO / "configs"), version_base="1.3"):
        cfg = compose(config_name="grpo_tiny_cpu", overrides=[
            "synthetic_data.enabled=false", f"megatron_training.tokenizer_name_or_path={model_dir}",
            f"megatron_training.data_path={data_path}", *overrides])
    return load_config(cfg)


def refusal(call, *args) -> ConfigError:
    with pytest.raises(ConfigError) as info:
        call(*args)
    return info.value


def _truncate(path: Path, size: int) -> None:
    with open(path, "r+b") as handle:
        handle.truncate(size)


# --- a. truncated or corrupt safetensors ---------------------------------------------------------

def test_an_intact_demo_model_passes(model, demo):
    config = tiny_config(model, demo[1])
    model_dir, ref_dir, data_path = setup.resolve_assets(config)
    assert model_dir == ref_dir == str(model)
    assert data_path == str(demo[1])


@pytest.mark.parametrize("damage", ["one byte short", "cut in the data", "cut in the header", "4 bytes left",
                                    "garbage header", "extra bytes"])
def test_a_damaged_safetensors_file_is_refused_naming_it(model, demo, damage):
    weights = model / "model.safetensors"
    size = weights.stat().st_size
    header_len = int.from_bytes(weights.read_bytes()[:8], "little")
    if damage == "one byte short":
        _truncate(weights, size - 1)
    elif damage == "cut in the data":
        _truncate(weights, 8 + header_len + (size - 8 - header_len) // 2)
    elif damage == "cut in the header":
        _truncate(weights, 8 + header_len // 2)
    elif damage == "4 bytes left":
        _truncate(weights, 4)
    elif damage == "garbage header":
        with open(weights, "r+b") as handle:
            handle.seek(8)
            handle.write(b"\xff" * 16)
    else:
        with open(weights, "ab") as handle:
            handle.write(b"\0" * 64)
    error = refusal(setup.resolve_assets, tiny_config(model, demo[1]))
    assert error.key == "megatron_training.tokenizer_name_or_path"
    assert str(weights) in error.message
    assert "truncated" in error.message or "corrupt" in error.message


def test_the_header_check_never_reads_the_tensor_data(model, monkeypatch):
    weights = model / "model.safetensors"
    header_len = int.from_bytes(weights.read_bytes()[:8], "little")
    reads = []
    real_open = open

    class CountingFile:
        def __init__(self, handle):
            self.handle = handle

        def read(self, size=-1):
            reads.append(size)
            return self.handle.read(size)

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            self.handle.close()

    monkeypatch.setattr("builtins.open", lambda path, mode="r", *a, **k: CountingFile(real_open(path, mode, *a, **k)))
    setup.check_safetensors_header(weights, "key")
    assert sum(reads) == 8 + header_len < weights.stat().st_size


def test_a_shard_named_by_the_index_must_exist(model, demo):
    (model / "model.safetensors").rename(model / "model-00001-of-00002.safetensors")
    (model / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": {
        "a.weight": "model-00001-of-00002.safetensors", "b.weight": "model-00002-of-00002.safetensors"}}))
    error = refusal(setup.resolve_assets, tiny_config(model, demo[1]))
    assert str(model / "model-00002-of-00002.safetensors") in error.message
    assert str(model / "model.safetensors.index.json") in error.message


def test_the_reference_dir_is_checked_too(model, demo, tmp_path):
    ref = Path(shutil.copytree(model, tmp_path / "ref"))
    _truncate(ref / "model.safetensors", 100)
    error = refusal(setup.resolve_assets, tiny_config(model, demo[1], f"{REF_KEY}={ref}"))
    assert error.key == REF_KEY
    assert str(ref / "model.safetensors") in error.message


# --- b. a Megatron checkpoint where an HF directory is expected ----------------------------------

def _megatron_checkpoint(root: Path, *, tracker: bool) -> Path:
    (root / "iter_0000100" / "mp_rank_00").mkdir(parents=True)
    (root / "iter_0000100" / "mp_rank_00" / "model_optim_rng.pt").write_bytes(b"\0" * 16)
    if tracker:
        (root / "latest_checkpointed_iteration.txt").write_text("100\n")
    return root


@pytest.mark.parametrize("key", ["megatron_training.tokenizer_name_or_path", "actor_config.load", REF_KEY])
@pytest.mark.parametrize("tracker", [True, False])
def test_a_megatron_checkpoint_is_refused_where_an_hf_dir_is_expected(model, demo, tmp_path, key, tracker):
    megatron = _megatron_checkpoint(tmp_path / "megatron", tracker=tracker)
    config = tiny_config(megatron if key.startswith("megatron") else model, demo[1],
                         *([f"{key}={megatron}"] if not key.startswith("megatron") else []))
    error = refusal(setup.resolve_assets, config)
    assert error.key == key
    assert f"{megatron} is a Megatron checkpoint" in error.message
    assert "an HF directory (config.json + *.safetensors) is expected" in error.message
    assert ("latest_checkpointed_iteration.txt" if tracker else "iter_0000100/mp_rank_00") in error.message


# --- c. config.json without weights --------------------------------------------------------------

def test_an_hf_dir_without_weights_is_refused_naming_it(model, demo):
    (model / "model.safetensors").unlink()
    error = refusal(setup.resolve_assets, tiny_config(model, demo[1]))
    assert error.message == f"{model} has config.json but no weights (*.safetensors or pytorch_model*.bin)"


# --- d. the run directory ------------------------------------------------------------------------

def test_a_run_dir_that_cannot_be_written_is_refused(model, demo, tmp_path):
    blocker = tmp_path / "a_file"
    blocker.write_text("")
    run_dir = blocker / "run"  # not creatable, even by root
    error = refusal(setup.check_host, tiny_config(model, demo[1]), run_dir)
    assert error.key == "hydra.run.dir"
    assert str(run_dir) in error.message


def test_a_writable_run_dir_passes_and_keeps_no_probe(model, demo, tmp_path):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    setup.check_host(tiny_config(model, demo[1]), run_dir)
    assert list(run_dir.iterdir()) == []


# --- e. max_model_len past the checkpoint's positions --------------------------------------------

def test_max_model_len_beyond_the_checkpoints_positions_names_its_config_json(model, demo):
    hf_path = model / "config.json"
    hf_config = json.loads(hf_path.read_text())
    hf_config["max_position_embeddings"] = 16  # grpo_tiny_cpu's max_model_len is 32
    hf_path.write_text(json.dumps(hf_config))
    config = tiny_config(model, demo[1])
    error = refusal(setup.check_against_checkpoint, config, setup.read_hf_config(str(model)), str(model))
    assert error.key == "generate_config.max_model_len"
    assert "max_position_embeddings=16" in error.message and "got 32" in error.message
    assert str(hf_path) in error.message


# --- f. the device asked for ---------------------------------------------------------------------

@pytest.mark.skipif(torch.cuda.is_available(), reason="this host has a CUDA device")
def test_cuda_asked_for_on_a_host_without_one(model, demo, tmp_path):
    started = time.perf_counter()
    error = refusal(setup.check_host, tiny_config(model, demo[1], "runtime.device=cuda"), tmp_path)
    assert time.perf_counter() - started < 10
    assert error.key == "runtime.device"
    assert "no CUDA device" in error.message


def test_npu_asked_for_on_a_host_without_torch_npu(model, demo, tmp_path):
    import importlib.util

    if importlib.util.find_spec("torch_npu") is not None:
        pytest.skip("torch_npu is installed here")
    error = refusal(setup.check_host, tiny_config(model, demo[1], "runtime.device=npu"), tmp_path)
    assert error.key == "runtime.device"
    assert "torch_npu is not installed" in error.message


def test_run_grpo_checks_the_host_before_anything_else(model, demo, tmp_path):
    from mindspeed_rl.trainer import run_grpo

    blocker = tmp_path / "a_file"
    blocker.write_text("")
    config = tiny_config(model, demo[1])
    error = refusal(lambda: run_grpo(config, run_dir=blocker / "run"))
    assert error.key == "hydra.run.dir"


# --- end to end: the CLI ---------------------------------------------------------------------------

def test_cli_refuses_a_truncated_model_file_in_one_line_before_ray(model, demo, tmp_path):
    weights = model / "model.safetensors"
    _truncate(weights, weights.stat().st_size // 2)
    started = time.perf_counter()
    done = run_cli(tmp_path, "grpo_tiny_cpu", "synthetic_data.enabled=false",
                   f"megatron_training.tokenizer_name_or_path={model}", f"megatron_training.data_path={demo[1]}",
                   timeout=120)
    elapsed = time.perf_counter() - started
    assert done.returncode == 2, done.stderr[-2000:]
    assert "Traceback" not in done.stderr
    assert done.stderr.strip().splitlines() == [
        f"config error: megatron_training.tokenizer_name_or_path: {weights} is truncated or corrupt: its header "
        f"places tensor data up to byte {_data_end(weights)} but the file holds "
        f"{weights.stat().st_size - 8 - _header_len(weights)} bytes of data"]
    assert "[init]" not in done.stdout and "ray" not in done.stdout.lower()
    assert elapsed < 30


def _header_len(path: Path) -> int:
    with open(path, "rb") as handle:
        return int.from_bytes(handle.read(8), "little")


def _data_end(path: Path) -> int:
    with open(path, "rb") as handle:
        header = json.loads(handle.read(8 + _header_len(path))[8:])
    return max(entry["data_offsets"][1] for name, entry in header.items() if name != "__metadata__")


def test_a_ray_address_where_no_head_answers_is_a_config_error_in_seconds():
    import socket
    import time

    from mindspeed_rl.trainer.setup import _check_reachable

    with socket.socket() as probe:  # a port nobody listens on
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    started = time.monotonic()
    with pytest.raises(ConfigError, match=rf"runtime.ray_address: no Ray head answers at 127.0.0.1:{port}"):
        _check_reachable(f"127.0.0.1:{port}")
    assert time.monotonic() - started < 10


def test_rays_own_ray_address_variable_names_the_cluster_when_runtime_ray_address_is_null(monkeypatch, demo):
    """Ray's RAY_ADDRESS (what `ray.init()` reads) is honoured where runtime.ray_address is null, and an address where
    no head answers is said naming it, in seconds, before Ray is asked to start anything."""
    import socket

    import ray

    from mindspeed_rl.trainer.setup import start_ray

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    monkeypatch.setenv("RAY_ADDRESS", f"127.0.0.1:{port}")
    config = tiny_config(*demo)
    assert config.runtime.ray_address is None and not ray.is_initialized()
    with pytest.raises(ConfigError, match=rf"^RAY_ADDRESS \(environment\): no Ray head answers at 127.0.0.1:{port}"):
        start_ray(config, "cpu", 1)
    assert not ray.is_initialized()
