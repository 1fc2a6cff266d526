"""distillation: verl's keys and defaults load, and what a distillation run cannot serve yet is refused at start with
one config error naming the key (config/distillation.py). Runs where: in-process, Hydra compose only."""
import pytest

from mindspeed_rl.memory.residency import TEACHER_LOGPROB, TEACHER_PARAMS, ResidencyPolicy, run_states
from test_config import config_error, load

DEMO = "distill_tiny_cpu"
LOSS = "distillation.distillation_loss"


def test_the_demo_loads_with_verl_defaults_where_it_sets_nothing():
    config = load(DEMO)
    loss = config.distillation.distillation_loss
    assert config.distills and config.distillation.teacher_name == "teacher_model"
    assert (loss.loss_mode, loss.use_policy_gradient, loss.use_task_rewards) == ("k1", True, True)
    # verl's yaml defaults for what the demo leaves out
    assert (loss.topk, loss.tail_mass_eps, loss.loss_max_clamp, loss.log_prob_min_clamp) == (32, 1e-6, None, None)
    assert config.distillation.nnodes == 0 and config.distillation.teacher_key == "data_source"


def test_a_distillation_run_has_a_teacher_phase_holding_the_teacher_params_alone():
    config = load(DEMO)
    policy = ResidencyPolicy.for_states(config, run_states(config))
    assert TEACHER_LOGPROB in policy.phases()
    assert policy.resident(TEACHER_LOGPROB) == {TEACHER_PARAMS}
    assert all(TEACHER_PARAMS not in policy.resident(phase) for phase in policy.phases() if phase != TEACHER_LOGPROB)


def test_a_run_without_distillation_has_no_teacher_phase():
    config = load("grpo_tiny_cpu")
    assert not config.distills
    assert TEACHER_LOGPROB not in ResidencyPolicy.for_states(config, run_states(config)).phases()


@pytest.mark.parametrize("overrides, key, why", [
    ((f"{LOSS}.use_policy_gradient=false",), f"{LOSS}.loss_mode", "k1 needs use_policy_gradient=true"),
    ((f"{LOSS}.loss_mode=forward_kl_topk",), f"{LOSS}.loss_mode", "with use_policy_gradient=true"),
    ((f"{LOSS}.loss_mode=k5",), f"{LOSS}.loss_mode", "must be one of"),
    (("+distillation.teacher_models.teacher_model.inference.tensor_model_parallel_size=2",),
     "distillation.teacher_models.teacher_model.inference", "in the actor's layout"),
    (("+distillation.nnodes=1",), "distillation.nnodes", "not in a pool of its own"),
    (("+distillation.teacher_models.second.model_path=x",), "distillation.teacher_models", "exactly one teacher"),
])
def test_what_distillation_cannot_serve_is_one_config_error(overrides, key, why):
    message = config_error(DEMO, *overrides)
    assert message.startswith(f"{key}:") and why in message, message


def test_distillation_is_refused_with_a_dpo_run():
    message = config_error("dpo_tiny_cpu", "+distillation.enabled=true",
                           "+distillation.teacher_models.teacher_model.model_path=x")
    assert "config error" not in message and "megatron_training.stage: is dpo: distillation scores" in message, message


def test_the_top_k_losses_load_and_are_refused_under_context_parallelism():
    config = load(DEMO, f"{LOSS}.loss_mode=forward_kl_topk", f"{LOSS}.use_policy_gradient=false", f"+{LOSS}.topk=4")
    assert config.distillation.distillation_loss.uses_topk
    message = config_error(DEMO, f"{LOSS}.loss_mode=forward_kl_topk_tail", f"{LOSS}.use_policy_gradient=false",
                           "actor_config.context_parallel_size=2", "rl_config.actor_resource.num_npus=2")
    assert message.startswith(f"{LOSS}.loss_mode:") and "context parallelism" in message, message


def test_the_tail_mode_refuses_a_log_prob_clamp():
    message = config_error(DEMO, f"{LOSS}.loss_mode=forward_kl_topk_tail", f"{LOSS}.use_policy_gradient=false",
                           f"+{LOSS}.log_prob_min_clamp=-20")
    assert message.startswith(f"{LOSS}.log_prob_min_clamp:") and "must be null" in message, message
