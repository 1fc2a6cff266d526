"""ROLL's resource keys (device_mapping, num_gpus_per_worker, world_size, num_gpus_per_node) and
MindSpeed-RL's integrated keys on one model (mindspeed_rl/config/resources.py): the safe parser, the
seed's arithmetic on every example of roll_resource_config.md, its errors, and what the engine refuses
as not supported yet.

Runs where: in-process, config only (Hydra composition of the shipped YAMLs); ~5 s.
"""
import builtins
import sys
from pathlib import Path

import pytest

from mindspeed_rl.config import ConfigError
from mindspeed_rl.config.device_mapping import format_devices, parse_device_mapping
from mindspeed_rl.config.resources import COLOCATED, DISAGGREGATED, build_resource_plan
from mindspeed_rl.config.role_sections import (
    ActorInferResources,
    ActorTrainResources,
    ReferenceResources,
    RewardResources,
    role_resources,
)
from mindspeed_rl.config.supported import check_supported

sys.path.insert(0, str(Path(__file__).resolve().parent))
from test_config import QWEN_7B, TINY, config_error, load  # noqa: E402

KEY = "actor_train.device_mapping"


def plan(*, train=None, infer=None, reference=None, rewards=None, num_gpus_per_node=None, num_npus=None,
         integrated=True, tp=1, pp=1, infer_gpus=None):
    """A plan from role sections given as device_mapping values (None: the section is left out)."""
    return build_resource_plan(
        actor_train=ActorTrainResources(device_mapping=train) if train is not None else None,
        actor_infer=(ActorInferResources(device_mapping=infer, num_gpus_per_worker=infer_gpus)
                     if infer is not None else None),
        reference=ReferenceResources(device_mapping=reference) if reference is not None else None,
        rewards=rewards or {}, num_gpus_per_node=num_gpus_per_node, num_npus=num_npus,
        use_integrated_worker=integrated, infer_tensor_parallel_size=tp, infer_pipeline_parallel_size=pp)


# --- the parser --------------------------------------------------------------------------------------


@pytest.mark.parametrize("text,devices", [
    ("list(range(0,16))", list(range(16))),                 # the seed's form
    ("list(range(16,24))", list(range(16, 24))),
    ("[0,1,2,3]", [0, 1, 2, 3]),
    ("range(4,8)", [4, 5, 6, 7]),
    ("range(8)", list(range(8))),
    ("range(0,16,2)", list(range(0, 16, 2))),
    ("list(range(7,3,-1))", [7, 6, 5, 4]),
    (" list( range( 0 , 4 ) ) + [6, 7] ", [0, 1, 2, 3, 6, 7]),
    ("[0,1] + list(range(2,4)) + [8]", [0, 1, 2, 3, 8]),
    ("list([3, 1])", [3, 1]),
    ([0, 1, 2, 3], [0, 1, 2, 3]),                            # a YAML list
])
def test_accepted_forms(text, devices) -> None:
    assert parse_device_mapping(text, KEY) == tuple(devices)


