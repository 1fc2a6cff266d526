"""DPO's keys (config/dpo.py): the demo's and their recipe's values as read, and each value a DPO run cannot take
refused at load with one line naming the key."""
import pytest
from test_config import config_error, load
from test_mindspeed_rl_recipes import load_recipe

DEMO = "dpo_tiny_cpu"

pytestmark = pytest.mark.filterwarnings("ignore:.*Defaults list is missing `_self_`")


def test_the_demo_is_a_dpo_run_with_a_reference_and_nothing_that_generates():
    config = load(DEMO)
    mt = config.megatron_training
    assert (mt.stage, mt.is_pairwise_dataset, mt.dpo_loss_type, mt.dpo_beta) == ("dpo", True, "sigmoid", 0.1)
    assert config.uses_reference and not config.generates


def test_their_recipe_keeps_its_values():
    notices: list[str] = []
    config = load_recipe("dpo_qwen3_30b_a3b_A3", "runtime.device=cpu", notices=notices)
    ac, mt = config.actor_config, config.megatron_training
    assert (ac.tensor_model_parallel_size, ac.pipeline_model_parallel_size, ac.micro_batch_size) == (2, 8, 1)
    assert (ac.lr, ac.min_lr, ac.lr_decay_style, ac.clip_grad, ac.finetune, ac.no_save_optim) == (
        5e-8, 0, "constant", 1.0, True, True)
    assert (mt.dpo_loss_type, mt.ref_model, mt.refer_model_iter) == (
        "sigmoid", "./model_weights/Qwen3-30B-TP2-PP8-EP1/", 1)
    assert config.rl_config.n_samples_per_prompt == 2 and config.rl_config.mini_batch_size == 64
    assert config.world_size == 16  # one replica of TP2 x PP8
    assert any(notice.startswith("megatron_training.tokenizer_not_use_fast (") for notice in notices)


def test_an_actor_config_override_wins_over_their_megatron_training_value():
    config = load_recipe("dpo_qwen3_30b_a3b_A3", "runtime.device=cpu", "actor_config.no_save_optim=false",
                         "rl_config.actor_resource.num_npus=32")
    assert config.actor_config.no_save_optim is False and config.world_size == 32


@pytest.mark.parametrize("override,message", [
    ("megatron_training.dpo_loss_type=orpo",
     "megatron_training.dpo_loss_type: must be one of sigmoid, hinge, ipo, kto_pair, got 'orpo'"),
    ("megatron_training.dpo_beta=0", "megatron_training.dpo_beta: must be > 0 (the DPO temperature), got 0.0"),
    ("megatron_training.is_pairwise_dataset=false",
     "megatron_training.is_pairwise_dataset: must be true with stage dpo"),
    ("rl_config.n_samples_per_prompt=4", "rl_config.n_samples_per_prompt: must be 2 with stage dpo"),
    ("rl_config.shuffle_mini_batch=true", "rl_config.shuffle_mini_batch: must be false with stage dpo"),
    ("runtime.max_restarts=1", "runtime.max_restarts: must be 0 with stage dpo"),
])
def test_values_a_dpo_run_cannot_take_are_refused(override: str, message: str):
    assert message in config_error(DEMO, override)


def test_label_smoothing_needs_the_sigmoid_loss_and_pairs_need_stage_dpo():
    assert "only the sigmoid loss smooths labels" in config_error(
        DEMO, "megatron_training.dpo_loss_type=ipo", "megatron_training.dpo_label_smoothing=0.1")
    assert "pairwise (chosen/rejected) data trains DPO only" in config_error(
        "grpo_tiny_cpu", "+megatron_training.is_pairwise_dataset=true")
