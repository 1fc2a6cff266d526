"""PPO's keys (critic_config, rl_config.adv_estimator gae, lam, cliprange_value, use_kl_in_reward, kl_ctrl_type
adaptive): the demo config loads with them, and each inconsistent combination is one `config error` line naming
its key. In the pytest process, config only."""

import pytest

from mindspeed_rl.config import ConfigError
from mindspeed_rl.config.no_effect import no_effect_notice
from tests.test_config import TINY, compose_cfg, load

PPO = "ppo_tiny_cpu"


def test_the_demo_loads_with_a_colocated_critic_and_its_ppo_keys():
    config = load(PPO)
    assert config.critic_config.lr == 1e-3 and config.critic_config.micro_batch_size == 16
    assert (config.rl_config.adv_estimator, config.rl_config.lam, config.rl_config.cliprange_value) == ("gae", 0.95, 0.5)
    assert config.megatron_training.stage == "ray_ppo"


def test_lam_and_use_kl_in_reward_are_read_with_gae_and_listed_as_no_effect_without():
    from mindspeed_rl.config import load_config

    notices: list[str] = []
    load_config(compose_cfg(PPO, ["rl_config.use_kl_in_reward=true"]), notices=notices)
    assert not any(n.startswith(("rl_config.lam", "rl_config.use_kl_in_reward")) for n in notices)
    notices = []
    load_config(compose_cfg(TINY, ["++rl_config.lam=0.9"]), notices=notices)
    assert "rl_config.lam (" in no_effect_notice(notices)


@pytest.mark.parametrize("config_name, overrides, expected", [
    (TINY, ["rl_config.adv_estimator=gae"], "critic_config: adv_estimator gae (PPO) needs a critic_config section"),
    (PPO, ["rl_config.adv_estimator=group_norm"], "rl_config.adv_estimator: adv_estimator gae (PPO) needs"),
    (PPO, ["critic_config.tensor_model_parallel_size=2"],
     "critic_config.tensor_model_parallel_size: must equal actor_config.tensor_model_parallel_size=1"),
    (PPO, ["rl_config.critic_resource.num_npus=4"],
     "rl_config.critic_resource.num_npus: must equal the critic's 2 devices, the actor's devices (colocated"),
    (PPO, ["+critic.device_mapping=[2,3]", "rl_config.critic_resource.num_npus=4"],
     "rl_config.critic_resource.num_npus: must equal the critic's 2 devices, its own devices"),
    (PPO, ["critic_config.model=other"], "critic_config.model: must name a block under `model`"),
    (TINY, ["++rl_config.use_kl_in_reward=true"], "rl_config.use_kl_in_reward: only False works here"),
    (PPO, ["rl_config.kl_ctrl_type=adaptive"], "rl_config.kl_ctrl_type: adaptive moves the coefficient of the KL"),
    (PPO, ["rl_config.kl_ctrl_type=adaptive", "rl_config.use_kl_in_reward=true"],
     "rl_config.kl_target: must be set with kl_ctrl_type adaptive"),
    (PPO, ["rl_config.lam=1.5"], "rl_config.lam: must be in [0, 1]"),
    (TINY, ["+critic.device_mapping=[0]"], "critic: a critic role needs a critic_config section"),
    (PPO, ["+critic.device_mapping=[1,2]"], "critic.device_mapping: must be actor_train's devices (0,1) today"),
    (PPO, ["+critic.device_mapping=[3,4]"],
     "critic.device_mapping: a critic on devices of its own takes those after the other roles', list(range(2,4))"),
    (PPO, ["+critic.device_mapping=[2,3,4,5]", "critic_config.micro_batch_size=48", "rl_config.critic_resource=null"],
     "critic_config.micro_batch_size: the critic's data-parallel size * micro_batch_size = 4 * 48 must divide"),
    (PPO, ["rl_config.cliprange_value=0"], "rl_config.cliprange_value: must be > 0"),
])
def test_an_inconsistent_ppo_config_is_one_error_naming_its_key(config_name, overrides, expected):
    with pytest.raises(ConfigError) as info:
        load(config_name, *overrides)
    assert str(info.value).startswith(expected), str(info.value)


def test_a_critic_on_devices_of_its_own_is_a_rank_group_of_its_own():
    config = load("ppo_tiny_cpu_critic_devices")
    assert config.critic_has_own_devices and config.critic_world_size == 1
    assert config.num_rank_processes == 2 and not config.disaggregated
    assert config.resource_plan.role("critic").devices == (1,)


def test_ROLLs_critic_role_on_the_actors_devices_is_placed_and_listed():
    config = load(PPO, "+critic.device_mapping='list(range(0,2))'")
    plan = config.resource_plan
    assert plan.role("critic").devices == (0, 1)
    assert "critic" in plan.table("cpu")
