"""MindSpeed-RL's own recipe files (tests/data/mindspeed_rl_recipes, verbatim) load here unchanged: their
implementation knobs are listed once as having no effect, runtime.strict_keys makes those errors, and a
value of such a key that would change what is computed is an error."""

from pathlib import Path
import pytest
from hydra import compose, initialize_config_dir

from mindspeed_rl.config import ConfigError, GRPOConfig, load_config
from mindspeed_rl.config.no_effect import NO_EFFECT_KEYS, no_effect_notice
from mindspeed_rl.config.overrides import as_upsert, search_path_override
from tests.test_config import CONFIG_DIR, TINY, compose_cfg

pytestmark = pytest.mark.filterwarnings("ignore:.*Defaults list is missing `_self_`")

RECIPES = Path(__file__).resolve().parent / "data" / "mindspeed_rl_recipes"
# Their recipe whose own numbers disagree (test_their_self_contradicting_recipe_runs_as_theirs_does_with_one_warning).
CONTRADICTING = "grpo_deepseek_r1_671b_A2"
NAMES = sorted(path.stem for path in RECIPES.glob("*.yaml"))


def load_recipe(name: str, *overrides: str, notices: list[str] | None = None) -> GRPOConfig:
    upserts = [as_upsert(override) for override in overrides] + [search_path_override(str(CONFIG_DIR))]
    with initialize_config_dir(config_dir=str(RECIPES), version_base="1.3"):
        cfg = compose(config_name=name, overrides=upserts)
    return load_config(cfg, notices=notices)


@pytest.mark.parametrize("name", NAMES)
def test_their_recipe_loads_unchanged_with_its_knobs_listed(name: str) -> None:
    notices: list[str] = []
    # Every layout of theirs loads on CPU too (gloo covers the uneven gathers through CPU patch P8).
    config = load_recipe(name, "runtime.device=cpu", notices=notices)
    assert config.runtime.device == "cpu"
    listed = {notice.split(" ", 1)[0] for notice in notices}
    ppo = config.rl_config.adv_estimator == "gae"  # GAE reads lam
    if not config.generates:  # their DPO recipe: MindSpeed-LLM's arguments, no rl_config (config/dpo.py)
        assert {"megatron_training.seq_length", "megatron_training.tokenizer_not_use_fast"} <= listed
    else:
        assert {"megatron_training.seq_length", "rl_config.blocking", *(() if ppo else ("rl_config.lam",))} <= listed
    assert no_effect_notice(notices).startswith("[config] no effect on this engine: megatron_training.seq_length (")


def test_their_7b_recipe_keeps_its_values() -> None:
    config = load_recipe("grpo_qwen25_7b_A3")
    assert config.world_size == 16
    assert (config.actor_config.tensor_model_parallel_size, config.actor_config.pipeline_model_parallel_size) == (2, 2)
    # their model block's attention_softmax_in_fp32 is read as megatron_training's, as MindSpeed-RL does
    assert config.megatron_training.attention_softmax_in_fp32 is True


def test_their_32b_recipe_uses_math_verify_reward_and_a_sampling_seed() -> None:
    config = load_recipe("grpo_qwen25_32b_A2")
    assert config.rl_config.verifier_function == ["math_verify_reward"]
    assert config.generate_config.sampling_config.seed == 1  # the rollouts' base seed (workers/parts/inference.py)


def test_their_qwen3_moe_recipe_keeps_its_router_load_balancing() -> None:
    config = load_recipe("dapo_qwen3_30b_a3b_A3")
    block = config.selected_model
    assert (block.moe_router_load_balancing_type, block.moe_aux_loss_coeff) == ("aux_loss", 0.001)
    assert config.generate_config.enable_expert_parallel is True


DEEPSEEK_HF = CONFIG_DIR / "model" / "hf" / "deepseek_v3.json"  # the published config.json (planner copy)


def _deepseek(*overrides: str, notices: list[str] | None = None) -> GRPOConfig:
    return load_recipe("grpo_deepseek_r1_671b_A3", "runtime.device=npu", *overrides, notices=notices)


def test_their_deepseek_block_describes_the_published_checkpoint() -> None:
    """Every field of their deepseekv3_671b block is compared with DeepSeek-V3's config.json, and agrees."""
    import json

    from mindspeed_rl.config import check_model_block_against_hf

    block = _deepseek().selected_model
    assert (block.multi_latent_attention, block.q_lora_rank, block.kv_lora_rank, block.qk_head_dim,
            block.qk_pos_emb_head_dim, block.v_head_dim) == (True, 1536, 512, 128, 64, 128)
    assert (block.rope_scaling_type, block.rope_scaling_factor, block.beta_fast) == ("yarn", 40.0, 32.0)
    assert (block.first_k_dense_replace, block.moe_router_num_groups, block.moe_router_group_topk) == (3, 8, 4)
    check_model_block_against_hf(block, "model.deepseekv3_671b", json.loads(DEEPSEEK_HF.read_text()))


