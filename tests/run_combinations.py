"""The run-level combinations a user writes at the command line (issue 54), as factors and the overrides each value
adds; `all_pairs` (tests/allpairs.py) makes the cases: every value of every factor meets every value of every other
factor in at least one case. `command(case)` is the entry point, the config name and the overrides of a case.

The factors (MoE with routing replay and the multi-turn tools have configs of their own and their own CLI runs:
test_moe_run_e2e, test_multi_turn_e2e):
- algorithm: GRPO, DAPO (its dynamic sampling and clip-higher), PPO with a colocated critic, PPO with the critic on a
  device of its own;
- placement: colocated, or disaggregated inference (actor_infer on devices apart from actor_train);
- parallel: the training layout on one device, or TP2 / PP2 / CP2 on two;
- one-step off-policy (async_generation_ratio 1), the mismatch ledger, rollout correction (token IS or token_k1
  rejection), LoRA, packing, partial rollout (split 2, cut at chunks or run-ahead), the swap optimizer, evaluation,
  a reward model, a device capacity (runtime.device_memory_limit, generous), on-policy distillation (a teacher part, k3: on the training ranks,
  or on a device of its own after every other role's).
"""
from __future__ import annotations

from functools import lru_cache

from allpairs import all_pairs_where
from cli_runner import REPO

STUDENT_CHECKPOINT = "STUDENT_CHECKPOINT"
FACTORS: dict[str, list] = {
    "algorithm": ["grpo", "dapo", "ppo", "ppo_own_critic"],
    "parallel": ["one", "tp2", "pp2", "cp2"],
    "placement": ["colocated", "disaggregated"],
    "correction": ["none", "is", "rs"],
    "off_policy": [False, True],
    "ledger": [False, True],
    "lora": [False, True],
    "packing": [False, True],
    "partial_rollout": [False, "split", "run_ahead"],
    "swap_optimizer": [False, True],
    "evaluation": [False, True],
    "reward_model": [False, True],
    "capacity": [False, True],
    "distillation": [False, True, "own_devices"],
}
SCRIPTS = {"grpo": "cli/train_grpo.py", "dapo": "cli/train_dapo.py", "ppo": "cli/train_ppo.py",
           "ppo_own_critic": "cli/train_ppo.py"}
# Small and short: the demo's tiny Qwen2, 2 iterations of 4 prompts x 4 samples.
SHRINK = ("megatron_training.train_iters=2", "megatron_training.global_batch_size=4", "rl_config.mini_batch_size=4",
          "rl_config.n_samples_per_prompt=4", "actor_config.micro_batch_size=4", "runtime.progress_seconds=0",
          # a PPO case with a critic of its own at TP2 beside disaggregated inference has 5 rank processes: 2 cores here
          "runtime.max_ranks_per_cpu_core=3")
# Dynamic sampling keeps prompts whose samples' rewards differ (the untrained demo's exact accuracy rarely does), as many
# rollouts as it takes, 2 prompts an update.
DAPO = ("megatron_training.stage=ray_dapo", "rl_config.filter_groups_enable=true",
        "rl_config.filter_groups_metric=reward", "rl_config.filter_groups_max_batches=-1",
        "rl_config.filter_groups_train_batch_size=2", "rl_config.mini_batch_size=2", "rl_config.clip_ratio_high=0.28")
LAYOUTS = {"one": (), "tp2": ("actor_config.tensor_model_parallel_size=2",),
           "pp2": ("actor_config.pipeline_model_parallel_size=2",),
           "cp2": ("actor_config.context_parallel_size=2", "generate_config.infer_tensor_parallel_size=2")}
# The critic takes the actor's TP and PP (config/critic.py: it shares the actor's parallel groups).
CRITIC_LAYOUTS = {"tp2": ("critic_config.tensor_model_parallel_size=2",),
                  "pp2": ("critic_config.pipeline_model_parallel_size=2",)}
PPO = ("critic_config.micro_batch_size=4",)  # the shrunk mini-batch's 16 samples over up to 2 critic ranks
OPTIONS = {
    "off_policy": ("async_generation_ratio=1",),
    "ledger": ("rl_config.mismatch_ledger=true",),
    "lora": ("actor_config.lora_r=8", "actor_config.lora_alpha=16",
             "actor_config.lora_target_modules=[linear_qkv,linear_proj,linear_fc1,linear_fc2]"),
    "packing": ("rl_config.use_remove_padding=true",),
    "swap_optimizer": ("megatron_training.swap_optimizer=true", "megatron_training.swap_optimizer_times=2",
                       "generate_config.offload_train_optimizer=false"),
    "evaluation": ("rl_config.eval_interval=2",),
    "reward_model": ("rewards.rm.model_path=synthetic", "rewards.rm.weight=0.5"),
    "capacity": ("runtime.device_memory_limit=4GiB",),
    # on-policy distillation, the teacher being the student's own start (the case's generated checkpoint: the test
    # puts its path in place of STUDENT_CHECKPOINT)
    "distillation": ("distillation.enabled=true",
                     f"distillation.teacher_models.teacher_model.model_path={STUDENT_CHECKPOINT}",
                     "distillation.distillation_loss.loss_mode=k3",
                     "distillation.distillation_loss.use_policy_gradient=false"),
}
PARTIAL_ROLLOUTS = {False: (), "split": ("rl_config.partial_rollout_max_split=2",),
                    "run_ahead": ("rl_config.partial_rollout_max_split=2", "rl_config.async_engine=true")}