def test_parsing_never_evaluates(monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(*args, **kwargs):
        raise AssertionError("eval/exec called")

    monkeypatch.setattr(builtins, "eval", refuse)
    monkeypatch.setattr(builtins, "exec", refuse)
    assert parse_device_mapping("list(range(0,4)) + [5]", KEY) == (0, 1, 2, 3, 5)


@pytest.mark.parametrize("text", [
    "__import__('os').system('touch pwned')",
    "list(__import__('os').system('touch pwned') for _ in [0])",
    "[__import__('os').system('touch pwned')]",
    "range(__import__('os').system('touch pwned'))",
    "open('pwned', 'w').write('x')",
    "exec(\"open('pwned','w')\")",
    "eval('[0]')",
    "(lambda: open('pwned', 'w'))()",
    "[i for i in range(4)]",
    "list(map(int, '0123'))",
    "range.__class__",
    "[0, 1][0:1]",
    "range(0,4) + [4]",          # a TypeError in Python, so not a mapping either
    "[0] * 8",
    "(0, 1)",
    "{0, 1}",
    "range(0, 10 ** 9)",
    "range(0, 100000000)",        # far more devices than any cluster
    "range(x)",
    "range(0, 4, 0)",
    "list(range(0,4), 1)",
    "range(start=0, stop=4)",
    "[0.5]",
    "[True]",
    "f'{0}'",
    "0,1,2",
    "[0,1",
    "",
    "[]",
    "[0, 0]",
    "[-1]",
    "[" * 5000 + "]" * 5000,
    "[" + ",".join(["0"] * 3000) + "]",
])
def test_anything_else_is_refused_with_the_key_and_runs_nothing(text, tmp_path, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ConfigError) as info:
        parse_device_mapping(text, KEY)
    assert info.value.key == KEY
    assert list(tmp_path.iterdir()) == []  # no file appeared: nothing was run


def test_the_injection_string_is_refused_at_load_and_leaves_no_file(tmp_path, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)
    message = config_error(TINY, "+actor_train.device_mapping=\"__import__('os').system('touch pwned')\"")
    assert message.startswith("actor_train.device_mapping: cannot read \"__import__('os').system('touch pwned')\": "
                              "only range() and list() may be called; expected a list of device indices")
    assert message.endswith("(the string is parsed, never run)")
    assert not (tmp_path / "pwned").exists() and not (Path.cwd() / "pwned").exists()
    assert list(tmp_path.iterdir()) == []


def test_refusals_say_what_is_accepted() -> None:
    with pytest.raises(ConfigError, match=r"list\(range\(0,16\)\)"):
        parse_device_mapping("eval('[0]')", KEY)
    with pytest.raises(ConfigError, match=r"lists device 0 twice"):
        parse_device_mapping("[0, 0]", KEY)
    with pytest.raises(ConfigError, match=r"did you mean \[4\] or range\(4\)"):
        parse_device_mapping(4, KEY)
    with pytest.raises(ConfigError, match=r"device indices must be >= 0, got -1"):
        parse_device_mapping([0, -1], KEY)


def test_format_devices() -> None:
    assert format_devices(tuple(range(16))) == "0-15"
    assert format_devices((0, 1, 2, 3, 6, 7, 9)) == "0-3,6,7,9"
    assert format_devices(()) == "cpu"


def _rows(table: str) -> list[str]:
    return [" ".join(line.split()) for line in table.splitlines()]


# --- the seed's arithmetic: world_size = len(device_mapping) // num_gpus_per_worker -------------------


def test_seed_actor_train_sixteen_devices_sixteen_workers() -> None:
    role = role_resources("actor_train", device_mapping="list(range(0,16))", gpus_per_worker=1)
    assert (role.devices, role.num_gpus_per_worker, role.world_size) == (tuple(range(16)), 1, 16)


def test_seed_actor_infer_two_devices_per_worker_on_twelve_devices_is_six_workers() -> None:
    role = role_resources("actor_infer", device_mapping="list(range(0,12))", num_gpus_per_worker=2)
    assert (role.num_gpus_per_worker, role.world_size) == (2, 6)
    assert role.worker_devices() == [(0, 1), (2, 3), (4, 5), (6, 7), (8, 9), (10, 11)]
    # The vLLM role's value is computed as TP x PP; the seed's TP2 x PP1 gives its 2.
    infer = plan(train="list(range(0,16))", infer="list(range(0,12))", infer_gpus=2, tp=2).role("actor_infer")
    assert (infer.num_gpus_per_worker, infer.world_size) == (2, 6)


def test_seed_cpu_only_reward_role_with_world_size_eight() -> None:
    role = RewardResources(world_size=8).resources("rewards.code_sandbox")
    assert (role.devices, role.num_gpus_per_worker, role.world_size, role.cpu_only) == ((), 0, 8, True)


def test_seed_full_example_plans_partly_shared_devices_and_is_refused_today() -> None:
    # num_gpus_per_node 8; actor_train [0,16); actor_infer [0,12) two per worker; code_sandbox 8 CPU workers.
    rewards = {"code_sandbox": RewardResources(world_size=8)}
    seed = plan(train="list(range(0,16))", infer="list(range(0,12))", infer_gpus=2, tp=2, rewards=rewards,
                num_gpus_per_node=8)
    assert [(r.key, r.world_size, r.num_gpus_per_worker) for r in seed.roles] == [
        ("actor_train", 16, 1), ("actor_infer", 6, 2), ("reference", 16, 1), ("rewards.code_sandbox", 8, 0)]
    assert (seed.mode, seed.cluster_size, seed.num_nodes, seed.world_size) == (COLOCATED, 16, 2, 16)
    roles = seed.device_roles()
    assert roles[0] == roles[11] == ["actor_train", "actor_infer", "reference"]
    assert roles[12] == roles[15] == ["actor_train", "reference"]
    table = seed.table("cuda")
    assert "colocated: actor_train and actor_infer take turns on device(s) 0-11" in table
    assert "(16 cuda device(s), 2 node(s) of num_gpus_per_node=8)" in table
    rows = _rows(table)
    assert "0-7 0 actor_train, actor_infer, reference" in rows
    assert "8-11 1 actor_train, actor_infer, reference" in rows
    assert "12-15 1 actor_train, reference" in rows
    assert "cpu-only rewards.code_sandbox (8 worker(s))" in rows
    assert "actor_infer 0-11 2 6 actor_infer.device_mapping" in rows
    with pytest.raises(ConfigError) as info:
        check_supported(seed, rewards)
    assert info.value.key == "actor_infer.device_mapping"
    assert "must be actor_train's devices (0-15) today, got 0-11" in info.value.message


def test_seed_colocated_example_shares_zero_to_eight() -> None:
    colocated = plan(train="list(range(0,8))", infer="list(range(0,8))")
    assert colocated.mode == COLOCATED
    assert all(roles == ["actor_train", "actor_infer", "reference"] for roles in colocated.device_roles().values())
    check_supported(colocated, {})  # what the engine runs
    # The same layout through the whole config: the 7B recipe on 8 devices in ROLL's keys.
    config = load(QWEN_7B, "rl_config.actor_resource.num_npus=8", '+actor_train.device_mapping="list(range(0,8))"',
                  '+actor_infer.device_mapping="list(range(0,8))"', "+num_gpus_per_node=8")
    assert config.world_size == 8 and config.resource_plan.mode == COLOCATED
    assert "0-7 0 actor_train, actor_infer, reference" in _rows(config.resource_plan.table("npu"))


def test_seed_disaggregated_example_zero_to_four_and_four_to_eight() -> None:
    disaggregated = plan(train="list(range(0,4))", infer="list(range(4,8))", reference="list(range(0,4))",
                         integrated=False)
    assert disaggregated.mode == DISAGGREGATED and disaggregated.cluster_size == 8
    assert disaggregated.device_roles()[0] == ["actor_train", "reference"]
    assert disaggregated.device_roles()[4] == ["actor_infer"]
    assert "disaggregated: actor_train on device(s) 0-3, actor_infer on device(s) 4-7" in disaggregated.table()
    check_supported(disaggregated, {})  # what the engine runs: training ranks first, inference ranks after


def test_the_disaggregated_example_yaml_loads_with_two_rank_sets() -> None:
    config = load("examples/grpo_qwen25_7b_disaggregated")
    assert config.disaggregated and config.world_size == 4 and config.infer_world_size == 4
    assert config.num_rank_processes == 8 and config.infer_data_parallel_size == 4


def test_one_step_off_policy_runs_disaggregated() -> None:
    assert load("grpo_tiny_cpu_disaggregated", "async_generation_ratio=1").rollout_staleness == 1
    assert load("examples/grpo_qwen25_7b_disaggregated").rollout_staleness == 1
    assert load("grpo_tiny_cpu_disaggregated").rollout_staleness == 0


def test_one_step_off_policy_refuses_an_evaluation_between_updates() -> None:
    """The next rollout runs on the inference ranks during an update: an evaluation then would be a second one."""
    async_run = ("grpo_tiny_cpu_disaggregated", "async_generation_ratio=1", "megatron_training.train_iters=4")
    assert config_error(*async_run, "rl_config.eval_interval=2") == (
        "rl_config.eval_interval: is 2: an evaluation between updates needs the inference ranks, where one-step "
        "off-policy (async_generation_ratio: 1) runs the next rollout then; set 0 or >= "
        "megatron_training.train_iters=4 (eval_before_train evaluates before the first update), or "
        "async_generation_ratio: 0")
    for evaluated in (("rl_config.eval_interval=4",), ("rl_config.eval_before_train=true",)):  # none runs ahead then
        assert load(*async_run, *evaluated).rollout_staleness == 1
    assert load("grpo_tiny_cpu_disaggregated", "rl_config.eval_interval=2").rl_config.eval_interval == 2


def test_one_step_off_policy_is_refused_colocated() -> None:
    message = config_error("grpo_tiny_cpu", "+async_generation_ratio=1")
    assert message.startswith("async_generation_ratio: 1 overlaps the rollout with the update on other devices")


def test_only_one_step_off_policy_is_supported() -> None:
    message = config_error("grpo_tiny_cpu_disaggregated", "async_generation_ratio=2")
    assert message == ("async_generation_ratio: must be 0 (synchronous) or 1 (one-step off-policy: the next rollout "
                       "overlaps this update), got 2.0")


def test_disaggregated_inference_devices_must_follow_the_training_devices() -> None:
    gap = plan(train="list(range(0,4))", infer="list(range(5,9))", reference="list(range(0,4))", integrated=False)
    with pytest.raises(ConfigError) as info:
        check_supported(gap, {})
    assert info.value.key == "actor_infer.device_mapping"
    assert info.value.message.startswith("must be the devices after actor_train's, list(range(4,8)), got 5-8")


def test_disaggregated_reference_must_be_on_the_training_devices() -> None:
    on_infer = plan(train="list(range(0,2))", infer="list(range(2,4))", reference="list(range(2,4))",
                    integrated=False)
    with pytest.raises(ConfigError) as info:
        check_supported(on_infer, {})
    assert info.value.key == "reference.device_mapping"
    assert "must be actor_train's devices (0,1) today, got 2,3" in info.value.message


# --- the seed's errors -------------------------------------------------------------------------------


def test_not_divisible_by_num_gpus_per_worker() -> None:
    with pytest.raises(ConfigError) as info:
        plan(train="list(range(0,8))", infer="list(range(0,7))", tp=2)
    assert str(info.value) == ("actor_infer.device_mapping: lists 7 devices, not divisible by num_gpus_per_worker=2 "
                               "(world_size = len(device_mapping) // num_gpus_per_worker)")
    with pytest.raises(ConfigError, match="rewards.rm.device_mapping: lists 6 devices, not divisible by "
                                          "num_gpus_per_worker=4"):
        RewardResources(device_mapping="range(6)", num_gpus_per_worker=4).resources("rewards.rm")


def test_indices_beyond_the_cluster() -> None:
    seed = plan(train="list(range(0,16))", infer="list(range(16,24))", num_gpus_per_node=8)
    assert seed.cluster_size == 24 and seed.num_nodes == 3
    seed.check_cluster(24)
    with pytest.raises(ConfigError) as info:
        seed.check_cluster(16, what="GPU in the Ray cluster")
    assert str(info.value) == ("actor_infer.device_mapping: names device 23, beyond the cluster: it has 16 GPU in the "
                               "Ray cluster (indices 0..15), the mappings need 24")
    with pytest.raises(ConfigError, match=r"num_gpus_per_node=8 x 2 node\(s\) = 16 devices"):
        seed.check_cluster(32, num_nodes=2)


def test_the_trainer_checks_the_running_cluster(monkeypatch: pytest.MonkeyPatch) -> None:
    import ray

    monkeypatch.setattr(ray, "cluster_resources", lambda: {"CPU": 2.0, "GPU": 4.0})
    monkeypatch.setattr(ray, "nodes", lambda: [{"Alive": True}])
    load(QWEN_7B, "rl_config.actor_resource.num_npus=4", "actor_config.pipeline_model_parallel_size=1",
         "megatron_training.sequence_parallel=false").resource_plan.check_ray_cluster("cuda")
    with pytest.raises(ConfigError, match=r"rl_config.actor_resource.num_npus: names device 15, beyond the cluster: "
                                          r"it has 4 GPU in the Ray cluster"):
        load(QWEN_7B).resource_plan.check_ray_cluster("cuda")


def test_shared_devices_where_the_config_says_disaggregated() -> None:
    with pytest.raises(ConfigError) as info:
        plan(train="list(range(0,8))", infer="list(range(4,12))", integrated=False)
    assert str(info.value) == (
        "actor_infer.device_mapping: shares devices 4-7 with actor_train (actor_train.device_mapping), but "
        "rl_config.use_integrated_worker=false says the roles run disaggregated, each on its own devices: make the "
        "mappings disjoint, or set it true to colocate them")
    message = config_error(QWEN_7B, "rl_config.use_integrated_worker=false", "~rl_config.actor_resource",
                           '+actor_train.device_mapping="list(range(0,8))"', "+actor_infer.device_mapping=[0,1]")
    assert message.startswith("actor_infer.device_mapping: shares devices 0,1 with actor_train")


def test_vllm_num_gpus_per_worker_must_be_infer_tp_times_pp() -> None:
    assert config_error(QWEN_7B, "+actor_infer.num_gpus_per_worker=2") == (
        "actor_infer.num_gpus_per_worker: must be generate_config.infer_tensor_parallel_size * "
        "infer_pipeline_parallel_size = 1 * 1 = 1 (vLLM's devices per worker) (or left out), got 2")
    message = config_error(QWEN_7B, "generate_config.infer_tensor_parallel_size=2",
                           '+actor_infer.device_mapping="list(range(0,16))"', "+actor_infer.num_gpus_per_worker=4")
    assert message.startswith("actor_infer.num_gpus_per_worker: must be generate_config.infer_tensor_parallel_size * "
                              "infer_pipeline_parallel_size = 2 * 1 = 2")
    # Left out, it is computed: TP2 on 16 devices is 8 vLLM workers.
    config = load(QWEN_7B, "generate_config.infer_tensor_parallel_size=2")
    infer = config.resource_plan.role("actor_infer")
    assert (infer.num_gpus_per_worker, infer.world_size) == (2, 8) == (2, config.infer_data_parallel_size)


def test_training_roles_have_one_device_per_worker() -> None:
    assert config_error(TINY, "+actor_train.device_mapping=[0]", "+actor_train.num_gpus_per_worker=2") == (
        "actor_train.num_gpus_per_worker: must be 1 (a training role has one device per worker) (or left out), got 2")
    assert config_error(TINY, "+reference.device_mapping=[0]", "+reference.num_gpus_per_worker=0").startswith(
        "reference.num_gpus_per_worker: must be 1")


def test_a_stated_world_size_must_agree() -> None:
    assert config_error(QWEN_7B, '+actor_train.device_mapping="list(range(0,16))"', "+actor_train.world_size=8") == (
        "actor_train.world_size: must equal len(device_mapping) // num_gpus_per_worker = 16 // 1 = 16 "
        "(or be left out), got 8")
    load(QWEN_7B, '+actor_train.device_mapping="list(range(0,16))"', "+actor_train.world_size=16")


def test_world_size_alone_is_for_cpu_only_roles() -> None:
    assert config_error(TINY, "+actor_train.world_size=1") == (
        "actor_train.device_mapping: missing: actor_train runs on devices; world_size alone describes a CPU-only "
        "role (rewards.<name>)")
    assert config_error(TINY, "+rewards.rule.world_size=2", "+rewards.rule.num_gpus_per_worker=1").startswith(
        "rewards.rule.num_gpus_per_worker: must be 0 (or left out) for a CPU-only role")
    assert config_error(TINY, "+rewards.rule.world_size=-1") == "rewards.rule.world_size: must be >= 0, got -1"
    assert config_error(TINY, "+rewards.rule.num_gpus_per_worker=0") == (
        "rewards.rule: needs device_mapping (devices) or world_size (CPU-only workers)")


def test_a_worker_stays_on_one_node() -> None:
    with pytest.raises(ConfigError) as info:
        plan(train="list(range(0,16))", infer="list(range(7,15))", tp=2, num_gpus_per_node=8)
    assert str(info.value).startswith("actor_infer.device_mapping: worker 0 spans nodes [0, 1]: its devices 7,8 cross "
                                      "a node boundary (num_gpus_per_node=8)")
    assert config_error(TINY, "+num_gpus_per_node=0") == "num_gpus_per_node: must be >= 1, got 0"


# --- MindSpeed-RL's integrated keys on the same model -----------------------------------------------


def test_integrated_keys_map_every_role_onto_the_actor_devices() -> None:
    config = load(QWEN_7B)  # use_integrated_worker true, actor_resource.num_npus 16, no role sections
    resource_plan = config.resource_plan
    assert resource_plan.mode == COLOCATED and resource_plan.world_size == config.world_size == 16
    for key in ("actor_train", "actor_infer", "reference"):
        role = resource_plan.role(key)
        assert role.devices == tuple(range(16)) and role.source == "rl_config.actor_resource.num_npus"
    assert "colocated: actor_train and actor_infer take turns on device(s) 0-15 (16 npu device(s))" in \
        resource_plan.table("npu")


def test_the_roll_mapping_alone_sets_the_world_size() -> None:
    config = load(TINY, "~rl_config.actor_resource", "+actor_train.device_mapping=[0]")
    assert config.world_size == 1 and config.rl_config.actor_resource.num_npus == 1
    assert config.resource_plan.role("actor_train").source == "actor_train.device_mapping"
    two = load("grpo_tiny_cpu_tp2_infer_dp2", "~rl_config.actor_resource", "+actor_train.device_mapping='range(2)'")
    assert (two.world_size, two.train_data_parallel_size, two.infer_data_parallel_size) == (2, 1, 2)


def test_both_keys_disagreeing_is_an_error_naming_both() -> None:
    assert config_error(QWEN_7B, '+actor_train.device_mapping="list(range(0,8))"') == (
        "actor_train.device_mapping: gives 8 training ranks (0-7) but rl_config.actor_resource.num_npus=16: both set "
        "the actor's world size; make them agree or remove one")
    assert config_error(TINY, "~rl_config.actor_resource") == (
        "rl_config.actor_resource.num_npus: missing: set it (MindSpeed-RL: the actor's ranks) or "
        "actor_train.device_mapping (ROLL)")


def test_the_colocated_roles_example_loads_and_equals_the_demo() -> None:
    roles, demo = load("grpo_tiny_cpu_colocated_roles"), load(TINY)
    assert roles.world_size == demo.world_size == 1
    resource_plan = roles.resource_plan
    assert resource_plan.mode == COLOCATED
    assert [(r.key, r.devices, r.world_size) for r in resource_plan.roles] == [
        ("actor_train", (0,), 1), ("actor_infer", (0,), 1), ("reference", (0,), 1), ("rewards.rule", (), 2)]
    assert roles.rewards["rule"].world_size == 2
    for section in ("megatron_training", "actor_config", "generate_config", "synthetic_data", "runtime"):
        assert getattr(roles, section) == getattr(demo, section)


# --- what the engine does not run yet ---------------------------------------------------------------


def test_devices_other_than_zero_to_n_are_not_supported_yet() -> None:
    assert config_error(TINY, "~rl_config.actor_resource", "+actor_train.device_mapping='range(4,5)'",
                        "+actor_infer.device_mapping='range(4,5)'", "+reference.device_mapping=[4]") == (
        "actor_train.device_mapping: must be list(range(0,1)) today, got 4: the engine starts its 1 ranks on the "
        "devices Ray gives it; choosing which devices is not supported yet")


def test_a_reference_on_other_devices_is_not_supported_yet() -> None:
    message = config_error(QWEN_7B, '+reference.device_mapping="list(range(16,32))"')
    assert message.startswith("reference.device_mapping: must be actor_train's devices (0-15) today, got 16-31")


def test_a_gpu_reward_role_is_parsed_and_checked_first() -> None:
    # The arithmetic runs first: a reward role on devices is parsed and checked, then judged (a rule role
    # is refused there; reward models: tests/test_reward_model_config.py).
    assert config_error(TINY, "+rewards.rm.device_mapping='range(3)'", "+rewards.rm.num_gpus_per_worker=2").startswith(
        "rewards.rm.device_mapping: lists 3 devices, not divisible by num_gpus_per_worker=2")
    assert config_error(TINY, "+rewards.rm.device_mapping=[0]").startswith(
        "rewards.rm.device_mapping: rule verifiers run on CPU workers (world_size), not on devices")


def test_one_reward_role() -> None:
    assert config_error(TINY, "+rewards.a.world_size=1", "+rewards.b.world_size=1") == (
        "rewards.b: one rule-reward role is supported yet: the verifiers of rl_config.verifier_function run in rewards.a; "
        "per-role verifiers are not supported")
    assert load(TINY, "+rewards.rule.world_size=0").resource_plan.role("rewards.rule").world_size == 0