@pytest.mark.parametrize("field, value, expected", [
    ("qk_head_dim", 64, "model.deepseekv3_671b.qk_head_dim: is 64 but the checkpoint's config.json has "
                        "qk_nope_head_dim=128"),
    ("qk_pos_emb_head_dim", 32, "model.deepseekv3_671b.qk_pos_emb_head_dim: is 32 but the checkpoint's config.json "
                                "has qk_rope_head_dim=64"),
    ("rope_scaling_factor", 4.0, "model.deepseekv3_671b.rope_scaling_factor: is 4.0 but the checkpoint's config.json "
                                 "has rope_scaling.factor=40"),
    ("moe_router_group_topk", 2, "model.deepseekv3_671b.moe_router_group_topk: is 2 but the checkpoint's "
                                 "config.json has topk_group=4"),
    ("moe_router_score_function", "softmax", "model.deepseekv3_671b.moe_router_score_function: is 'softmax' but "
                                             "the checkpoint's config.json has scoring_func='sigmoid'"),
])
def test_a_deepseek_block_that_disagrees_with_the_checkpoint_is_one_error_naming_both(field, value, expected) -> None:
    import json
    from dataclasses import replace

    from mindspeed_rl.config import check_model_block_against_hf

    block = replace(_deepseek().selected_model, **{field: value})
    with pytest.raises(ConfigError) as info:
        check_model_block_against_hf(block, "model.deepseekv3_671b", json.loads(DEEPSEEK_HF.read_text()))
    assert str(info.value).startswith(expected), str(info.value)


def test_an_mla_block_for_a_qwen_checkpoint_and_yarn_for_plain_rope_are_errors() -> None:
    import json

    from mindspeed_rl.config import check_model_block_against_hf

    block = _deepseek().selected_model
    published = json.loads(DEEPSEEK_HF.read_text())
    with pytest.raises(ConfigError, match="multi_latent_attention: is true but the checkpoint's config.json has "
                                          "model_type='qwen3_moe' .without multi-head latent attention"):
        check_model_block_against_hf(block, "model.deepseekv3_671b", {**published, "model_type": "qwen3_moe"})
    plain = {**published, "rope_scaling": None}
    with pytest.raises(ConfigError, match="rope_scaling_type: is 'yarn' but the checkpoint's config.json has no "
                                          "rope_scaling"):
        check_model_block_against_hf(block, "model.deepseekv3_671b", plain)


def test_their_seq_aux_false_is_listed_and_true_is_an_error() -> None:
    notices: list[str] = []
    _deepseek(notices=notices)
    assert any(notice.startswith("model.deepseekv3_671b.seq_aux (") for notice in notices)
    with pytest.raises(ConfigError, match="model.deepseekv3_671b.seq_aux: only False works here"):
        _deepseek("model.deepseekv3_671b.seq_aux=true")


def test_the_planner_sizes_their_deepseek_block_as_the_published_checkpoint() -> None:
    """No config.json of theirs here: the planner reads the block. (`cli/plan.py --config-dir <theirs>
    --config-name grpo_deepseek_r1_671b_A3` prints the whole plan, the switch of 256 ranks included, in ~30 s of
    CPU: too long for the suite.)"""
    import json
    from dataclasses import replace

    from mindspeed_rl.planner.arch import from_hf_config, hf_config_from_model_block
    from mindspeed_rl.planner.params import megatron_params

    config = _deepseek()
    arch = from_hf_config(hf_config_from_model_block(config.selected_model, "deepseekv3_671b"))
    assert arch.trainable and arch.parameter_count() == from_hf_config(json.loads(DEEPSEEK_HF.read_text())).parameter_count()
    stages = config.actor_config.pipeline_stage_layers
    assert stages == (7, 7, 8, 8, 8, 8, 8, 7)
    arch = replace(arch, pipeline_stage_layers=stages)
    tp, ep = config.actor_config.tensor_model_parallel_size, config.actor_config.expert_model_parallel_size
    layers = [{p.name.split(".")[2] for p in megatron_params(arch, tp=tp, tp_rank=0, pp=8, pp_rank=r, ep=ep)
               if p.name.startswith("decoder.layers.")} for r in range(8)]
    assert [len(stage) for stage in layers] == list(stages)


