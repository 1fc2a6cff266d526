"""Config: real Hydra composition of the shipped YAMLs, load_config's messages, and the CLI's exit codes."""

import os
import pickle
import subprocess
import sys
from dataclasses import fields, is_dataclass
from pathlib import Path
from typing import Sequence

import pytest
from hydra import compose, initialize_config_dir
from hydra.core.config_store import ConfigStore
from omegaconf import DictConfig, OmegaConf

from mindspeed_rl.config import (
    ACCELERATOR_CONFIG_NAME,
    CPU_CONFIG_NAME,
    SCHEMA_NAME,
    ConfigError,
    GRPOConfig,
    SamplingConfig,
    default_config_name,
    load_config,
    register_configs,
)
from mindspeed_rl.config import loader

REPO_ROOT = Path(__file__).resolve().parents[1]
CONFIG_DIR = REPO_ROOT / "configs"
CLI = REPO_ROOT / "cli" / "train_grpo.py"
QWEN_7B = "grpo_qwen25_7b_A3"
TINY = "grpo_tiny_cpu"


def compose_cfg(config_name: str, overrides: Sequence[str] = ()) -> DictConfig:
    with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base="1.3"):
        return compose(config_name=config_name, overrides=list(overrides))


def load(config_name: str, *overrides: str) -> GRPOConfig:
    return load_config(compose_cfg(config_name, overrides))


def config_error(config_name: str, *overrides: str) -> str:
    with pytest.raises(ConfigError) as info:
        load(config_name, *overrides)
    return str(info.value)


def run_cli(tmp_path: Path, *args: str) -> subprocess.CompletedProcess:
    env = {key: value for key, value in os.environ.items() if key != "HYDRA_FULL_ERROR"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO_ROOT), env.get("PYTHONPATH")]))
    # cwd=tmp_path keeps Hydra's outputs/ out of the repository.
    return subprocess.run(
        [sys.executable, str(CLI), *args], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120
    )


# --- the shipped configs -------------------------------------------------------------------------


def test_qwen25_7b_recipe_loads_with_mindspeed_rl_values() -> None:
    config = load(QWEN_7B)
    assert (config.world_size, config.train_data_parallel_size, config.infer_data_parallel_size) == (16, 4, 16)
    assert (config.actor_config.tensor_model_parallel_size, config.actor_config.pipeline_model_parallel_size) == (2, 2)
    assert config.generate_config.infer_tensor_parallel_size == 1
    assert config.rl_config.mini_batch_size == 32  # as written: prompts, not mutated
    assert config.rl_config.mini_batch_size_in_samples == 256
    assert config.megatron_training.bf16 is True
    assert config.megatron_training.dataset_additional_keys == ["labels"]
    assert config.megatron_training.split == "100,0,0"
    assert config.actor_config.lr == pytest.approx(1e-6)
    assert config.generate_config.dtype == "bfloat16"
    assert config.generate_config.gpu_memory_utilization == pytest.approx(0.4)
    assert config.generate_config.sampling_config.max_tokens == 2048
    assert config.generate_config.sampling_config.top_k == -1
    assert config.rl_config.verifier_function == ["math_17k_acc"]
    assert config.rl_config.integrated_mode_config.ref_model_load_path is None
    assert config.runtime.device == "npu"
    assert config.synthetic_data is None
    arch = config.selected_model
    assert arch is config.model["qwen25_7b"]
    assert (arch.num_layers, arch.hidden_size, arch.ffn_hidden_size) == (28, 3584, 18944)
    assert (arch.num_attention_heads, arch.num_query_groups, arch.num_key_value_heads) == (28, 4, 4)
    assert (arch.padded_vocab_size, arch.max_position_embeddings) == (152064, 32768)
    assert arch.rotary_base == pytest.approx(1e6) and arch.norm_epsilon == pytest.approx(1e-6)
    assert arch.untie_embeddings_and_output_weights and arch.add_qkv_bias and arch.swiglu
    assert arch.normalization == "RMSNorm"


