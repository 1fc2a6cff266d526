"""On-policy distillation's section (`distillation:`, cli/train_distill.py): verl's keys, names and defaults
(verl docs/algo/opd.md, verl/trainer/config/distillation/distillation.yaml), and the checks a distillation run needs
across sections (`check_distillation_run`; `config` is the GRPOConfig, not imported here). Pure: no torch.

The student samples, one teacher scores every sampled position (workers/parts/teacher.py), and the update adds the
distillation loss (algorithms/distillation.py) to, or puts it in place of, the task-reward loss. The teacher is one
more part: on the actor's training ranks, in the actor's TP/PP layout, resident only in its `teacher_logprob` phase
(the reference's way); or, given devices of its own by ROLL's `teacher` role (`teacher.device_mapping`, apart from
actor_train's, as the critic's), a group of its own in a layout of its own: verl's teacher-server sizes
(`inference.tensor_model_parallel_size`, `inference.pipeline_model_parallel_size`, `num_replicas` its data-parallel
copies). verl's separate pool keys (`n_gpus_per_node`, `nnodes`) and several teachers routed by `teacher_key` are
refused by name until they exist.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from mindspeed_rl.config.checks import require_choice, require_in_range, require_positive
from mindspeed_rl.config.device_mapping import own_devices_follow
from mindspeed_rl.errors import ConfigError, run_checks
from mindspeed_rl.parallel.layout import InferLayout, ParallelLayout, TrainLayout

# verl's two families: single-sample estimators of the reverse KL at the sampled token, and the forward KL over the
# teacher's top-k tokens (algorithms/distillation.py has the formulas).
ESTIMATOR_LOSS_MODES = ("kl", "k1", "abs", "mse", "k2", "low_var_kl", "k3")
TOPK_LOSS_MODES = ("forward_kl_topk", "forward_kl_topk_tail")
LOSS_MODES = ESTIMATOR_LOSS_MODES + TOPK_LOSS_MODES
PREFIX = "distillation"
LOSS_PREFIX = "distillation.distillation_loss"
TEACHER_ROLE = "teacher"  # ROLL's role of the teacher's devices
# verl's teacher-server sizes read here: the teacher's own layout on devices of its own.
INFERENCE_LAYOUT_KEYS = ("tensor_model_parallel_size", "pipeline_model_parallel_size")


@dataclass(kw_only=True)
class TeacherModelConfig:
    """distillation.teacher_models.<name>: the teacher's HF checkpoint (the student's tokenizer). `key` routes
    samples among several teachers (verl; one teacher here, which takes every sample). `inference` and `num_replicas`
    size verl's teacher servers: here the layout of a teacher on devices of its own (its TP and PP, and its
    data-parallel copies; 0 = as many as its devices hold); a teacher on the actor's ranks has the actor's layout."""

    model_path: str
    key: Optional[str] = None
    num_replicas: int = 0
    inference: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        where = "distillation.teacher_models.<name>"
        if not self.model_path:
            raise ConfigError(f"{where}.model_path", "must name the teacher's HF directory")
        for key, value in self.inference.items():
            if key not in INFERENCE_LAYOUT_KEYS:
                raise ConfigError(f"{where}.inference.{key}", f"is not read here: the teacher is a Megatron forward, "
                                                              f"not a vLLM server; its layout keys are "
                                                              f"{', '.join(INFERENCE_LAYOUT_KEYS)}")
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ConfigError(f"{where}.inference.{key}", f"must be an integer >= 1, got {value!r}")
        if self.num_replicas < 0:
            raise ConfigError(f"{where}.num_replicas", f"must be >= 0, got {self.num_replicas}")


@dataclass(kw_only=True)
class DistillationLossConfig:
    """distillation.distillation_loss: verl's loss mode and how it joins the task-reward loss."""

    loss_mode: str = "k3"
    topk: int = 32
    use_task_rewards: bool = True
    distillation_loss_coef: float = 1.0
    loss_max_clamp: Optional[float] = None
    log_prob_min_clamp: Optional[float] = None
    tail_mass_eps: float = 1e-6
    use_policy_gradient: bool = False
    policy_loss_mode: str = "vanilla"
    clip_ratio: float = 0.2
    clip_ratio_low: float = 0.2
    clip_ratio_high: float = 0.2

    def __post_init__(self) -> None:
        run_checks(
            lambda: require_choice(LOSS_PREFIX, self, "loss_mode", LOSS_MODES),
            lambda: require_positive(LOSS_PREFIX, self, "topk", "loss_max_clamp", "tail_mass_eps"),
            lambda: require_choice(LOSS_PREFIX, self, "policy_loss_mode", ("vanilla",)),
            lambda: require_in_range(LOSS_PREFIX, self, "clip_ratio_low", 0.0, 1.0),
            lambda: require_positive(LOSS_PREFIX, self, "clip_ratio_high", "distillation_loss_coef"),
            self._check_mode_pairs,
        )

    def _check_mode_pairs(self) -> None:
        # verl's validation: k1's value has no gradient through the teacher, so backpropagating it is meaningless.
        if not self.use_policy_gradient and self.loss_mode in ("k1", "kl"):
            raise ConfigError(f"{LOSS_PREFIX}.loss_mode", f"{self.loss_mode} needs use_policy_gradient=true (PG OPD): "
                                                          "its direct gradient does not depend on the teacher")
        if self.use_policy_gradient and self.loss_mode in TOPK_LOSS_MODES:
            raise ConfigError(f"{LOSS_PREFIX}.loss_mode", f"{self.loss_mode} with use_policy_gradient=true: a policy "
                                                          "gradient acts through the sampled token only, the top-k "
                                                          "signal would be lost (verl warns; refused here)")
        if self.loss_mode == "forward_kl_topk_tail" and self.log_prob_min_clamp is not None:
            raise ConfigError(f"{LOSS_PREFIX}.log_prob_min_clamp", "must be null with forward_kl_topk_tail: a clamp "
                                                                   "changes the top-k mass the tail bucket is made of")

    @property
    def uses_topk(self) -> bool:
        return self.loss_mode in TOPK_LOSS_MODES