def test_strict_keys_makes_every_knob_an_error() -> None:
    notices: list[str] = []
    load_recipe("grpo_qwen3_8b_A3", notices=notices)
    with pytest.raises(ConfigError) as info:
        load_recipe("grpo_qwen3_8b_A3", "runtime.strict_keys=true")
    errors = info.value.all()
    assert len(errors) == len(notices)
    assert all("no effect on this engine" in error.message for error in errors)


def load_tiny(*overrides: str, notices: list[str] | None = None) -> GRPOConfig:
    return load_config(compose_cfg(TINY, [as_upsert(override) for override in overrides]), notices=notices)


@pytest.mark.parametrize("override, expected", [
    ("rl_config.use_kl_in_reward=true", "rl_config.use_kl_in_reward: only False works here"),
])
def test_a_knob_value_that_would_change_the_result_is_an_error(override: str, expected: str) -> None:
    with pytest.raises(ConfigError, match=f"^{expected}"):
        load_tiny(override)


def test_a_harmless_value_is_accepted_and_listed() -> None:
    notices: list[str] = []
    load_tiny("megatron_training.reset_attention_mask=true", "rl_config.hccl_buffersize=256", notices=notices)
    assert [notice.split(" ", 1)[0] for notice in notices] == ["megatron_training.reset_attention_mask",
                                                               "rl_config.hccl_buffersize"]


def test_every_rl_config_key_of_their_transfer_dock_and_their_unread_verifier_timeout_is_listed() -> None:
    """MindSpeed-RL's rl_config (config_cls/rl_config.py) has eleven `*_dispatch_size` keys and a `verifier_timeout`
    nothing of theirs reads; a recipe may carry any of them."""
    steps = ("actor_rollout", "actor_logprob", "ref", "reward", "dynamic_sampling", "adv", "actor_update",
             "critic_update", "critic_value", "kl", "actor_image_embeds")
    keys = [f"rl_config.{step}_dispatch_size" for step in steps] + ["rl_config.verifier_timeout"]
    notices: list[str] = []
    load_tiny(*[f"{key}=4" for key in keys], notices=notices)
    assert sorted(notice.split(" ", 1)[0] for notice in notices) == sorted(keys)


def test_a_model_block_megatron_key_that_disagrees_is_an_error() -> None:
    with pytest.raises(ConfigError, match="model.tiny_qwen2.attention_softmax_in_fp32: is False but megatron_training"):
        load_tiny("model.tiny_qwen2.attention_softmax_in_fp32=false")


def test_enable_expert_parallel_must_agree_with_the_inference_ep() -> None:
    assert load_tiny("generate_config.enable_expert_parallel=false").generate_config.enable_expert_parallel is False
    with pytest.raises(ConfigError, match="generate_config.enable_expert_parallel: is True but infer_expert_parallel"):
        load_tiny("generate_config.enable_expert_parallel=true")


def test_every_no_effect_key_says_why_values_memory_and_files_are_unchanged_or_how_they_differ() -> None:
    from mindspeed_rl.config.no_effect import DIFFERS, SAME

    for key, entry in NO_EFFECT_KEYS.items():
        assert entry.why, key
        for reason in (entry.memory, entry.files):
            assert reason.startswith((SAME, DIFFERS)) and len(reason) > len(DIFFERS) + 10, (key, reason)


def test_a_no_effect_key_whose_memory_differs_from_theirs_says_so_in_the_start_line() -> None:
    notices: list[str] = []
    load_tiny("megatron_training.reuse_fp32_param=true", "megatron_training.init_method_std=0.01", notices=notices)
    init, reuse = notices  # in the table's order
    assert reuse.startswith("megatron_training.reuse_fp32_param (an NPU memory optimisation; the values computed are "
                            "the same; memory: MindSpeed keeps the fp32 masters and the bf16 params in one buffer")
    assert init == "megatron_training.init_method_std (weights come from the HF checkpoint; nothing is initialised)"


def test_their_uneven_pipeline_recipe_keeps_its_stages_and_the_planner_reads_them() -> None:
    """grpo_qwen25_32b_A3 gives its 4 stages 16, 17, 16 and 15 of Qwen2.5-32B's 64 layers."""
    from mindspeed_rl.planner.arch import from_hf_config, hf_config_from_model_block
    from mindspeed_rl.planner.from_config import plan_inputs
    from mindspeed_rl.planner.params import megatron_params

    config = load_recipe("grpo_qwen25_32b_A3", "runtime.device=cpu")
    assert config.actor_config.pipeline_stage_layers == (16, 17, 16, 15)
    arch = from_hf_config(hf_config_from_model_block(config.selected_model, "qwen25_32b"))
    inputs = plan_inputs(config, arch, device="npu")
    layers = [{p.name.split(".")[2] for p in megatron_params(inputs.arch, tp=4, tp_rank=0, pp=4, pp_rank=rank)
               if p.name.startswith("decoder.layers.")} for rank in range(4)]
    assert [len(stage) for stage in layers] == [16, 17, 16, 15]


