"""GRPOConfig: the whole tree, and the checks that need more than one section."""

from dataclasses import dataclass, field
from functools import cached_property, partial
from typing import Optional

from mindspeed_rl.errors import ConfigError, run_checks
from mindspeed_rl.config.generate import GenerateConfig, check_eplb_token_collection
from mindspeed_rl.config.megatron import ActorConfig, CriticConfig, MegatronTrainingConfig
from mindspeed_rl.config.model_arch import ModelArchConfig
from mindspeed_rl.config.resources import DISAGGREGATED, ResourcePlan, actor_world_size, build_resource_plan
from mindspeed_rl.config.role_sections import (
    ActorInferResources,
    ActorTrainResources,
    CriticResources,
    ReferenceResources,
    RewardResources,
    TeacherResources,
)
from mindspeed_rl.config.algorithm_checks import (check_dynamic_sampling, check_evaluation, check_mismatch_ledger,
                                                  check_num_layer_list, check_packing, check_recompute_layers,
                                                  check_routing_replay)
from mindspeed_rl.config.critic import (check_critic, critic_has_own_devices, critic_role_sections, critic_world_size,
                                        own_critic_ranks)
from mindspeed_rl.config.context_parallel import check_context_parallel
from mindspeed_rl.config.distillation import (DistillationConfig, check_distillation_run, distillation_on,
                                              own_teacher_ranks, teacher_role_sections)
from mindspeed_rl.config.dpo import DPO_STAGE, check_dpo_run
from mindspeed_rl.config.layout_checks import check_infer_layout, check_model_sharding, check_train_layout
from mindspeed_rl.config.lora import check_lora_run
from mindspeed_rl.config.msprobe import MsprobeConfig, check_msprobe_run
from mindspeed_rl.config.multi_turn import check_multi_turn
from mindspeed_rl.config.partial_rollout import check_partial_rollout
from mindspeed_rl.config.profiler import ProfilerConfig
from mindspeed_rl.config.rl import ResourceConfig, RLConfig
from mindspeed_rl.config.runtime import RuntimeConfig, SyntheticDataConfig
from mindspeed_rl.config.supported import check_supported
from mindspeed_rl.config.synthetic_checks import check_asset_paths, check_synthetic_data
from mindspeed_rl.config.their_keys import check_generate_data_parallel_size
from mindspeed_rl.parallel.layout import ParallelLayout
from mindspeed_rl.registries import SYNTHETIC_REWARD_MODEL