@dataclass(kw_only=True)
class DistillationConfig:
    enabled: bool = False
    teacher_key: str = "data_source"
    n_gpus_per_node: int = 8
    nnodes: int = 0
    teacher_models: dict[str, TeacherModelConfig] = field(default_factory=dict)
    distillation_loss: DistillationLossConfig = field(default_factory=DistillationLossConfig)

    def __post_init__(self) -> None:
        if not self.enabled:
            return
        run_checks(self._check_teachers, self._check_pool)

    def _check_teachers(self) -> None:
        if len(self.teacher_models) != 1:
            raise ConfigError(f"{PREFIX}.teacher_models", f"must hold exactly one teacher here (several teachers "
                                                          f"routed by teacher_key are not supported yet), got "
                                                          f"{len(self.teacher_models)}")

    def _check_pool(self) -> None:
        if self.nnodes:
            raise ConfigError(f"{PREFIX}.nnodes", f"is {self.nnodes}: verl's teacher pool is not read here; the teacher "
                                                  "runs on the actor's training ranks, or on devices of its own given "
                                                  "by ROLL's teacher.device_mapping; leave nnodes at 0")

    @property
    def teacher(self) -> TeacherModelConfig:
        return next(iter(self.teacher_models.values()))

    @property
    def teacher_name(self) -> str:
        return next(iter(self.teacher_models))


def distillation_on(config) -> bool:
    return config.distillation is not None and config.distillation.enabled


def teacher_role_sections(config) -> dict:
    """The teacher's resource section for the plan (None: the actor's devices), present with distillation or a
    `teacher` section."""
    return {TEACHER_ROLE: config.teacher} if distillation_on(config) or config.teacher is not None else {}


def teacher_has_own_devices(config) -> bool:
    """The teacher on devices of its own (ROLL's `teacher.device_mapping` apart from actor_train's): its ranks are a
    group of their own, in its own layout; otherwise it takes turns on the training ranks in the actor's."""
    if not distillation_on(config):
        return False
    plan = config.resource_plan
    return not set(plan.role(TEACHER_ROLE).devices) & set(plan.role("actor_train").devices)


def own_teacher_ranks(config) -> int:
    """The rank processes a teacher of its own adds (0 where it shares the training ranks or is absent)."""
    return len(config.resource_plan.role(TEACHER_ROLE).devices) if teacher_has_own_devices(config) else 0


