"""Config: real Hydra composition of the shipped YAMLs, load_config's messages, and the CLI's exit codes."""

import dataclasses
import json
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
    REMOVED_KEYS,
    SCHEMA_NAME,
    ConfigError,
    GRPOConfig,
    MegatronTrainingConfig,
    ModelArchConfig,
    SamplingConfig,
    check_model_block_against_hf,
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
    # DeepScaleR rows {problem, answer} through MindSpeed-RL's qwen_r1 template.
    assert config.megatron_training.prompt_type == "qwen_r1"
    assert config.megatron_training.map_keys == {"prompt": "problem", "labels": "answer"}
    assert config.megatron_training.sequence_parallel and config.megatron_training.use_distributed_optimizer
    # The recipe ships without saving (set save/save_interval to save); load is an HF directory.
    assert config.megatron_training.save_interval is None and config.actor_config.save is None
    assert config.actor_config.load is None and config.actor_config.finetune
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
    assert config.generate_config.cpu_kvcache_space_gb == pytest.approx(0.03125)
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




# ROLL's resource sections are opt-in: left out, every role runs on rl_config.actor_resource.num_npus
# devices; set them with `+actor_train.device_mapping=...` (see configs/grpo_tiny_cpu_colocated_roles.yaml).
# ROLL's keys: only the configs that place roles apart (or overlap rollouts with updates) carry them.
OPT_IN_SECTIONS = ("num_gpus_per_node", "actor_train", "actor_infer", "reference", "rewards", "async_generation_ratio",
                   "critic_config", "critic", "distillation",  # verl's distillation: configs/distill_tiny_cpu.yaml
                   "teacher", "msprobe_config")  # ROLL's teacher role; their msprobe section (with msprobe true)
# Read only by PPO (adv_estimator gae): listed in ppo_tiny_cpu; in the GRPO YAML they would be no-effect notices.
PPO_ONLY_KEYS = ("rl_config.lam", "rl_config.use_kl_in_reward", "rl_config.critic_resource.num_npus")
# DPO's keys (stage dpo): configs/dpo_tiny_cpu.yaml lists them.
DPO_ONLY_KEYS = tuple(f"megatron_training.{key}" for key in ("is_pairwise_dataset", "dpo_loss_type", "dpo_beta",
                                                             "dpo_label_smoothing", "pref_ftx", "ref_model",
                                                             "refer_model_iter"))


def test_tiny_yaml_lists_every_key_so_plain_overrides_work() -> None:
    # Hydra only accepts `key=value` for keys present in the YAML (others need `+key=value`).
    cfg = compose_cfg(TINY)
    absent = "<absent>"
    keys = [key for key in sorted(_schema_keys(GRPOConfig))
            if key.split(".")[0] not in OPT_IN_SECTIONS and key not in PPO_ONLY_KEYS + DPO_ONLY_KEYS]
    missing = [key for key in keys if OmegaConf.select(cfg, key, default=absent) == absent]
    assert missing == []


def test_yamls_do_not_use_the_hydra_schema() -> None:
    for path in [*CONFIG_DIR.glob("*.yaml"), *CONFIG_DIR.glob("model/*.yaml")]:
        assert SCHEMA_NAME not in path.read_text(), path


def test_register_configs_stores_the_schema() -> None:
    register_configs()
    stored = ConfigStore.instance().load(f"{SCHEMA_NAME}.yaml")
    assert OmegaConf.get_type(stored.node) is GRPOConfig


