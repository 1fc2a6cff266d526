"""distillation: verl's keys and defaults load, and what a distillation run cannot serve yet is refused at start with
one config error naming the key (config/distillation.py). Runs where: in-process, Hydra compose only."""
import pytest

from mindspeed_rl.memory.residency import TEACHER_LOGPROB, TEACHER_PARAMS, ResidencyPolicy, run_states
from test_config import config_error, load

DEMO = "distill_tiny_cpu"
LOSS = "distillation.distillation_loss"
TEACHER = "distillation.teacher_models.teacher_model"
# ROLL's teacher role on the two devices after the actor's one, in a TP2 layout of its own.
OWN_TEACHER = ("+teacher.device_mapping=[1,2]", f"+{TEACHER}.inference.tensor_model_parallel_size=2")


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


def test_a_teacher_of_its_own_is_a_group_in_its_own_layout_holding_its_params_always():
    from mindspeed_rl.config.distillation import teacher_layout
    from mindspeed_rl.workers import roles
    from mindspeed_rl.workers.parts.teacher import TeacherPart

    config = load(DEMO, *OWN_TEACHER)
    layout = teacher_layout(config)
    assert (layout.train.tp, layout.train.pp, layout.train_world_size, layout.train_dp) == (2, 1, 2, 1)
    assert config.num_rank_processes == 3 and config.layout.train.tp == 1  # the actor's own stays TP1 on 1 rank
    assert TeacherPart not in roles.training_parts(config)
    (teacher_rank, world_size), = roles.own_device_workers(config)
    assert world_size == 2 and teacher_rank.ROLE == "teacher" and teacher_rank.PARTS == (TeacherPart,)
    own = teacher_rank.residency_policy_of(config)  # nothing else on its devices: resident in every phase
    assert TEACHER_PARAMS in own.pinned and all(TEACHER_PARAMS in own.resident(phase) for phase in own.phases())
    actor = roles.actor_worker(config).residency_policy_of(config)
    assert TEACHER_LOGPROB not in actor.phases()


def test_a_run_without_distillation_has_no_teacher_phase():
    config = load("grpo_tiny_cpu")
    assert not config.distills
    assert TEACHER_LOGPROB not in ResidencyPolicy.for_states(config, run_states(config)).phases()


@pytest.mark.parametrize("overrides, key, why", [
    ((f"{LOSS}.use_policy_gradient=false",), f"{LOSS}.loss_mode", "k1 needs use_policy_gradient=true"),
    ((f"{LOSS}.loss_mode=forward_kl_topk",), f"{LOSS}.loss_mode", "with use_policy_gradient=true"),
    ((f"{LOSS}.loss_mode=k5",), f"{LOSS}.loss_mode", "must be one of"),
    (("+distillation.teacher_models.teacher_model.inference.tensor_model_parallel_size=2",),
     "distillation.teacher_models.teacher_model.inference.tensor_model_parallel_size",
     "a layout of its own needs devices of its own"),
    ((f"+{TEACHER}.inference.gpu_memory_utilization=0.5",), f"distillation.teacher_models.<name>.inference."
     "gpu_memory_utilization", "not a vLLM server"),
    (("+teacher.device_mapping=[2,3]",), "teacher.device_mapping", "takes those after the other roles'"),
    (("+teacher.device_mapping=[1,2,3]", f"+{TEACHER}.inference.tensor_model_parallel_size=2"),
     "teacher.device_mapping", "its tensor x pipeline parallel size 2 must divide"),
    (("+teacher.device_mapping=[1,2]", f"+{TEACHER}.num_replicas=1"), f"{TEACHER}.num_replicas",
     "its 2 devices hold 2 replica(s)"),
    (("+teacher.device_mapping=[1,2,3]",), "teacher.device_mapping", "must divide a mini-batch of"),
    (("+distillation.nnodes=1",), "distillation.nnodes", "verl's teacher pool is not read here"),
    (("+distillation.teacher_models.second.model_path=x",), "distillation.teacher_models", "exactly one teacher"),
])
def test_what_distillation_cannot_serve_is_one_config_error(overrides, key, why):
    message = config_error(DEMO, *overrides)
    assert message.startswith(f"{key}:") and why in message, message


def test_a_teacher_role_without_distillation_is_refused():
    message = config_error("grpo_tiny_cpu", "+teacher.device_mapping=[1]")
    assert message.startswith("teacher: a teacher role needs on-policy distillation"), message


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
