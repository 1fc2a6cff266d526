"""`rl_config`: the GRPO algorithm, batch sizes in prompts/samples, rewards and resources."""

from dataclasses import dataclass, field
from typing import ClassVar, Optional

from mindspeed_rl.config.checks import (
    require_choice,
    require_non_negative,
    require_positive,
)
from mindspeed_rl.config.rollout_correction import RolloutCorrectionConfig
from mindspeed_rl.errors import ConfigError

# group_norm: GRPO (MindSpeed-RL's name); rloo, reinforce_plus_plus and reinforce_plus_plus_baseline: verl's names
# (algorithms/advantages.py); gae: PPO with a critic (critic_config; algorithms/ppo.py). A group of one sample is
# its own baseline-free group, as in verl (mean 0, std 1).
ADV_ESTIMATORS = ("group_norm", "rloo", "reinforce_plus_plus", "reinforce_plus_plus_baseline", "gae")
PACKING_PHASES = ("ref", "actor", "update")  # MindSpeed-RL's prefixes: reference / old log-probs, the update
PACKING_SIZE_KEYS = ("max_packing_token_size", "dynamic_max_batch_size",
                     *(f"{phase}_{key}" for phase in PACKING_PHASES
                       for key in ("max_packing_token_size", "dynamic_max_batch_size")))
# The KL estimators (algorithms/grpo.kl_penalty): MindSpeed-RL's names, verl's aliases k1 = kl, k2 = mse, k3 =
# low_var_kl, and verl's "+" forms (k3+): the estimator's value with k2's gradient.
KL_PENALTIES = ("kl", "abs", "mse", "low_var_kl", "k1", "k2", "k3", "kl+", "k1+", "low_var_kl+", "k3+")
KL_CTRL_TYPES = ("fixed", "adaptive")
EVAL_SAMPLINGS = ("greedy", "train")
LOSS_AGG_MODES = ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm")
# MindSpeed-RL passes swanlab_mode to swanlab.init: cloud (swanlab's alias of online), local, offline, disabled.
SWANLAB_MODES = ("cloud", "local", "offline", "disabled")


@dataclass(kw_only=True)
class ResourceConfig:
    """`rl_config.actor_resource`: the devices every role time-shares in the hybrid engine."""

    SECTION_KEY: ClassVar[str] = "rl_config.actor_resource"

    # Number of ranks (NPUs, GPUs, or CPU processes); this is the world size.
    num_npus: int

    def __post_init__(self) -> None:
        require_positive(self.SECTION_KEY, self, "num_npus")


@dataclass(kw_only=True)
class IntegratedModeConfig:
    """`rl_config.integrated_mode_config`: options of the integrated (all roles co-located) worker."""

    SECTION_KEY: ClassVar[str] = "rl_config.integrated_mode_config"

    # A separate reference checkpoint (e.g. when resuming); None = the actor's initial weights.
    ref_model_load_path: Optional[str] = None