def test_tiny_cpu_demo_loads() -> None:
    config = load(TINY)
    assert (config.world_size, config.train_data_parallel_size, config.infer_data_parallel_size) == (1, 1, 1)
    assert config.megatron_training.bf16 is False and config.generate_config.dtype == "float32"
    assert config.megatron_training.global_batch_size * config.rl_config.n_samples_per_prompt == 256
    assert config.rl_config.mini_batch_size_in_samples == 128
    assert config.rl_config.kl_penalty == "low_var_kl"
    assert config.generate_config.cpu_kvcache_space_gb == pytest.approx(0.125)
    assert config.runtime.device == "cpu"
    synthetic = config.synthetic_data
    assert synthetic is not None and synthetic.enabled and synthetic.data_dir == "data/tiny"
    arch = config.selected_model
    assert arch is not None
    assert (arch.hidden_size, arch.ffn_hidden_size, arch.num_layers) == (128, 256, 2)
    assert (arch.num_attention_heads, arch.num_key_value_heads, arch.padded_vocab_size) == (4, 2, 16)


def _schema_keys(cls: type, prefix: str = "") -> set[str]:
    """Every dotted key of the schema, nested sections included (the `model` mapping is open-ended)."""
    keys = set()
    for f in fields(cls):
        key = f"{prefix}{f.name}"
        keys.add(key)
        field_type = loader._strip_optional(loader._schema_type_at(key))
        if is_dataclass(field_type):
            keys |= _schema_keys(field_type, f"{key}.")
    return keys


def test_tiny_yaml_lists_every_key_so_plain_overrides_work() -> None:
    # Hydra only accepts `key=value` for keys present in the YAML (others need `+key=value`).
    cfg = compose_cfg(TINY)
    absent = "<absent>"
    missing = [key for key in sorted(_schema_keys(GRPOConfig)) if OmegaConf.select(cfg, key, default=absent) == absent]
    assert missing == []


def test_yamls_do_not_use_the_hydra_schema() -> None:
    for path in [*CONFIG_DIR.glob("*.yaml"), *CONFIG_DIR.glob("model/*.yaml")]:
        assert SCHEMA_NAME not in path.read_text(), path


def test_register_configs_stores_the_schema() -> None:
    register_configs()
    stored = ConfigStore.instance().load(f"{SCHEMA_NAME}.yaml")
    assert OmegaConf.get_type(stored.node) is GRPOConfig