def test_their_dapo_recipes_have_no_reference_as_their_dapo_trainer() -> None:
    """MindSpeed-RL's DAPO trainer computes no reference log-probs: init_kl_coef unset means 0 under ray_dapo."""
    config = load_recipe("dapo_qwen25_32b_A3", "runtime.device=npu")
    assert (config.rl_config.init_kl_coef, config.uses_reference) == (0.0, False)
    assert load_recipe("dapo_qwen25_32b_A3", "runtime.device=npu", "rl_config.init_kl_coef=0.02").uses_reference


def test_their_long_context_recipes_keep_context_parallelism_and_the_planner_splits_the_budget() -> None:
    """dapo_qwen25_32b_A3_32k: TP8 x PP2 x CP2 on 64 devices, packed micro-batches of 32768 update tokens."""
    from mindspeed_rl.planner.arch import from_hf_config, hf_config_from_model_block
    from mindspeed_rl.planner.from_config import plan_inputs

    config = load_recipe("dapo_qwen25_32b_A3_32k", "runtime.device=npu")
    assert (config.actor_config.context_parallel_size, config.train_data_parallel_size) == (2, 2)
    inputs = plan_inputs(config, from_hf_config(hf_config_from_model_block(config.selected_model, "qwen25_32b")),
                         device="npu")
    assert (inputs.cp, inputs.dp, inputs.tokens_per_micro_batch) == (2, 2, 32768 // 2)


def test_their_multi_turn_recipe_keeps_its_tool_use(monkeypatch) -> None:
    """Their ReTool recipe names ./configs/tools/retool_config.yaml, relative to where a run starts (the repository
    root for them and here: configs/tools/retool_config.yaml is theirs, unchanged)."""
    from mindspeed_rl.tools.registry import load_tools

    monkeypatch.chdir(Path(__file__).resolve().parents[1])
    notices: list[str] = []
    config = load_recipe("dapo_qwen25_7b_A2_multi_turn", "runtime.device=npu", notices=notices)
    rl = config.rl_config
    assert rl.multi_turn_enable and rl.verifier_function == ["retool_reward"] and not config.uses_reference
    assert (rl.max_tool_calls, rl.max_parallel_calls, rl.max_total_response_length, rl.max_tool_response_length,
            rl.tool_response_truncate_side, rl.tool_parser_format) == (1, 1, 2048, 256, "middle", "hermes")
    assert config.response_length_limit == 2048
    assert "rl_config.async_engine" in {notice.split(" ", 1)[0] for notice in notices}
    assert type(load_tools(rl.tool_config_path)["code_interpreter"]).__name__ == "ReTool"


def test_their_self_contradicting_recipe_runs_as_theirs_does_with_one_warning() -> None:
    """Their A2 DeepSeek recipe asks for 8196 prompt + 2048 response tokens in a 10240-token model length and
    packing budget: MindSpeed-RL runs it (vLLM ends a response at max_model_len), and so does this engine, saying
    so; every sample then fits the packing budget."""
    from mindspeed_rl.config.tolerated import longest_sample_tokens, warning_lines

    config = load_recipe(CONTRADICTING, "runtime.device=cpu")
    assert longest_sample_tokens(config) == 10240 == config.rl_config.max_packing_token_size
    assert [line for line in warning_lines(config) if line.startswith("[config] warning")] == [
        "[config] warning: rl_config.max_prompt_length + generate_config.sampling_config.max_tokens = 8196 + 2048 = "
        "10244 exceeds generate_config.max_model_len=10240: prompts longer than 8192 tokens get a response budget of "
        "max_model_len - prompt (vLLM ends them there, as in MindSpeed-RL)"]


def test_their_lora_recipe_lists_ccloras_fusion_as_having_no_effect() -> None:
    notices: list[str] = []
    config = load_recipe("grpo_lora_qwen25_32b_A2", "runtime.device=cpu", notices=notices)
    assert config.actor_config.uses_lora and (config.actor_config.lora_r, config.actor_config.lora_alpha) == (128, 128)
    assert "actor_config.lora_fusion" in {notice.split(" ", 1)[0] for notice in notices}