@dataclass(kw_only=True)
class GRPOConfig:
    """The GRPO run. Top-level keys follow MindSpeed-RL; `synthetic_data` and `runtime` are ours.

    There is no `ref_config`/`reward_config`: in integrated mode (the only mode here) the reference
    and the rule reward reuse `actor_config`, as in MindSpeed-RL.
    """

    megatron_training: MegatronTrainingConfig
    actor_config: ActorConfig
    # PPO (rl_config.adv_estimator gae): the critic's layout and optimizer, colocated with the actor.
    critic_config: Optional[CriticConfig] = None
    rl_config: RLConfig
    generate_config: GenerateConfig
    model: dict[str, ModelArchConfig] = field(default_factory=dict)
    synthetic_data: Optional[SyntheticDataConfig] = None
    runtime: RuntimeConfig = field(default_factory=RuntimeConfig)
    # MindSpeed-RL's profiler section (config/profiler.py): torch.profiler traces per stage, rank and iteration.
    profiler_config: Optional[ProfilerConfig] = None
    # Their msprobe section with msprobe true (config/msprobe.py; false: dropped before the schema, no effect).
    msprobe_config: Optional[MsprobeConfig] = None
    # ROLL's resource sections (config/resources.py), all optional: left out, every role runs on the
    # actor's rl_config.actor_resource.num_npus devices, as in MindSpeed-RL's integrated worker.
    num_gpus_per_node: Optional[int] = None
    actor_train: Optional[ActorTrainResources] = None
    actor_infer: Optional[ActorInferResources] = None
    reference: Optional[ReferenceResources] = None
    critic: Optional[CriticResources] = None  # ROLL's critic role (PPO); left out: the actor's devices
    teacher: Optional[TeacherResources] = None  # ROLL's teacher role (distillation); left out: the actor's devices
    rewards: dict[str, RewardResources] = field(default_factory=dict)
    # ROLL's top-level key. 0: synchronous (a rollout uses the weights of the update just before it). 1:
    # one-step off-policy, disaggregated only: the rollout of iteration k+1 runs on the inference devices
    # while iteration k updates on the training devices, so it samples from weights one update old.
    async_generation_ratio: float = 0
    # verl's on-policy distillation section (config/distillation.py): a teacher scores the student's samples.
    distillation: Optional[DistillationConfig] = None

    @property
    def distills(self) -> bool:
        """distillation.enabled: a teacher part and its teacher_logprob phase (workers/parts/teacher.py)."""
        return distillation_on(self)

    @property
    def profiling(self) -> bool:
        """profiler_config.integrated.profile: the ranks profile their stages (workers/stage_profiler.py)."""
        return self.profiler_config is not None and self.profiler_config.enabled

    @property
    def world_size(self) -> int:
        # Set from actor_train.device_mapping in __post_init__ when only that is given.
        return self.rl_config.actor_resource.num_npus

    @property
    def resource_plan(self) -> ResourcePlan:
        """Every role's devices and world size, colocated or disaggregated, the device -> roles table
        (config/resources.py; checked in __post_init__, cheap to derive again)."""
        generate = self.generate_config
        return build_resource_plan(
            actor_train=self.actor_train, actor_infer=self.actor_infer, reference=self.reference,
            rewards=self.rewards, num_gpus_per_node=self.num_gpus_per_node, num_npus=self.world_size,
            use_integrated_worker=self.rl_config.use_integrated_worker,
            infer_tensor_parallel_size=generate.infer_tensor_parallel_size,
            infer_pipeline_parallel_size=generate.infer_pipeline_parallel_size,
            more_roles=critic_role_sections(self) | teacher_role_sections(self),
        )

    @cached_property
    def layout(self) -> ParallelLayout:
        """The run's training and inference layouts (parallel/layout.py), made once from this config: the sizes the
        checks, the planner and the ranks read."""
        return ParallelLayout.from_config(self)

    @property
    def train_data_parallel_size(self) -> int:
        """Megatron's data-parallel size: the ranks that take different samples (CP excluded; Megatron carves expert
        parallelism out of DP x CP, so EP does not divide it)."""
        return self.layout.train_dp

    @property
    def disaggregated(self) -> bool:
        """actor_train and actor_infer on disjoint devices (their own ranks), not taking turns."""
        return self.resource_plan.mode == DISAGGREGATED

    @property
    def infer_world_size(self) -> int:
        """The ranks vLLM runs on: the actor's (colocated), or actor_infer's devices (disaggregated)."""
        plan = self.resource_plan
        return len(plan.role("actor_infer").devices) if plan.mode == DISAGGREGATED else self.world_size

    @property
    def critic_has_own_devices(self) -> bool:
        return critic_has_own_devices(self)  # config/critic.py

    @property
    def critic_world_size(self) -> int:
        return critic_world_size(self)

    @property
    def num_rank_processes(self) -> int:
        """Device ranks the run starts: the shared ones, or the training ranks plus the inference ranks; plus the
        critic's where it has devices of its own."""
        return (self.world_size + (self.infer_world_size if self.disaggregated else 0) + own_critic_ranks(self)
                + own_teacher_ranks(self))

    @property
    def infer_data_parallel_size(self) -> int:
        return self.layout.infer_dp

    @property
    def reward_model(self) -> Optional[tuple[str, RewardResources]]:
        """The rewards.<name> section that names a reward model (model_path; at most one), or None."""
        return next(((name, section) for name, section in self.rewards.items() if section.is_model), None)

    @property
    def selected_model(self) -> Optional[ModelArchConfig]:
        """The architecture block named by actor_config.model, or None if the tree has none."""
        return self.model.get(self.actor_config.model)

    def __post_init__(self) -> None:
        # Every failing check is reported, not only the first; the model blocks, world size and model
        # selection come first because the other checks read them.
        run_checks(*(partial(block.check, f"model.{name}") for name, block in self.model.items()))
        run_checks(self._resolve_world_size, self._check_model_selection)
        run_checks(
            self.check_layout, partial(check_synthetic_data, self), partial(check_asset_paths, self),
            lambda: check_supported(self.resource_plan, self.rewards), self._check_reward_model,
            self._check_async_generation, partial(check_evaluation, self), partial(check_dynamic_sampling, self),
            partial(check_mismatch_ledger, self), partial(check_routing_replay, self),
            partial(check_eplb_token_collection, self),
            partial(check_critic, self), partial(check_lora_run, self), partial(check_multi_turn, self),
            partial(check_generate_data_parallel_size, self),
            partial(check_dpo_run, self), partial(check_partial_rollout, self),
            partial(check_distillation_run, self), partial(check_msprobe_run, self),
        )

    @property
    def reference_is_backbone(self) -> bool:
        """LoRA with rl_config.share_backbone (its default): the reference log-probs are the actor's with its
        adapters off; no reference model is built, loaded or moved."""
        share = self.rl_config.share_backbone
        return self.uses_reference and self.actor_config.uses_lora and (share is None or share)

    @property
    def adapter_only_switch(self) -> bool:
        """LoRA: each switch moves the adapters only (resharding/adapter_push.py), between the same ranks or over the
        bridge to actor_infer's own."""
        return self.actor_config.uses_lora

    @property
    def response_length_limit(self) -> int:
        """The most tokens of one response: sampling_config.max_tokens, or with multi-turn tool use
        rl_config.max_total_response_length (its turns and the tool outputs between them)."""
        rl = self.rl_config
        return rl.max_total_response_length if rl.multi_turn_enable else self.generate_config.sampling_config.max_tokens

    @property
    def response_length_key(self) -> str:
        """The key that sets response_length_limit, for messages."""
        return ("rl_config.max_total_response_length" if self.rl_config.multi_turn_enable
                else "generate_config.sampling_config.max_tokens")

    @property
    def uses_reference(self) -> bool:
        """The reference model feeds the KL term (with init_kl_coef 0, DAPO, none is built, loaded or given a phase)
        and DPO's loss, which always has one."""
        return self.rl_config.init_kl_coef > 0 or self.megatron_training.stage == DPO_STAGE

    @property
    def generates(self) -> bool:
        """The run samples responses (vLLM, the inference part); DPO trains on given pairs and builds none."""
        return self.megatron_training.stage != DPO_STAGE

    @property
    def trained_samples_per_iteration(self) -> int:
        """The samples an iteration's update trains on: the rollout's, or dynamic sampling's kept prompts'."""
        rl = self.rl_config
        prompts = rl.train_prompts_per_iteration or self.megatron_training.global_batch_size
        return prompts * rl.n_samples_per_prompt

    @property
    def old_logprobs_from_update(self) -> bool:
        """Whether the update's own first forward gives the old log-probs (no separate pass): where the update is
        exactly on-policy (one epoch of one mini-batch, sampled by the weights that train) and nothing reads them
        before it (PPO's KL in the reward and the rollout correction do). TRL's GRPO does the same;
        `rl_config.old_logprobs_from_update` false keeps the separate pass."""
        rl = self.rl_config
        one_step = rl.epochs == 1 and rl.mini_batch_size_in_samples >= self.trained_samples_per_iteration
        kl_in_reward = self.critic_config is not None and rl.use_kl_in_reward
        return (rl.old_logprobs_from_update and one_step and not self.rollout_staleness and not kl_in_reward
                and not rl.rollout_correction.enabled)  # the correction weighs the update by pi_old / pi_rollout

    @property
    def rollout_staleness(self) -> int:
        """Updates between the weights a rollout samples from and the weights it trains (0 or 1)."""
        return int(self.async_generation_ratio)

    def _check_async_generation(self) -> None:
        ratio = self.async_generation_ratio
        if ratio not in (0, 1):
            raise ConfigError("async_generation_ratio", f"must be 0 (synchronous) or 1 (one-step off-policy: the next "
                                                        f"rollout overlaps this update), got {ratio}")
        if ratio and not self.disaggregated:
            raise ConfigError("async_generation_ratio", "1 overlaps the rollout with the update on other devices: it "
                                                        "needs disaggregated actor_train/actor_infer device_mapping "
                                                        "(colocated roles take turns on the same devices); set 0")

    def _check_reward_model(self) -> None:
        if self.reward_model is None:
            return
        name, section = self.reward_model
        synthetic = self.synthetic_data is not None and self.synthetic_data.enabled
        if section.model_path == SYNTHETIC_REWARD_MODEL and not synthetic:
            raise ConfigError(f"rewards.{name}.model_path", f"`{SYNTHETIC_REWARD_MODEL}` is the demo's generated reward model, made "
                                                            "from the generated actor: it needs synthetic_data.enabled="
                                                            "true; give an HF Qwen2ForSequenceClassification directory")

    def _resolve_world_size(self) -> None:
        """MindSpeed-RL's rl_config.actor_resource.num_npus or ROLL's actor_train.device_mapping: one is
        needed, both must agree; num_npus is filled in from the mapping so that every reader sees it."""
        resource = self.rl_config.actor_resource
        world, _ = actor_world_size(self.actor_train, resource.num_npus if resource is not None else None)
        if resource is None:
            self.rl_config.actor_resource = ResourceConfig(num_npus=world)

    def check_layout(self) -> None:
        """The parallel layout and batch shapes against the selected model block. The trainer runs them
        again with the block the checkpoint's config.json describes (setup.check_against_checkpoint)."""
        run_checks(
            partial(check_train_layout, self), partial(check_context_parallel, self),
            partial(check_infer_layout, self), partial(check_model_sharding, self), self._check_batch_sizes,
            self._check_lengths, partial(check_packing, self),
            partial(check_recompute_layers, self), partial(check_num_layer_list, self),
        )

    def _check_model_selection(self) -> None:
        actor_model = self.actor_config.model
        if self.model and actor_model not in self.model:
            raise ConfigError(
                "actor_config.model",
                f"must name a block under `model` ({', '.join(self.model)}), got {actor_model!r}",
            )
        if self.megatron_training.model is not None and self.megatron_training.model != actor_model:
            raise ConfigError(
                "megatron_training.model",
                f"must equal actor_config.model={actor_model!r}, got {self.megatron_training.model!r}",
            )

    def _check_batch_sizes(self) -> None:
        rl = self.rl_config

        def samples(key: str, prompts: int) -> tuple[int, str]:
            count = prompts * rl.n_samples_per_prompt
            return count, f"{key} * rl_config.n_samples_per_prompt = {prompts} * {rl.n_samples_per_prompt} = " \
                          f"{count} samples"

        # An update trains on the rollout's prompts, or with dynamic sampling on filter_groups_train_batch_size.
        trained, trained_desc = (
            samples("megatron_training.global_batch_size", self.megatron_training.global_batch_size)
            if rl.train_prompts_per_iteration is None
            else samples("rl_config.filter_groups_train_batch_size", rl.train_prompts_per_iteration))
        mini_samples = rl.mini_batch_size_in_samples
        if trained % mini_samples != 0:
            raise ConfigError(
                "rl_config.mini_batch_size",
                f"mini_batch_size * n_samples_per_prompt = {rl.mini_batch_size} * {rl.n_samples_per_prompt} = "
                f"{mini_samples} samples must divide {trained_desc}",
            )
        dp, mbs = self.train_data_parallel_size, self.actor_config.micro_batch_size
        if mini_samples % (dp * mbs) != 0:
            raise ConfigError(
                "actor_config.micro_batch_size",
                f"train data-parallel size * micro_batch_size = {dp} * {mbs} = {dp * mbs} must divide the "
                f"mini-batch of rl_config.mini_batch_size * n_samples_per_prompt = {mini_samples} samples",
            )
        generated, generated_desc = samples("megatron_training.global_batch_size",
                                            self.megatron_training.global_batch_size)
        infer_dp = self.infer_data_parallel_size
        if generated % infer_dp != 0:
            raise ConfigError(
                "megatron_training.global_batch_size",
                f"{generated_desc} must be divisible by the inference data-parallel size {infer_dp}",
            )

    def _check_lengths(self) -> None:
        # A prompt + response beyond max_model_len runs with a shorter response (config/tolerated.py); the longest
        # prompt must leave room for one response token.
        max_prompt = self.rl_config.max_prompt_length
        max_model_len = self.generate_config.max_model_len
        if max_prompt >= max_model_len:
            raise ConfigError("generate_config.max_model_len",
                              f"must be > rl_config.max_prompt_length={max_prompt} (room for a response), "
                              f"got {max_model_len}")
        arch = self.selected_model
        max_positions = arch.max_position_embeddings if arch is not None else None
        if max_positions is not None and max_model_len > max_positions:
            raise ConfigError(
                "generate_config.max_model_len",
                f"must be <= model.{self.actor_config.model}.max_position_embeddings={max_positions}, "
                f"got {max_model_len}",
            )