def test_default_config_name_follows_the_accelerator(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(loader, "_accelerator_present", lambda: False)
    assert default_config_name() == CPU_CONFIG_NAME == TINY
    monkeypatch.setattr(loader, "_accelerator_present", lambda: True)
    assert default_config_name() == ACCELERATOR_CONFIG_NAME == QWEN_7B


def test_load_config_accepts_a_plain_mapping() -> None:
    container = OmegaConf.to_container(compose_cfg(TINY))
    assert isinstance(container, dict)
    assert load_config(container).rl_config.n_samples_per_prompt == 16


# --- schema errors: unknown keys, types, missing values --------------------------------------------


def test_unknown_key_names_the_key_and_the_valid_ones() -> None:
    message = config_error(QWEN_7B, "+rl_config.foo=1")
    assert message.startswith("rl_config.foo: unknown key (valid keys of rl_config: guarantee_order, ")
    assert "mini_batch_size" in message and "actor_resource" in message


def test_unknown_key_in_a_model_block() -> None:
    message = config_error(QWEN_7B, "+model.qwen25_7b.num_heads=28")
    assert message.startswith("model.qwen25_7b.num_heads: unknown key (valid keys of model.qwen25_7b: ")
    assert "num_attention_heads" in message


def test_unknown_top_level_key() -> None:
    message = config_error(TINY, "+trainer.lr=1")
    assert message == (
        "trainer: unknown key (valid top-level keys: megatron_training, actor_config, rl_config, "
        "generate_config, model, synthetic_data, runtime)"
    )


@pytest.mark.parametrize("section", ["ref_config", "reward_config"])
def test_separate_role_sections_are_rejected_as_integrated_mode(section: str) -> None:
    message = config_error(QWEN_7B, f"+{section}.micro_batch_size=1")
    assert message.startswith(f"{section}: not supported: in integrated mode")
    assert "reuse actor_config" in message


def test_wrong_type_names_the_key_and_the_expected_type() -> None:
    message = config_error(QWEN_7B, "actor_config.tensor_model_parallel_size=abc")
    assert message == "actor_config.tensor_model_parallel_size: expected int, got 'abc' (str)"


def test_wrong_list_element_type() -> None:
    message = config_error(QWEN_7B, "rl_config.verifier_weight=[heavy]")
    assert message == "rl_config.verifier_weight[0]: expected float, got 'heavy' (str)"


def test_missing_section_and_missing_value() -> None:
    assert config_error(QWEN_7B, "~generate_config") == (
        "generate_config: missing required value (expected a mapping (GenerateConfig))"
    )
    assert config_error(QWEN_7B, "~actor_config.lr") == "actor_config.lr: missing required value (expected float)"


# --- section checks ------------------------------------------------------------------------------


def test_bad_kl_penalty() -> None:
    assert config_error(QWEN_7B, "rl_config.kl_penalty=bogus") == (
        "rl_config.kl_penalty: must be one of kl, abs, mse, low_var_kl, got 'bogus'"
    )


def test_infer_pipeline_parallel_must_be_one() -> None:
    message = config_error(QWEN_7B, "generate_config.infer_pipeline_parallel_size=2")
    assert message.startswith("generate_config.infer_pipeline_parallel_size: must be 1")
    assert "vLLM pipeline parallelism is not supported in the hybrid engine, got 2" in message


def test_verifier_weights_need_one_per_function() -> None:
    message = config_error(QWEN_7B, "rl_config.verifier_weight=[1.0,0.5]")
    assert message.startswith("rl_config.verifier_weight: must have one weight per verifier_function entry")
    assert "got 2: [1.0, 0.5]" in message


def test_temperature_must_be_positive_also_when_built_in_python() -> None:
    with pytest.raises(ConfigError) as info:
        SamplingConfig(temperature=0.0)
    assert info.value.key == "generate_config.sampling_config.temperature"
    assert str(info.value).endswith("got 0.0")


def test_config_error_survives_pickling() -> None:
    error = pickle.loads(pickle.dumps(ConfigError("a.b", "must be > 0, got -1")))
    assert (error.key, error.message, str(error)) == ("a.b", "must be > 0, got -1", "a.b: must be > 0, got -1")


# --- cross-section checks ------------------------------------------------------------------------


def test_tensor_parallel_must_divide_world() -> None:
    assert config_error(QWEN_7B, "actor_config.tensor_model_parallel_size=3") == (
        "actor_config.tensor_model_parallel_size: must divide rl_config.actor_resource.num_npus=16, got 3"
    )


def test_tensor_times_pipeline_must_divide_world() -> None:
    message = config_error(QWEN_7B, "actor_config.pipeline_model_parallel_size=3")
    assert message.startswith("actor_config.pipeline_model_parallel_size: ")
    assert "2 * 3 = 6 must divide rl_config.actor_resource.num_npus=16" in message


def test_attention_heads_must_divide_by_train_tp() -> None:
    overrides = ("actor_config.tensor_model_parallel_size=8", "actor_config.pipeline_model_parallel_size=1")
    assert config_error(QWEN_7B, *overrides) == (
        "actor_config.tensor_model_parallel_size: must divide model.qwen25_7b.num_attention_heads=28, got 8"
    )


def test_query_groups_must_divide_by_train_tp() -> None:
    assert config_error(QWEN_7B, "model.qwen25_7b.num_query_groups=7") == (
        "actor_config.tensor_model_parallel_size: must divide model.qwen25_7b.num_query_groups=7, got 2"
    )


def test_padded_vocab_must_divide_by_infer_tp() -> None:
    overrides = (
        "rl_config.actor_resource.num_npus=2",
        "generate_config.infer_tensor_parallel_size=2",
        "model.tiny_qwen2.padded_vocab_size=65",
    )
    assert config_error(TINY, *overrides) == (
        "generate_config.infer_tensor_parallel_size: must divide model.tiny_qwen2.padded_vocab_size=65, got 2"
    )


def test_mini_batch_must_divide_rollout() -> None:
    message = config_error(QWEN_7B, "rl_config.mini_batch_size=3")
    assert message.startswith("rl_config.mini_batch_size: mini_batch_size * n_samples_per_prompt = 3 * 8 = 24")
    assert "32 * 8 = 256 samples" in message


def test_micro_batches_must_tile_the_mini_batch() -> None:
    message = config_error(TINY, "actor_config.micro_batch_size=48")
    assert message.startswith("actor_config.micro_batch_size: train data-parallel size * micro_batch_size = 1 * 48")
    assert "128 samples" in message


def test_prompt_plus_response_must_fit_max_model_len() -> None:
    assert config_error(QWEN_7B, "generate_config.max_model_len=3000") == (
        "generate_config.max_model_len: must be >= rl_config.max_prompt_length + "
        "generate_config.sampling_config.max_tokens = 2048 + 2048 = 4096, got 3000"
    )


def test_model_block_must_match_synthetic_checkpoint() -> None:
    assert config_error(TINY, "synthetic_data.hidden_size=256") == (
        "model.tiny_qwen2.hidden_size: must equal synthetic_data.hidden_size=256, got 128"
    )
    load(TINY, "synthetic_data.enabled=false", "synthetic_data.hidden_size=256")  # disabled: not checked


def test_actor_model_must_name_a_block() -> None:
    assert config_error(TINY, "actor_config.model=llama") == (
        "actor_config.model: must name a block under `model` (tiny_qwen2), got 'llama'"
    )


# --- the CLI (subprocesses: a few seconds each) ----------------------------------------------------


def test_cli_cfg_job_prints_the_7b_config(tmp_path: Path) -> None:
    result = run_cli(tmp_path, "--config-name", QWEN_7B, "--cfg", "job")
    assert result.returncode == 0, result.stderr
    assert "megatron_training:" in result.stdout and "qwen25_7b:" in result.stdout
    assert "num_npus: 16" in result.stdout


def test_cli_config_error_is_one_line_and_exit_2(tmp_path: Path) -> None:
    result = run_cli(tmp_path, "--config-name", QWEN_7B, "actor_config.tensor_model_parallel_size=3")
    assert result.returncode == 2
    assert result.stderr.strip() == (
        "config error: actor_config.tensor_model_parallel_size: must divide rl_config.actor_resource.num_npus=16, got 3"
    )


def test_cli_override_of_unknown_key_exits_2_without_traceback(tmp_path: Path) -> None:
    result = run_cli(tmp_path, "--config-name", QWEN_7B, "rl_config.foo=1")
    assert result.returncode == 2
    assert "rl_config.foo" in result.stderr
    assert "Traceback" not in result.stderr + result.stdout


def test_cli_unknown_config_name_exits_2(tmp_path: Path) -> None:
    result = run_cli(tmp_path, "--config-name", "grpo_does_not_exist")
    assert result.returncode == 2
    assert "Cannot find primary config 'grpo_does_not_exist'" in result.stderr
    assert "Traceback" not in result.stderr


@pytest.mark.parametrize(
    "name,train,infer",
    [("grpo_tiny_cpu_tp2_infer_dp2", (2, 1, 1), (1, 2)), ("grpo_tiny_cpu_pp2_infer_tp2", (1, 2, 1), (2, 1))],
)
def test_two_rank_demo_variants_load(name, train, infer) -> None:
    config = load(name)
    a, g = config.actor_config, config.generate_config
    assert config.world_size == 2
    assert (a.tensor_model_parallel_size, a.pipeline_model_parallel_size, config.train_data_parallel_size) == train
    assert (g.infer_tensor_parallel_size, config.infer_data_parallel_size) == infer
