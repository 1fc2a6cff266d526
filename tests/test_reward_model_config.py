"""`rewards.<name>.model_path`: a reward model is a colocated role on the actor's devices; every other
placement, and the keys that make no sense with it, are ConfigErrors naming the key. Pure, in-process."""
from test_config import QWEN_7B, TINY, config_error, load

RM = "grpo_tiny_cpu_reward_model"
DISAGGREGATED = "grpo_tiny_cpu_disaggregated"


def test_the_shipped_config_places_the_reward_model_on_the_actors_devices():
    config = load(RM)
    assert config.reward_model[0] == "rm" and config.reward_model[1].model_weight == 0.5
    plan = config.resource_plan
    assert plan.role("rewards.rm").devices == plan.role("actor_train").devices == (0, 1)
    assert plan.device_roles() == {0: ["actor_train", "actor_infer", "reference", "rewards.rm"],
                                   1: ["actor_train", "actor_infer", "reference", "rewards.rm"]}


def test_a_reward_model_without_device_mapping_takes_the_actors_devices():
    config = load(RM, "~rewards.rm.device_mapping", "~rewards.rm.weight")
    assert config.resource_plan.role("rewards.rm").devices == (0, 1)
    assert config.reward_model[1].model_weight == 1.0


def test_a_reward_model_on_other_devices_is_an_error():
    assert config_error(QWEN_7B, "+rewards.rm.model_path=/models/rm",
                        '+rewards.rm.device_mapping="list(range(0,8))"') == (
        "rewards.rm.device_mapping: must be actor_train's devices (0-15) or left out, got 0-7: a reward model runs on "
        "the actor's ranks in its TP/PP layout, taking turns with the other roles")


def test_a_reward_model_on_a_cpu_only_role_is_an_error_naming_world_size():
    assert config_error(TINY, "+rewards.rm.model_path=/models/rm", "+rewards.rm.world_size=1").startswith(
        "rewards.rm.world_size: a reward model (model_path) runs on devices, but world_size=1 without "
        "device_mapping makes a CPU-only role")


def test_two_reward_models_are_an_error():
    assert config_error(RM, "+rewards.rm2.model_path=synthetic") == (
        "rewards.rm2.model_path: one reward model is supported: rewards.rm has one already")


def test_a_reward_model_beside_a_rule_role_is_accepted():
    config = load(RM, "+rewards.rule.world_size=2")
    assert config.reward_model[0] == "rm"
    assert config.resource_plan.role("rewards.rule").cpu_only


def test_a_weight_without_a_model_is_an_error():
    assert config_error(TINY, "+rewards.rule.world_size=2", "+rewards.rule.weight=0.5").startswith(
        "rewards.rule.weight: weights a reward model's score, but the section has no model_path")


def test_a_reward_model_with_several_devices_per_worker_is_an_error():
    assert config_error(RM, "+rewards.rm.num_gpus_per_worker=2").startswith(
        "rewards.rm.num_gpus_per_worker: must be 1 (or left out) for a reward model")


def test_the_generated_reward_model_needs_synthetic_data():
    assert config_error(QWEN_7B, "+rewards.rm.model_path=synthetic").startswith(
        "rewards.rm.model_path: `synthetic` is the demo's generated reward model")


def test_a_reward_model_in_a_disaggregated_run_is_an_error():
    assert config_error(DISAGGREGATED, "+rewards.rm.model_path=synthetic").startswith(
        "rewards.rm.model_path: a reward model runs colocated with actor_train")


def test_an_empty_model_path_is_an_error():
    assert config_error(TINY, "+rewards.rm.model_path=''").startswith("rewards.rm.model_path: must name a checkpoint")


def _start_error(hf_config: dict, tokenizer_size: int = 16, *overrides: str) -> str:
    from mindspeed_rl.config import ConfigError
    from mindspeed_rl.trainer.reward_model import check_reward_model_config

    try:
        check_reward_model_config(load(RM, *overrides), hf_config, "rewards.rm.model_path", tokenizer_size)
    except ConfigError as error:
        return str(error)
    return ""


GOOD = {"architectures": ["Qwen2ForSequenceClassification"], "num_labels": 1, "num_attention_heads": 4,
        "num_key_value_heads": 2, "num_hidden_layers": 2, "vocab_size": 16}


def test_a_checkpoint_the_actors_layout_can_run_passes_the_start_checks():
    assert _start_error(GOOD) == ""


def test_a_causal_lm_checkpoint_is_refused_at_start():
    assert _start_error({**GOOD, "architectures": ["Qwen2ForCausalLM"]}).startswith(
        "rewards.rm.model_path: must be a sequence-classification checkpoint")


def test_more_than_one_label_is_refused_at_start():
    assert _start_error({**GOOD, "num_labels": 2}) == "rewards.rm.model_path: must have num_labels=1 (one scalar " \
                                                       "score), got 2"


def test_heads_the_actors_tp_cannot_split_are_refused_at_start():
    assert _start_error({**GOOD, "num_key_value_heads": 1}).startswith(
        "rewards.rm.model_path: num_key_value_heads=1 is not divisible by actor_config.tensor_model_parallel_size=2")


def test_a_vocabulary_smaller_than_the_actors_tokenizer_is_refused_at_start():
    assert "the actor's tokenizer has 17 tokens" in _start_error(GOOD, 17)


def test_scores_add_to_the_rule_total_times_the_weight():
    import torch

    from mindspeed_rl.data.rewards import RuleRewards
    from mindspeed_rl.trainer.reward_model import with_model_scores

    rule = RuleRewards(total=torch.tensor([1.0, 0.2, 0.0]), per_verifier={"arith_acc": torch.tensor([1.0, 0.2, 0.0])})
    combined = with_model_scores(rule, torch.tensor([0.5, -1.0, 2.0]), 0.5)
    assert combined.total.tolist() == [1.25, -0.30000001192092896, 1.0]
    assert combined.per_verifier is rule.per_verifier