def test_default_config_name_follows_the_accelerator(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(loader, "accelerator_present", lambda: False)
    assert default_config_name() == CPU_CONFIG_NAME == TINY
    monkeypatch.setattr(loader, "accelerator_present", lambda: True)
    assert default_config_name() == ACCELERATOR_CONFIG_NAME == QWEN_7B


def test_load_config_accepts_a_plain_mapping() -> None:
    container = OmegaConf.to_container(compose_cfg(TINY))
    assert isinstance(container, dict)
    assert load_config(container).rl_config.n_samples_per_prompt == 16


# --- schema errors: unknown keys, types, missing values --------------------------------------------


def test_unknown_key_names_the_key_and_the_valid_ones() -> None:
    message = config_error(QWEN_7B, "+rl_config.foo=1")
    assert message.startswith("rl_config.foo: unknown key (valid keys of rl_config: use_integrated_worker, ")
    assert "mini_batch_size" in message and "actor_resource" in message


def test_unknown_key_in_a_model_block() -> None:
    message = config_error(QWEN_7B, "+model.qwen25_7b.num_heads=28")
    assert message.startswith("model.qwen25_7b.num_heads: unknown key (valid keys of model.qwen25_7b: ")
    assert "num_attention_heads" in message


def test_unknown_top_level_key() -> None:
    message = config_error(TINY, "+trainer.lr=1")
    assert message == (
        "trainer: unknown key (valid top-level keys: megatron_training, actor_config, critic_config, rl_config, "
        "generate_config, model, synthetic_data, runtime, profiler_config, msprobe_config, num_gpus_per_node, "
        "actor_train, actor_infer, reference, critic, teacher, rewards, async_generation_ratio, distillation)"
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
        "rl_config.kl_penalty: must be one of kl, abs, mse, low_var_kl, k1, k2, k3, kl+, k1+, low_var_kl+, k3+, got 'bogus'"
    )


def test_infer_pipeline_parallel_sets_the_inference_dp() -> None:
    config = load(QWEN_7B, "generate_config.infer_pipeline_parallel_size=2", "generate_config.infer_tensor_parallel_size=2")
    assert config.infer_data_parallel_size == 16 // (2 * 2)


def test_infer_pp2_demo_loads() -> None:
    config = load("grpo_tiny_cpu_infer_pp2")
    g = config.generate_config
    assert (config.world_size, config.actor_config.tensor_model_parallel_size) == (2, 2)
    assert (g.infer_tensor_parallel_size, g.infer_pipeline_parallel_size, config.infer_data_parallel_size) == (1, 2, 1)


def test_infer_pipeline_parallel_is_colocated_only() -> None:
    message = config_error("grpo_tiny_cpu_disaggregated", "generate_config.infer_pipeline_parallel_size=2",
                           "actor_infer.device_mapping=[1,2]")
    assert message.startswith("generate_config.infer_pipeline_parallel_size: inference pipeline stages run colocated only")


def test_infer_pipeline_parallel_needs_a_layer_per_stage() -> None:
    message = config_error(QWEN_7B, "generate_config.infer_pipeline_parallel_size=16", "model.qwen25_7b.num_layers=8")
    assert message.startswith("generate_config.infer_pipeline_parallel_size: must not exceed model.qwen25_7b.num_layers=8")


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


def test_tensor_parallel_must_divide_world_and_the_heads() -> None:
    assert config_error(QWEN_7B, "actor_config.tensor_model_parallel_size=3").splitlines() == [
        "actor_config.tensor_model_parallel_size: must divide rl_config.actor_resource.num_npus=16, got 3",
        "actor_config.tensor_model_parallel_size: must divide model.qwen25_7b.num_attention_heads=28, got 3",
    ]


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


def test_prompt_plus_response_beyond_max_model_len_caps_the_response_saying_so() -> None:
    from mindspeed_rl.config.tolerated import longest_sample_tokens, warning_lines

    config = load(QWEN_7B, "generate_config.max_model_len=3000")
    assert longest_sample_tokens(config) == 3000
    assert warning_lines(config) == [
        "[config] warning: rl_config.max_prompt_length + generate_config.sampling_config.max_tokens = 2048 + 2048 = "
        "4096 exceeds generate_config.max_model_len=3000: prompts longer than 952 tokens get a response budget of "
        "max_model_len - prompt (vLLM ends them there, as in MindSpeed-RL)"]


def test_a_prompt_as_long_as_max_model_len_leaves_no_room_and_is_refused() -> None:
    assert config_error(QWEN_7B, "generate_config.max_model_len=2048") == (
        "generate_config.max_model_len: must be > rl_config.max_prompt_length=2048 (room for a response), got 2048")


def test_model_block_must_match_synthetic_checkpoint() -> None:
    assert config_error(TINY, "synthetic_data.hidden_size=256") == (
        "model.tiny_qwen2.hidden_size: must equal synthetic_data.hidden_size=256, got 128"
    )
    load(TINY, "synthetic_data.enabled=false", "synthetic_data.hidden_size=256",  # disabled: not checked
         "megatron_training.tokenizer_name_or_path=m", "megatron_training.data_path=d")


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


def test_cli_config_errors_are_one_line_each_and_exit_2(tmp_path: Path) -> None:
    result = run_cli(tmp_path, "--config-name", QWEN_7B, "actor_config.tensor_model_parallel_size=3")
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [
        "config error: actor_config.tensor_model_parallel_size: must divide rl_config.actor_resource.num_npus=16, got 3",
        "config error: actor_config.tensor_model_parallel_size: must divide model.qwen25_7b.num_attention_heads=28, "
        "got 3",
    ]


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


# --- every shipped config loads; every key works or is an error naming it ---------------------------

SHIPPED_TRAINING_CONFIGS = sorted(path.stem for path in CONFIG_DIR.glob("grpo_*.yaml"))
# MindSpeed-RL's own recipes, shipped verbatim: they save checkpoints where MindSpeed-RL's do.
VERBATIM_MINDSPEED_RL = {"grpo_qwen25_32b_A2", "grpo_qwen3_8b_A3", "dapo_qwen3_30b_a3b_A3", "grpo_deepseek_r1_671b_A3"}


@pytest.mark.parametrize("name", SHIPPED_TRAINING_CONFIGS)
def test_every_shipped_training_config_loads(name: str) -> None:
    config = load(name)
    assert config.selected_model is not None
    if name not in VERBATIM_MINDSPEED_RL:  # ours save only when asked
        assert config.megatron_training.save_interval is None and config.actor_config.save is None


def _override_for_removed(key: str) -> str:
    # A model block's keys are removed whatever the block's name; the 7B recipe's block is qwen25_7b.
    return "+" + key.replace("model.*.", "model.qwen25_7b.") + "=1"


@pytest.mark.parametrize("key", sorted(REMOVED_KEYS))
def test_removed_key_is_an_error_naming_it_and_the_reason(key: str) -> None:
    concrete = _override_for_removed(key)[1:].split("=")[0]
    assert config_error(QWEN_7B, _override_for_removed(key)) == (
        f"{concrete}: not supported: {REMOVED_KEYS[key]}; remove it"
    )


def test_removed_key_in_a_yaml_mapping_is_found_without_hydra() -> None:
    container = OmegaConf.to_container(compose_cfg(TINY))
    assert isinstance(container, dict)
    container["ref_config"] = {"micro_batch_size": 1}
    with pytest.raises(ConfigError) as info:
        load_config(container)
    assert info.value.key == "ref_config"


@pytest.mark.parametrize(
    "override,expected",
    [
        ("megatron_training.use_mcore_models=false", "megatron_training.use_mcore_models: must be true: "),
        ("megatron_training.tokenizer_type=Llama2Tokenizer", "megatron_training.tokenizer_type: must be 'PretrainedFromHF': "),
        ("megatron_training.stage=ray_sft", "megatron_training.stage: must be one of ray_grpo, ray_dapo, ray_ppo, dpo, got 'ray_sft'"),
        ("megatron_training.save_interval=0", "megatron_training.save_interval: must be a positive number of "
                                              "iterations or null, got 0"),
        ("megatron_training.dataset_additional_keys=[]", "megatron_training.dataset_additional_keys: must be ['labels']: "),
        ("actor_config.keep_last_n=0", "actor_config.keep_last_n: must be >= 1 or null (keep all), got 0"),
        ("rl_config.use_integrated_worker=false", "rl_config.use_integrated_worker: must be true: "),
        ("rl_config.rule_reward=false", "rl_config.rule_reward: must be true: "),
        ("rl_config.adv_estimator=vtrace", "rl_config.adv_estimator: must be one of group_norm, rloo, reinforce_plus_plus, "
                                           "reinforce_plus_plus_baseline, gae, got 'vtrace'"),
        ("rl_config.kl_ctrl_type=pid", "rl_config.kl_ctrl_type: must be one of fixed, adaptive, got 'pid'"),
        ("model.tiny_qwen2.normalization=LayerNorm", "model.tiny_qwen2.normalization: must be 'RMSNorm': "),
        ("model.tiny_qwen2.swiglu=false", "model.tiny_qwen2.swiglu: must be true: "),
        ("model.tiny_qwen2.position_embedding_type=learned_absolute",
         "model.tiny_qwen2.position_embedding_type: must be 'rope': "),
        ("model.tiny_qwen2.disable_bias_linear=false", "model.tiny_qwen2.disable_bias_linear: must be true: "),
        ("model.tiny_qwen2.make_vocab_size_divisible_by=128", "model.tiny_qwen2.make_vocab_size_divisible_by: must be 1: "),
        ("model.tiny_qwen2.use_mcore_models=false", "model.tiny_qwen2.use_mcore_models: must be true: "),
        ("+model.tiny_qwen2.moe_aux_loss_coeff=-0.001", "model.tiny_qwen2.moe_aux_loss_coeff: must be >= 0"),
        ("+model.tiny_qwen2.moe_router_load_balancing_type=sinkhorn",
         "model.tiny_qwen2.moe_router_load_balancing_type: must be one of none, aux_loss, seq_aux_loss"),
    ],
)
def test_key_with_one_working_value_rejects_the_others(override: str, expected: str) -> None:
    assert config_error(TINY, override).startswith(expected)


def test_split_must_be_train_only() -> None:
    message = config_error(TINY, "megatron_training.split='98,1,1'")
    assert message.startswith("megatron_training.split: must be train-only 'N,0,0'")
    assert message.endswith("got '98,1,1'")


# --- our keys ------------------------------------------------------------------------------------


def test_data_keys_default_to_plain_prompt_and_answer_columns() -> None:
    mt = load(TINY).megatron_training
    assert (mt.prompt_type, mt.map_keys, mt.overlong_prompts, mt.wrap_small_dataset) == (
        "empty", {"prompt": "prompt", "labels": "answer"}, "filter", False
    )


def test_map_keys_take_nested_paths() -> None:
    mt = load(TINY, "megatron_training.map_keys={prompt:prompt,labels:reward_model.ground_truth}").megatron_training
    assert mt.map_keys == {"prompt": "prompt", "labels": "reward_model.ground_truth"}


def test_map_keys_given_in_part_keep_the_other_defaults() -> None:
    cfg = compose_cfg(TINY)
    cfg.megatron_training.map_keys = {"prompt": "problem"}
    assert load_config(cfg).megatron_training.map_keys == {"prompt": "problem", "labels": "answer"}


def test_map_keys_need_prompt_and_labels() -> None:
    with pytest.raises(ConfigError) as info:
        MegatronTrainingConfig(tokenizer_name_or_path="m", global_batch_size=1, train_iters=1, data_path="d",
                               map_keys={"prompt": "problem"})
    assert str(info.value) == "megatron_training.map_keys: must map prompt, labels to row fields, missing labels"


def test_map_keys_reject_an_unknown_field() -> None:
    message = config_error(TINY, "+megatron_training.map_keys.solution=solution")
    assert message == "megatron_training.map_keys.solution: unknown field (known: prompt, labels, system)"


def test_overlong_prompts_policy_is_filter_or_error() -> None:
    assert config_error(TINY, "megatron_training.overlong_prompts=truncate") == (
        "megatron_training.overlong_prompts: must be one of filter, error, got 'truncate'"
    )


def test_verifier_timeout_must_be_positive() -> None:
    assert config_error(TINY, "rl_config.verifier_timeout_seconds=0") == (
        "rl_config.verifier_timeout_seconds: must be > 0, got 0.0"
    )


def test_unknown_verifier_names_the_known_ones() -> None:
    from mindspeed_rl.data.rewards import VERIFIERS

    message = config_error(TINY, "rl_config.verifier_function=[math_acc]")
    assert message == f"rl_config.verifier_function: unknown verifier 'math_acc'; known: {', '.join(sorted(VERIFIERS))}"
    assert "arith_acc" in message


def test_sequence_parallel_at_tp1_runs_without_it_as_megatron_does_saying_so() -> None:
    from mindspeed_rl.config.tolerated import sequence_parallel_in_effect, warning_lines

    tp1 = load(TINY, "megatron_training.sequence_parallel=true")
    assert not sequence_parallel_in_effect(tp1)
    assert warning_lines(tp1) == ["[config] warning: megatron_training.sequence_parallel: true at "
                                  "actor_config.tensor_model_parallel_size=1 trains without it, as Megatron-LM does "
                                  "(there is no tensor-parallel group to split activations over)"]
    tp2 = load("grpo_tiny_cpu_tp2_infer_dp2", "megatron_training.sequence_parallel=true")
    assert sequence_parallel_in_effect(tp2) and warning_lines(tp2) == []


def test_synthetic_task_is_one_of_the_demos() -> None:
    assert config_error(TINY, "synthetic_data.task=poetry") == (
        "synthetic_data.task: must be one of arith, math_word, tool_call, search_call, got 'poetry'"
    )


def test_math_word_task_still_checks_the_model_block_sizes() -> None:
    assert config_error(TINY, "synthetic_data.task=math_word", "synthetic_data.num_layers=4") == (
        "model.tiny_qwen2.num_layers: must equal synthetic_data.num_layers=4, got 2"
    )


def test_vocab_size_bounds_the_block_for_arith_only() -> None:
    # math_word's tokenizer size comes from its word list, not synthetic_data.vocab_size.
    assert config_error(TINY, "synthetic_data.vocab_size=64").startswith("model.tiny_qwen2.padded_vocab_size: ")
    assert load(TINY, "synthetic_data.task=math_word", "synthetic_data.vocab_size=64").synthetic_data.task == "math_word"


@pytest.mark.parametrize("name", [TINY, "grpo_tiny_math_cpu"])
def test_a_path_the_synthetic_data_would_replace_is_an_error(name: str) -> None:
    assert config_error(name, "megatron_training.data_path=/missing") == (
        "megatron_training.data_path: set to /missing, but synthetic_data.enabled=true generates the data; "
        "add synthetic_data.enabled=false to train on /missing"
    )
    assert config_error(name, "megatron_training.tokenizer_name_or_path=/my/model") == (
        "megatron_training.tokenizer_name_or_path: set to /my/model, but synthetic_data.enabled=true generates "
        "the model and tokenizer; add synthetic_data.enabled=false to train from /my/model"
    )


def test_demo_paths_are_null_and_needed_without_synthetic_data() -> None:
    mt = load(TINY).megatron_training
    assert (mt.tokenizer_name_or_path, mt.data_path) == (None, None)
    mt = load(TINY, "synthetic_data.enabled=false", "megatron_training.tokenizer_name_or_path=/my/model",
              "megatron_training.data_path=/my/data.jsonl").megatron_training
    assert (mt.tokenizer_name_or_path, mt.data_path) == ("/my/model", "/my/data.jsonl")
    assert config_error(TINY, "synthetic_data.enabled=false", "megatron_training.data_path=/my/data.jsonl") == (
        "megatron_training.tokenizer_name_or_path: must name a path: null is for synthetic_data.enabled=true, which "
        "generates the model and tokenizer, but synthetic_data.enabled=false; got null"
    )
    assert config_error(QWEN_7B, "megatron_training.data_path=null") == (
        "megatron_training.data_path: must name a path: null is for synthetic_data.enabled=true, which generates "
        "the data, but there is no synthetic_data section; got null"
    )
    assert config_error(QWEN_7B, "~megatron_training.data_path") == (
        "megatron_training.data_path: missing required value (expected str or null)"
    )


def test_cli_refuses_a_data_path_the_demo_would_ignore(tmp_path: Path) -> None:
    result = run_cli(tmp_path, "--config-name", TINY, "megatron_training.data_path=/missing")
    assert result.returncode == 2
    assert result.stderr.strip() == (
        "config error: megatron_training.data_path: set to /missing, but synthetic_data.enabled=true generates the "
        "data; add synthetic_data.enabled=false to train on /missing"
    )
    assert not (tmp_path / "data").exists()  # refused before anything was generated


def test_save_hf_is_off_in_every_shipped_config_and_a_bool() -> None:
    for name in SHIPPED_TRAINING_CONFIGS:
        assert load(name).megatron_training.save_hf is False
    assert load(TINY, "megatron_training.save_hf=true").megatron_training.save_hf is True
    assert config_error(TINY, "megatron_training.save_hf=sometimes") == (
        "megatron_training.save_hf: expected bool, got 'sometimes' (str)"
    )


def test_cpu_rank_limit_must_be_positive() -> None:
    assert config_error(TINY, "runtime.max_ranks_per_cpu_core=0") == "runtime.max_ranks_per_cpu_core: must be > 0, got 0"


# --- model block against the checkpoint's config.json ---------------------------------------------

# Qwen/Qwen2.5-7B's config.json (the keys the check reads, values as published).
QWEN25_7B_CONFIG_JSON = {
    "architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "hidden_size": 3584, "intermediate_size": 18944,
    "num_hidden_layers": 28, "num_attention_heads": 28, "num_key_value_heads": 4, "max_position_embeddings": 131072,
    "rms_norm_eps": 1e-06, "rope_theta": 1000000.0, "tie_word_embeddings": False, "vocab_size": 152064,
}


def _qwen25_7b_block() -> ModelArchConfig:
    return load(QWEN_7B).model["qwen25_7b"]


def hf_mismatch(arch: ModelArchConfig, hf_config: dict) -> str:
    return hf_mismatch_at("model.qwen25_7b", arch, hf_config)


def test_shipped_7b_block_matches_the_qwen25_7b_checkpoint() -> None:
    check_model_block_against_hf(_qwen25_7b_block(), "model.qwen25_7b", QWEN25_7B_CONFIG_JSON)


def test_shipped_tiny_block_matches_the_demo_generators_config_json() -> None:
    from mindspeed_rl.data.tiny_model import _qwen2_config

    synthetic = load(TINY).synthetic_data
    assert synthetic is not None
    hf_config = json.loads(_qwen2_config(
        vocab_size=synthetic.vocab_size, hidden_size=synthetic.hidden_size, ffn_hidden_size=synthetic.ffn_hidden_size,
        num_layers=synthetic.num_layers, num_attention_heads=synthetic.num_attention_heads,
        num_query_groups=synthetic.num_query_groups, max_position_embeddings=256, init_std=0.05,
    ).to_json_string())
    assert "rope_theta" not in hf_config  # transformers 5 nests it in rope_parameters, which must be read
    check_model_block_against_hf(load(TINY).model["tiny_qwen2"], "model.tiny_qwen2", hf_config)


@pytest.mark.parametrize(
    "changes,expected",
    [
        ({"num_layers": 24}, "model.qwen25_7b.num_layers: is 24 but the checkpoint's config.json has num_hidden_layers=28"),
        ({"hidden_size": 4096}, "model.qwen25_7b.hidden_size: is 4096 but the checkpoint's config.json has hidden_size=3584"),
        ({"ffn_hidden_size": 1}, "model.qwen25_7b.ffn_hidden_size: is 1 but the checkpoint's config.json has "
                                 "intermediate_size=18944"),
        ({"num_attention_heads": 32}, "model.qwen25_7b.num_attention_heads: is 32 but the checkpoint's config.json has "
                                      "num_attention_heads=28"),
        ({"num_query_groups": 7}, "model.qwen25_7b.num_query_groups: is 7 but the checkpoint's config.json has "
                                  "num_key_value_heads=4"),
        ({"group_query_attention": False}, "model.qwen25_7b.group_query_attention: is false but the checkpoint's "
                                           "config.json has num_key_value_heads=4 and num_attention_heads=28"),
        ({"rotary_base": 10000.0}, "model.qwen25_7b.rotary_base: is 10000.0 but the checkpoint's config.json has "
                                   "rope_theta=1000000.0"),
        ({"norm_epsilon": 1e-5}, "model.qwen25_7b.norm_epsilon: is 1e-05 but the checkpoint's config.json has "
                                 "rms_norm_eps=1e-06"),
        ({"untie_embeddings_and_output_weights": False}, "model.qwen25_7b.untie_embeddings_and_output_weights: is false "
                                                         "but the checkpoint's config.json has tie_word_embeddings=false"),
        ({"add_qkv_bias": False}, "model.qwen25_7b.add_qkv_bias: is false but the checkpoint's config.json has "
                                  "model_type='qwen2' (always a QKV bias)"),
        ({"kv_channels": 64}, "model.qwen25_7b.kv_channels: is 64 but the checkpoint's config.json has no head_dim, so "
                              "hidden_size / num_attention_heads = 3584 / 28 = 128"),
        ({"qk_layernorm": True}, "model.qwen25_7b.qk_layernorm: is true but the checkpoint's config.json has "
                                 "model_type='qwen2' (without q/k norms)"),
        ({"num_experts": 8}, "model.qwen25_7b.num_experts: is 8 but the checkpoint's config.json has no num_experts "
                             "(a dense model)"),
        ({"max_position_embeddings": 262144}, "model.qwen25_7b.max_position_embeddings: is 262144 but the checkpoint's "
                                              "config.json has max_position_embeddings=131072; it must be <= that"),
        ({"padded_vocab_size": 151643}, "model.qwen25_7b.padded_vocab_size: is 151643 but the checkpoint's config.json "
                                        "has vocab_size=152064; it must be >= that"),
    ],
)
def test_block_field_that_disagrees_with_the_checkpoint_is_named(changes: dict, expected: str) -> None:
    assert hf_mismatch(dataclasses.replace(_qwen25_7b_block(), **changes), QWEN25_7B_CONFIG_JSON).startswith(expected)


def test_block_may_lower_the_position_limit_and_pad_the_vocab() -> None:
    # MindSpeed-RL's block says 32768 for this 131072-position checkpoint.
    block = dataclasses.replace(_qwen25_7b_block(), padded_vocab_size=152064 + 64)
    assert block.max_position_embeddings == 32768
    check_model_block_against_hf(block, "model.qwen25_7b", QWEN25_7B_CONFIG_JSON)


def test_fields_the_checkpoint_does_not_state_are_not_compared() -> None:
    sparse = {"num_hidden_layers": 28, "hidden_size": 3584, "intermediate_size": 18944, "num_attention_heads": 28,
              "num_key_value_heads": 4}
    check_model_block_against_hf(_qwen25_7b_block(), "model.qwen25_7b", sparse)


QWEN3_MOE_CONFIG_JSON = {
    "model_type": "qwen3_moe", "hidden_size": 2048, "intermediate_size": 6144, "num_hidden_layers": 48,
    "num_attention_heads": 32, "num_key_value_heads": 4, "head_dim": 128, "num_experts": 128,
    "num_experts_per_tok": 8, "moe_intermediate_size": 768, "norm_topk_prob": True, "attention_bias": False,
    "rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0}, "tie_word_embeddings": False,
}


def _qwen3_moe_block(**changes: object) -> ModelArchConfig:
    fields_ = dict(num_layers=48, hidden_size=2048, ffn_hidden_size=6144, num_attention_heads=32,
                   group_query_attention=True, num_query_groups=4, kv_channels=128, num_experts=128, moe_router_topk=8,
                   moe_ffn_hidden_size=768, norm_topk_prob=True, add_qkv_bias=False, qk_layernorm=True,
                   rotary_base=1e6, untie_embeddings_and_output_weights=True)
    fields_.update(changes)
    return ModelArchConfig(**fields_)


def test_moe_block_matches_a_qwen3_moe_checkpoint() -> None:
    check_model_block_against_hf(_qwen3_moe_block(), "model.qwen3_30b_a3b", QWEN3_MOE_CONFIG_JSON)


@pytest.mark.parametrize(
    "changes,expected",
    [
        ({"moe_router_topk": 2}, "model.qwen3_30b_a3b.moe_router_topk: is 2 but the checkpoint's config.json has "
                                 "num_experts_per_tok=8"),
        ({"moe_ffn_hidden_size": 1024}, "model.qwen3_30b_a3b.moe_ffn_hidden_size: is 1024 but the checkpoint's "
                                        "config.json has moe_intermediate_size=768"),
        ({"num_experts": 64}, "model.qwen3_30b_a3b.num_experts: is 64 but the checkpoint's config.json has num_experts=128"),
        ({"add_qkv_bias": True}, "model.qwen3_30b_a3b.add_qkv_bias: is true but the checkpoint's config.json has "
                                 "attention_bias=false"),
        ({"kv_channels": 64}, "model.qwen3_30b_a3b.kv_channels: is 64 but the checkpoint's config.json has head_dim=128"),
        ({"rotary_base": 1e4}, "model.qwen3_30b_a3b.rotary_base: is 10000.0 but the checkpoint's config.json has "
                               "rope_parameters.rope_theta=1000000.0"),
        ({"qk_layernorm": False}, "model.qwen3_30b_a3b.qk_layernorm: is false but the checkpoint's config.json has "
                                  "model_type='qwen3_moe' (with q/k norms)"),
    ],
)
def test_moe_block_field_that_disagrees_is_named(changes: dict, expected: str) -> None:
    message = hf_mismatch_at("model.qwen3_30b_a3b", _qwen3_moe_block(**changes), QWEN3_MOE_CONFIG_JSON)
    assert message.startswith(expected)


def hf_mismatch_at(block_key: str, arch: ModelArchConfig, hf_config: dict) -> str:
    with pytest.raises(ConfigError) as info:
        check_model_block_against_hf(arch, block_key, hf_config)
    return str(info.value)


def test_packing_budgets_default_to_the_shared_keys_per_phase() -> None:
    rl = load(TINY, "rl_config.use_remove_padding=true", "rl_config.use_dynamic_bsz=true",
              "rl_config.max_packing_token_size=512", "rl_config.update_max_packing_token_size=1024",
              "rl_config.ref_dynamic_max_batch_size=4").rl_config
    assert rl.packing_budgets == {"ref": (512, 4), "actor": (512, None), "update": (1024, None)}


def test_dynamic_batch_size_needs_packing() -> None:
    assert config_error(TINY, "rl_config.use_dynamic_bsz=true").startswith(
        "rl_config.use_dynamic_bsz: needs use_remove_padding: true")


def test_a_packing_budget_below_the_longest_sample_names_its_key() -> None:
    cfg = load(TINY)
    longest = cfg.rl_config.max_prompt_length + cfg.generate_config.sampling_config.max_tokens
    message = config_error(TINY, "rl_config.use_remove_padding=true", "rl_config.use_dynamic_bsz=true",
                           f"rl_config.actor_max_packing_token_size={longest - 1}")
    assert message == (f"rl_config.actor_max_packing_token_size: must be >= the longest sample, "
                       f"min(rl_config.max_prompt_length + generate_config.sampling_config.max_tokens, "
                       f"generate_config.max_model_len) = {longest} (a sample is never split), got {longest - 1}")


def test_packed_attention_has_no_dropout() -> None:
    assert config_error(TINY, "rl_config.use_remove_padding=true", "megatron_training.attention_dropout=0.1") == (
        "megatron_training.attention_dropout: must be 0 with rl_config.use_remove_padding: packed attention runs "
        "without dropout")


def test_dapo_loss_options_reach_the_loss() -> None:
    from mindspeed_rl.workers.actor_steps import loss_config_for

    plain = loss_config_for(load(TINY), kl_coef=0.0)
    assert (plain.clip_ratio, plain.clip_ratio_high, plain.loss_agg_mode) == (0.2, None, "token-mean")
    dapo = loss_config_for(load(TINY, "rl_config.clip_higher_enable=true", "rl_config.clip_ratio_low=0.2",
                                "rl_config.clip_ratio_high=0.28", "rl_config.loss_agg_mode=seq-mean-token-sum-norm"),
                           kl_coef=0.0)
    assert (dapo.clip_ratio, dapo.clip_ratio_high, dapo.loss_agg_mode, dapo.norm_length) == (
        0.2, 0.28, "seq-mean-token-sum-norm", 4)  # the norm length is generate_config's max_tokens
    assert loss_config_for(load(TINY, "rl_config.token_level_loss=false"), kl_coef=0.0).loss_agg_mode == \
        "seq-mean-token-mean"


def test_bad_dapo_options() -> None:
    assert config_error(TINY, "rl_config.loss_agg_mode=token-sum").startswith("rl_config.loss_agg_mode: must be one of")
    assert config_error(TINY, "rl_config.overlong_buffer_enable=true") == (
        "rl_config.overlong_buffer: must be in (0, rollout_max_tokens=2048] when overlong_buffer_enable is true, got 0")


def test_evaluation_needs_held_out_prompts() -> None:
    assert config_error(QWEN_7B, "+rl_config.eval_interval=5") == (
        "megatron_training.eval_data_path: must name the held-out prompts when rl_config.eval_interval or "
        "eval_before_train is set (a generated synthetic_data task has its own)")
    for demo in (TINY, "grpo_tiny_math_cpu"):  # each generated task has an evaluation split (tool_call: test_multi_turn_e2e)
        assert load(demo, "rl_config.eval_interval=5").rl_config.eval_interval == 5


def test_greedy_evaluation_takes_one_sample_per_prompt() -> None:
    assert config_error(TINY, "rl_config.eval_n_samples=4").startswith(
        "rl_config.eval_n_samples: must be 1 with eval_sampling: greedy")
    assert load(TINY, "rl_config.eval_n_samples=4", "rl_config.eval_sampling=train").rl_config.eval_n_samples == 4


def test_dynamic_sampling_metric_is_acc_reward_or_a_verifier() -> None:
    assert config_error(TINY, "rl_config.filter_groups_enable=true", "rl_config.filter_groups_metric=acc_for_dapo") == (
        "rl_config.filter_groups_metric: must be acc, reward or one of verifier_function (arith_acc), got "
        "'acc_for_dapo'")


def test_dynamic_sampling_trains_on_its_own_batch_size() -> None:
    message = config_error(TINY, "rl_config.filter_groups_enable=true", "rl_config.filter_groups_train_batch_size=3")
    assert message.startswith("rl_config.mini_batch_size: mini_batch_size * n_samples_per_prompt")
    assert "rl_config.filter_groups_train_batch_size * rl_config.n_samples_per_prompt = 3 * 16" in message


@pytest.mark.parametrize("name", sorted(path.stem for path in CONFIG_DIR.glob("*.yaml") if path.stem != "prompt_templates"))
def test_every_shipped_config_takes_any_schema_key_as_a_plain_override(name: str) -> None:
    """The CLI turns `a.b=v` into Hydra's `++a.b=v` (config/overrides.as_upsert): a key the YAML leaves out needs no
    `+`. Each shipped config is composed with a plain override of every scalar key of the schema it lacks."""
    from mindspeed_rl.config.overrides import as_upsert

    cfg, absent = compose_cfg(name), "<absent>"
    missing = [key for key in sorted(_schema_keys(GRPOConfig)) if OmegaConf.select(cfg, key, default=absent) == absent
               and key.count(".") == 1 and key.split(".")[0] not in OPT_IN_SECTIONS]
    composed = compose_cfg(name, [as_upsert(f"{key}=null") for key in missing])
    assert all(OmegaConf.select(composed, key, default=absent) is None for key in missing)


def test_the_name_registries_below_config_match_what_the_features_implement() -> None:
    """config/ validates against mindspeed_rl/registries.py; each feature implements exactly those names."""
    from mindspeed_rl import registries
    from mindspeed_rl.data.rewards import VERIFIERS
    from mindspeed_rl.tools.parser import TOOL_PARSERS

    assert sorted(VERIFIERS) == sorted(registries.VERIFIER_NAMES)
    assert sorted(TOOL_PARSERS) == sorted(registries.TOOL_PARSER_NAMES)