CORRECTIONS = {"none": (), "is": ("rl_config.rollout_correction.rollout_is=token",
                                  "rl_config.rollout_correction.rollout_is_threshold=2.0"),
               "rs": ("rl_config.rollout_correction.rollout_rs=token_k1",
                      "rl_config.rollout_correction.rollout_rs_threshold=0.5_2.0")}


def cases() -> list[tuple[dict, str | None]]:
    """(case, None where it runs, else the config error lines it is refused with), generated under the config's own
    checks: every pair of values that can run together runs in some case; one that cannot is one refused case."""
    generated = all_pairs_where(FACTORS, lambda case: refusal(_frozen(case)) is None)
    return [(case, refusal(_frozen(case))) for case, _ in generated]


def _frozen(case: dict) -> tuple:
    return tuple(case.items())


@lru_cache(maxsize=None)
def refusal(frozen_case: tuple) -> str | None:
    """The config error lines `load_config` gives the case's command line (the CLI's checks before any worker
    starts), or None where it loads."""
    from hydra import compose, initialize_config_dir

    from mindspeed_rl.config import ConfigError, error_lines, load_config
    from mindspeed_rl.config.overrides import as_upsert

    _, name, overrides = command(dict(frozen_case))
    with initialize_config_dir(config_dir=str(REPO / "configs"), version_base="1.3"):
        cfg = compose(config_name=name, overrides=[as_upsert(override) for override in overrides])
    try:
        load_config(cfg)
    except ConfigError as error:
        return "\n".join(error_lines(error))
    return None


def command(case: dict) -> tuple[str, str, list[str]]:
    """(script, config name, overrides) of `case`."""
    algorithm, two_devices = case["algorithm"], case["parallel"] != "one"
    overrides = [*SHRINK, *(DAPO if algorithm == "dapo" else ()), *LAYOUTS[case["parallel"]],
                 *((*PPO, *CRITIC_LAYOUTS.get(case["parallel"], ())) if algorithm.startswith("ppo") else ()),
                 *CORRECTIONS[case["correction"]], *PARTIAL_ROLLOUTS[case["partial_rollout"]]]
    overrides += [value for name, values in OPTIONS.items() if case[name] for value in values]
    return SCRIPTS[algorithm], _config_name(case), overrides + _devices(case, two_devices)


def _config_name(case: dict) -> str:
    ppo = case["algorithm"].startswith("ppo")
    if case["placement"] == "disaggregated":
        return "ppo_tiny_cpu_disaggregated" if ppo else "grpo_tiny_cpu_disaggregated"
    if case["algorithm"] == "ppo_own_critic":
        return "ppo_tiny_cpu_critic_devices"
    return "ppo_tiny_cpu" if ppo else "grpo_tiny_cpu"


def _devices(case: dict, two_devices: bool) -> list[str]:
    """The roles' devices: the training layout's 1 or 2, then inference's (its TP's), then a critic of its own (as
    many as the training layout), then a teacher of its own (one: its own layout, TP1)."""
    train = list(range(2 if two_devices else 1))
    own_critic = case["algorithm"] == "ppo_own_critic"
    reward = [f"rewards.rm.device_mapping={_list(train)}"] if case["reward_model"] else []
    if case["placement"] == "colocated" and not own_critic:
        devices, used = [f"rl_config.actor_resource.num_npus={len(train)}", *reward], train
        if case["algorithm"] == "ppo":
            devices.append(f"rl_config.critic_resource.num_npus={len(train)}")
    else:
        infer = train if case["placement"] == "colocated" else \
            list(range(len(train), len(train) + (2 if case["parallel"] == "cp2" else 1)))
        after = max(train + infer) + 1
        critic = list(range(after, after + len(train))) if own_critic else train
        devices = [f"actor_train.device_mapping={_list(train)}", f"actor_infer.device_mapping={_list(infer)}",
                   f"reference.device_mapping={_list(train)}", *reward]
        if case["algorithm"].startswith("ppo"):
            devices.append(f"critic.device_mapping={_list(critic)}")
        used = train + infer + critic
    if case["distillation"] == "own_devices":
        devices.append(f"teacher.device_mapping=[{max(used) + 1}]")
    return devices


def _list(devices: list[int]) -> str:
    return "[" + ",".join(str(device) for device in devices) + "]"