def teacher_layout(config) -> ParallelLayout:
    """The teacher's ranks: a teacher of its own in its `inference` TP x PP over its devices (no CP, no experts); a
    teacher on the training ranks in the actor's layout."""
    if not teacher_has_own_devices(config):
        return config.layout
    sizes = config.distillation.teacher.inference
    world = own_teacher_ranks(config)
    return ParallelLayout(train=TrainLayout(tp=sizes.get("tensor_model_parallel_size", 1),
                                            pp=sizes.get("pipeline_model_parallel_size", 1)),
                          infer=InferLayout(), train_world_size=world, infer_world_size=world)


def teacher_roles_on_training_devices(plan) -> tuple[str, ...]:
    """("teacher",) where the teacher shares the training devices (it must have all of them), else (); a teacher on
    devices of its own takes those after every other role's."""
    if not any(role.key == TEACHER_ROLE for role in plan.roles):
        return ()
    return () if own_devices_follow(plan, TEACHER_ROLE) else (TEACHER_ROLE,)


def _check_teacher_layout(config) -> None:
    """A teacher on the actor's ranks has the actor's layout (sizes asked for must be those); one of its own must
    split its devices into whole replicas of its TP x PP, and the batch into equal shares of them."""
    teacher, where = config.distillation.teacher, f"{PREFIX}.teacher_models.{config.distillation.teacher_name}"
    if not teacher_has_own_devices(config):
        ac = config.actor_config
        for key, actor_size in zip(INFERENCE_LAYOUT_KEYS, (ac.tensor_model_parallel_size,
                                                         ac.pipeline_model_parallel_size)):
            if teacher.inference.get(key, actor_size) != actor_size:
                raise ConfigError(f"{where}.inference.{key}", f"is {teacher.inference[key]}, but a teacher on the "
                                                              f"actor's ranks runs in the actor's layout ({actor_size}):"
                                                              f" a layout of its own needs devices of its own "
                                                              f"(teacher.device_mapping)")
        if teacher.num_replicas > 1:
            raise ConfigError(f"{where}.num_replicas", "a teacher on the actor's ranks is one replica per "
                                                       "data-parallel rank of the actor; replicas of its own need "
                                                       "devices of its own (teacher.device_mapping)")
        return
    layout, world = teacher_layout(config), own_teacher_ranks(config)
    model_parallel = layout.train.tp * layout.train.pp
    if world % model_parallel:
        raise ConfigError(f"{TEACHER_ROLE}.device_mapping", f"gives the teacher {world} devices, which its tensor x "
                                                            f"pipeline parallel size {model_parallel} must divide")
    replicas = world // model_parallel
    if teacher.num_replicas not in (0, replicas):
        raise ConfigError(f"{where}.num_replicas", f"is {teacher.num_replicas}, but its {world} devices hold "
                                                   f"{replicas} replica(s) of tensor x pipeline {model_parallel}")
    samples = config.rl_config.mini_batch_size_in_samples  # a batch is whole mini-batches
    if samples % replicas:
        raise ConfigError(f"{TEACHER_ROLE}.device_mapping", f"gives the teacher {replicas} data-parallel replicas, "
                                                            f"which must divide a mini-batch of {samples} samples")


def check_distillation_run(config) -> None:
    """What a distillation run cannot serve yet, refused in one line each."""
    if not distillation_on(config):
        if config.teacher is not None:
            raise ConfigError(TEACHER_ROLE, "a teacher role needs on-policy distillation (distillation.enabled)")
        return
    rl, loss = config.rl_config, config.distillation.distillation_loss
    run_checks(
        lambda: _check_teacher_layout(config),
        lambda: _refuse(config.megatron_training.stage == "dpo", "megatron_training.stage",
                        "is dpo: distillation scores the student's own samples, DPO generates none"),
        lambda: _refuse(rl.multi_turn_enable, "rl_config.multi_turn_enable",
                        "tool turns with distillation are not supported yet: the teacher would score tool output"),
        lambda: _refuse(loss.uses_topk and config.actor_config.context_parallel_size > 1,
                        f"{LOSS_PREFIX}.loss_mode", f"{loss.loss_mode} with context parallelism "
                        f"(actor_config.context_parallel_size={config.actor_config.context_parallel_size}) is not "
                        "supported yet: the top k of a position is taken where its rank holds it; use k3 or k1"),
    )


def _refuse(condition: bool, key: str, why: str) -> None:
    if condition:
        raise ConfigError(key, why)