@dataclass(kw_only=True)
class RLConfig:
    """`rl_config`: GRPO hyper-parameters. Batch sizes named `*_batch_size` count prompts unless said."""

    SECTION_KEY: ClassVar[str] = "rl_config"

    # true: the roles share the actor's devices (colocated). false declares disaggregated roles, which need
    # disjoint actor_train/actor_infer device_mapping (config/resources.py, workers/disaggregated.py).
    use_integrated_worker: bool = True
    # LoRA (actor_config.lora_target_modules): the reference is the actor's backbone with the adapters off, no
    # model of its own (MindSpeed-RL's key). null: true with LoRA, false without.
    share_backbone: Optional[bool] = None
    # Forward-only micro-batch sizes in samples; None = actor_config.micro_batch_size.
    actor_forward_micro_batch_size: Optional[int] = None
    ref_forward_micro_batch_size: Optional[int] = None
    # The critic-free advantage estimator (algorithms/advantages.py): group_norm (GRPO), rloo, reinforce_plus_plus.
    adv_estimator: str = "group_norm"
    # verl's key: false is Dr. GRPO (group_norm without the division by the group's std).
    norm_adv_by_std_in_grpo: bool = True
    # The discount of reinforce_plus_plus's and GAE's token returns (1: every token gets the outcome reward).
    gamma: float = 1.0
    # PPO (adv_estimator gae, MindSpeed-RL's and verl's keys): GAE's lambda; the value loss's clip around the
    # rollout's values; the KL to the reference in the reward instead of the loss (kl_penalty's estimator,
    # coefficient init_kl_coef), its coefficient fixed or adaptive (Ziegler et al.: toward kl_target over
    # kl_horizon samples).
    lam: float = 1.0
    cliprange_value: float = 0.5
    use_kl_in_reward: bool = False
    kl_penalty: str = "low_var_kl"
    kl_ctrl_type: str = "fixed"
    kl_target: Optional[float] = None
    kl_horizon: Optional[int] = None
    init_kl_coef: float = 0.01
    # Prompts per optimizer step (MindSpeed-RL semantics); see mini_batch_size_in_samples.
    mini_batch_size: int = 1
    max_prompt_length: int = 512
    epochs: int = 1
    clip_ratio: float = 0.2
    entropy_coeff: float = 0.0
    shuffle_mini_batch: bool = False
    n_samples_per_prompt: int = 8
    # Validated only: rule verifiers always score (a reward model, rewards.<name>.model_path, adds to them).
    rule_reward: bool = True
    # Names from mindspeed_rl.data.rewards.VERIFIERS, one weight each. Scored in the driver, or by the
    # rewards.<name>.world_size CPU workers when that section is given (workers/reward_workers.py).
    verifier_function: list[str] = field(default_factory=list)
    verifier_weight: list[float] = field(default_factory=list)
    # Ours. Per-sample wall-clock limit of one verifier's answer comparison (math-verify), so that a
    # pathological expression cannot stall a step; a sample past it scores 0.
    verifier_timeout_seconds: float = 5.0
    # MindSpeed-RL defaults this to True, which computes throughput from the maximum lengths and
    # overstates it; we default to the honest mean-length figure.
    log_max_throughput: bool = False
    # Also write the metrics as TensorBoard event files in the run directory.
    use_tensorboard: bool = False
    # MindSpeed-RL's wandb keys (trainer/trackers.py): project and run name are needed; the run's files go to
    # wandb_save_dir ("" : <run dir>/wandb), offline when wandb cannot reach its server.
    use_wandb: bool = False
    wandb_project: str = ""
    wandb_exp_name: str = ""
    wandb_save_dir: str = ""
    # MindSpeed-RL's SwanLab keys: mode, project and experiment name are needed (its docs: required with
    # use_swanlab); the run's files go to swanlab_save_dir ("": <run dir>/swanlab), offline when the cloud
    # cannot be reached.
    use_swanlab: bool = False
    swanlab_mode: str = ""
    swanlab_project: str = ""
    swanlab_exp_name: str = ""
    swanlab_save_dir: str = ""
    # Ours (not keys there): an MLflow run named mlflow_exp_name in the experiment mlflow_project, both needed,
    # in mlflow_tracking_uri ("": the SQLite store <run dir>/mlflow.db).
    use_mlflow: bool = False
    mlflow_tracking_uri: str = ""
    mlflow_project: str = ""
    mlflow_exp_name: str = ""
    # The actor's ranks. May be left out when actor_train.device_mapping gives them (then filled in from it).
    actor_resource: Optional[ResourceConfig] = None
    # PPO: the critic's ranks (MindSpeed-RL's key); colocated with the actor here, so the actor's number.
    critic_resource: Optional[ResourceConfig] = None
    integrated_mode_config: IntegratedModeConfig = field(default_factory=IntegratedModeConfig)
    # True: the loss is a mean over all response tokens of a micro-batch; False: per-sequence mean first.
    token_level_loss: bool = True
    # DAPO (MindSpeed-RL's keys and defaults). Clip-higher: the PPO ratio is clipped to
    # [1 - clip_ratio_low, 1 + clip_ratio_high] instead of 1 +- clip_ratio.
    clip_higher_enable: bool = False
    # verl's dual-clip PPO (Ye et al. 2020): a negative advantage's loss is at most -A x clip_ratio_c, so a ratio far
    # above 1 cannot grow it without bound; null: off (MindSpeed-RL has none; verl's default is 3.0).
    clip_ratio_c: Optional[float] = None
    # Ours: where the update is exactly on-policy (one epoch, one mini-batch per iteration, no rollout ahead), its
    # first forward gives the old log-probs and the separate old-log-prob pass is skipped (bit-equal losses and
    # gradients; docs/algorithms.md). false: always the separate pass.
    old_logprobs_from_update: bool = True
    # verl's rollout correction of the train-inference mismatch (importance sampling, rejection, veto; null keys: off);
    # docs/algorithms.md "Rollout correction".
    rollout_correction: RolloutCorrectionConfig = field(default_factory=RolloutCorrectionConfig)
    # Ours: the mismatch ledger, every record's `mismatch/<cause>` split of the rollout-vs-trainer log-prob gap
    # (staleness, push, numerics, routing; docs/mismatch.md). Synchronous runs with the fingerprint check only, for now.
    mismatch_ledger: bool = False
    # Routing replay (R3; verl's router_replay mode R3, slime's --use-routing-replay): an MoE model's routers use the
    # experts vLLM chose for each token when it sampled, in the old-log-prob and update forwards (docs/mismatch.md).
    routing_replay: bool = False
    clip_ratio_low: float = 0.1
    clip_ratio_high: float = 0.1
    # Ours (verl's names): how the per-token loss becomes one number, see README "DAPO"; null: token-mean when
    # token_level_loss is true, else seq-mean-token-mean. When set it decides, whatever token_level_loss says.
    loss_agg_mode: Optional[str] = None
    # Overlong reward shaping: a response longer than rollout_max_tokens - overlong_buffer tokens loses
    # overlong_buffer_penalty_factor x the excess / overlong_buffer of reward, at most the factor.
    overlong_buffer_enable: bool = False
    overlong_buffer: int = 0
    overlong_buffer_penalty_factor: float = 1.0
    rollout_max_tokens: int = 2048
    # Dynamic sampling (DAPO; MindSpeed-RL's keys and defaults): groups whose filter_groups_metric is the same for
    # all n samples teach nothing (zero advantage) and are dropped; more prompts are generated (global_batch_size
    # per rollout) until filter_groups_train_batch_size prompts are kept, at most filter_groups_max_batches
    # rollouts per iteration (<= 0: no limit), else the run stops saying so. The metric: a verifier of
    # verifier_function, "acc" (the exact answer) or "reward" (the weighted total).
    filter_groups_enable: bool = False
    filter_groups_metric: str = "acc"
    filter_groups_max_batches: int = 1
    filter_groups_train_batch_size: int = 1
    # Evaluation during training on megatron_training.eval_data_path: after every eval_interval-th update
    # (0: never) and, with eval_before_train, once before the first; generation only (no update).
    eval_interval: int = 0
    eval_before_train: bool = False
    # Samples per eval prompt (pass@k for k = 1 and this); eval_sampling "greedy" (temperature 0, one sample)
    # or "train" (generate_config.sampling_config's sampling).
    eval_n_samples: int = 1
    eval_sampling: str = "greedy"
    # Packed sequences (MindSpeed-RL's keys and meanings): the Megatron forward and backward take the samples
    # of a micro-batch concatenated without padding (attention within each sample, positions restarting).
    use_remove_padding: bool = False
    # With use_remove_padding: micro-batches cut by token budget (balanced, Karmarkar-Karp) instead of by
    # sample count; every sample's prompt + response must fit the budget.
    use_dynamic_bsz: bool = False
    max_packing_token_size: int = 4096
    # Per phase (reference log-probs, the actor's old log-probs, the update); null: max_packing_token_size.
    ref_max_packing_token_size: Optional[int] = None
    actor_max_packing_token_size: Optional[int] = None
    update_max_packing_token_size: Optional[int] = None
    # At most this many samples in a token-budget micro-batch; null: no cap. Per phase alike.
    dynamic_max_batch_size: Optional[int] = None
    ref_dynamic_max_batch_size: Optional[int] = None
    actor_dynamic_max_batch_size: Optional[int] = None
    update_dynamic_max_batch_size: Optional[int] = None
    # Partial rollout (MindSpeed-RL's keys and defaults; trainer/partial_rollout.py, config/partial_rollout.py): N > 1
    # cuts each iteration's generation at sampling_config.max_tokens // N response tokens; unfinished samples keep
    # their tokens and log-probs and resume first in the next iteration, a group trains once all its samples are done.
    # require_max_age_all_finished: a sample at the maximum age (N - 1 iterations) is generated to its end.
    partial_rollout_max_split: int = 1
    require_max_age_all_finished: bool = True
    # With partial_rollout_max_split > 1 (else listed as having no effect, config/no_effect.py): run-ahead, the
    # generate stops at the decode step where a global batch of groups is complete instead of at chunk boundaries;
    # the unfinished samples (the next batch's, started meanwhile) are aborted with their tokens and resume after the
    # push. Samples get their whole remaining budget; a group at the maximum age (N - 1) is generated to its end.
    async_engine: bool = False
    # Multi-turn tool use (MindSpeed-RL's keys and defaults; ReTool): generation and tool calls alternate in the
    # rollout (trainer/multi_turn.py), the tools of the YAML at tool_config_path, called as tool_parser_format
    # writes them, at most max_tool_calls turns per response and max_parallel_calls calls per turn; a tool's
    # output is cut to max_tool_response_length characters (on tool_response_truncate_side), and a response with
    # its tool outputs holds at most max_total_response_length tokens. Checked in config/multi_turn.py.
    multi_turn_enable: bool = False
    tool_config_path: Optional[str] = None
    tool_parser_format: Optional[str] = None
    max_tool_calls: int = 0
    max_parallel_calls: int = 0
    max_total_response_length: int = 0
    max_tool_response_length: int = 0
    tool_response_truncate_side: Optional[str] = None

    @property
    def packing_budgets(self) -> dict[str, tuple[int, int | None]]:
        """Per PACKING_PHASES: (the token budget, the sample cap or None) of its token-budget micro-batches, the
        phase's own keys or else max_packing_token_size and dynamic_max_batch_size."""
        own = {
            "ref": (self.ref_max_packing_token_size, self.ref_dynamic_max_batch_size),
            "actor": (self.actor_max_packing_token_size, self.actor_dynamic_max_batch_size),
            "update": (self.update_max_packing_token_size, self.update_dynamic_max_batch_size),
        }
        return {phase: (tokens or self.max_packing_token_size, samples or self.dynamic_max_batch_size)
                for phase, (tokens, samples) in own.items()}

    @property
    def train_prompts_per_iteration(self) -> int | None:
        """The prompts an update trains on when dynamic sampling fills the batch; None: the rollout's own."""
        return self.filter_groups_train_batch_size if self.filter_groups_enable else None

    @property
    def mini_batch_size_in_samples(self) -> int:
        """Samples per optimizer step. MindSpeed-RL multiplies mini_batch_size in place; we don't
        mutate, so the value read back from the config is the one the user wrote."""
        return self.mini_batch_size * self.n_samples_per_prompt

    def __post_init__(self) -> None:
        prefix = self.SECTION_KEY
        require_positive(
            prefix,
            self,
            "actor_forward_micro_batch_size",
            "ref_forward_micro_batch_size",
            "mini_batch_size",
            "max_prompt_length",
            "epochs",
            "clip_ratio",
            "clip_ratio_low",
            "clip_ratio_high",
            "rollout_max_tokens",
            "verifier_timeout_seconds",
            *PACKING_SIZE_KEYS,
        )
        require_non_negative(prefix, self, "init_kl_coef", "entropy_coeff")
        require_choice(prefix, self, "adv_estimator", ADV_ESTIMATORS)
        require_choice(prefix, self, "kl_penalty", KL_PENALTIES)
        require_choice(prefix, self, "kl_ctrl_type", KL_CTRL_TYPES)
        require_positive(prefix, self, "n_samples_per_prompt")
        if self.clip_ratio_c is not None and not self.clip_ratio_c > 1.0:
            raise ConfigError(f"{prefix}.clip_ratio_c", f"must be > 1 (dual-clip PPO's lower bound on the ratio "
                                                        f"of a negative advantage's loss), got {self.clip_ratio_c}")
        self._check_trackers()
        if not 0.0 < self.gamma <= 1.0:
            raise ConfigError(f"{prefix}.gamma", f"must be in (0, 1], got {self.gamma}")
        if not isinstance(self.norm_adv_by_std_in_grpo, bool):
            raise ConfigError(f"{prefix}.norm_adv_by_std_in_grpo", f"must be true or false, got "
                                                                    f"{self.norm_adv_by_std_in_grpo!r}")
        require_non_negative(prefix, self, "eval_interval")
        require_positive(prefix, self, "filter_groups_train_batch_size")
        # Read only by dynamic sampling (their multi-turn recipe leaves acc_for_dapo beside retool_reward, unused).
        if self.filter_groups_enable and self.filter_groups_metric not in ("acc", "reward", *self.verifier_function):
            raise ConfigError(f"{prefix}.filter_groups_metric", f"must be acc, reward or one of verifier_function "
                                                                f"({', '.join(self.verifier_function)}), got "
                                                                f"{self.filter_groups_metric!r}")
        require_positive(prefix, self, "eval_n_samples")
        require_choice(prefix, self, "eval_sampling", EVAL_SAMPLINGS)
        if self.eval_sampling == "greedy" and self.eval_n_samples != 1:
            raise ConfigError(f"{prefix}.eval_n_samples", f"must be 1 with eval_sampling: greedy (greedy decoding gives "
                                                          f"one answer per prompt), got {self.eval_n_samples}")
        if self.loss_agg_mode is not None:
            require_choice(prefix, self, "loss_agg_mode", LOSS_AGG_MODES)
        require_non_negative(prefix, self, "overlong_buffer_penalty_factor")
        if self.overlong_buffer_enable and not 0 < self.overlong_buffer <= self.rollout_max_tokens:
            raise ConfigError(f"{prefix}.overlong_buffer", f"must be in (0, rollout_max_tokens={self.rollout_max_tokens}] "
                                                           f"when overlong_buffer_enable is true, got {self.overlong_buffer}")
        if self.use_dynamic_bsz and not self.use_remove_padding:
            raise ConfigError(f"{prefix}.use_dynamic_bsz", "needs use_remove_padding: true (token-budget micro-batches "
                                                          "are packed; padded ones are cut by sample count)")
        # use_integrated_worker is checked with the role sections (GRPOConfig, config/resources.py).
        self._check_rewards()
        self._check_ppo()

    def _check_trackers(self) -> None:
        prefix = self.SECTION_KEY
        for tracker, what in (("wandb", "wandb project and run"), ("swanlab", "SwanLab project and experiment"),
                              ("mlflow", "MLflow experiment and run")):
            if getattr(self, f"use_{tracker}"):
                for name in (f"{tracker}_project", f"{tracker}_exp_name"):
                    if not getattr(self, name):
                        raise ConfigError(f"{prefix}.{name}", f"must name the {what} with use_{tracker} true")
        if self.use_swanlab:
            require_choice(prefix, self, "swanlab_mode", SWANLAB_MODES)

    def _check_ppo(self) -> None:
        prefix = self.SECTION_KEY
        if not 0.0 <= self.lam <= 1.0:
            raise ConfigError(f"{prefix}.lam", f"must be in [0, 1], got {self.lam}")
        require_positive(prefix, self, "cliprange_value")
        if self.use_kl_in_reward and self.adv_estimator != "gae":
            raise ConfigError(f"{prefix}.use_kl_in_reward", f"the KL in the reward is PPO's (adv_estimator gae); "
                                                            f"{self.adv_estimator} keeps it in the loss")
        if self.kl_ctrl_type == "adaptive":
            if not self.use_kl_in_reward:
                raise ConfigError(f"{prefix}.kl_ctrl_type", "adaptive moves the coefficient of the KL in the reward: "
                                                            "it needs use_kl_in_reward true")
            require_positive(prefix, self, "kl_target", "kl_horizon")
            if self.kl_target is None or self.kl_horizon is None:
                raise ConfigError(f"{prefix}.kl_target" if self.kl_target is None else f"{prefix}.kl_horizon",
                                  "must be set with kl_ctrl_type adaptive")

    def _check_rewards(self) -> None:
        prefix = self.SECTION_KEY
        if not self.rule_reward:
            raise ConfigError(
                f"{prefix}.rule_reward",
                "must be true: rule verifiers always score (a reward model, rewards.<name>.model_path, adds its "
                "weighted score to theirs)",
            )
        if not self.verifier_function:
            raise ConfigError(f"{prefix}.verifier_function", "must name at least one verifier when rule_reward is true")
        from mindspeed_rl.registries import VERIFIER_NAMES

        for name in self.verifier_function:
            if name not in VERIFIER_NAMES:
                raise ConfigError(
                    f"{prefix}.verifier_function", f"unknown verifier {name!r}; known: {', '.join(sorted(VERIFIER_NAMES))}"
                )
        if len(self.verifier_weight) != len(self.verifier_function):
            raise ConfigError(
                f"{prefix}.verifier_weight",
                f"must have one weight per verifier_function entry ({len(self.verifier_function)}: "
                f"{list(self.verifier_function)}), got {len(self.verifier_weight)}: {list(self.verifier_weight)}",
            )
