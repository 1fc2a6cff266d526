"""On-policy distillation's section (`distillation:`, cli/train_distill.py): verl's keys, names and defaults
(verl docs/algo/opd.md, verl/trainer/config/distillation/distillation.yaml), and the checks a distillation run needs
across sections (`check_distillation_run`; `config` is the GRPOConfig, not imported here). Pure: no torch.

The student samples, one teacher scores every sampled position (workers/parts/teacher.py), and the update adds the
distillation loss (algorithms/distillation.py) to, or puts it in place of, the task-reward loss. Here the teacher is
one more part on the actor's training ranks, in the actor's TP/PP layout, resident only in its `teacher_logprob`
phase (the reference's way); verl's separate teacher pool (`n_gpus_per_node`, `nnodes`) and several teachers routed
by `teacher_key` are refused by name until they exist.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from mindspeed_rl.config.checks import require_choice, require_in_range, require_positive
from mindspeed_rl.errors import ConfigError, run_checks

# verl's two families: single-sample estimators of the reverse KL at the sampled token, and the forward KL over the
# teacher's top-k tokens (algorithms/distillation.py has the formulas).
ESTIMATOR_LOSS_MODES = ("kl", "k1", "abs", "mse", "k2", "low_var_kl", "k3")
TOPK_LOSS_MODES = ("forward_kl_topk", "forward_kl_topk_tail")
LOSS_MODES = ESTIMATOR_LOSS_MODES + TOPK_LOSS_MODES
PREFIX = "distillation"
LOSS_PREFIX = "distillation.distillation_loss"


@dataclass(kw_only=True)
class TeacherModelConfig:
    """distillation.teacher_models.<name>: the teacher's HF checkpoint (the student's tokenizer). `key` routes
    samples among several teachers (verl; one teacher here, which takes every sample); `num_replicas` and `inference`
    size verl's teacher servers, which a teacher on the actor's ranks does not have: accepted at their defaults (0 or 1
    replica, no inference settings), refused otherwise."""

    model_path: str
    key: Optional[str] = None
    num_replicas: int = 0
    inference: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not self.model_path:
            raise ConfigError("distillation.teacher_models.<name>.model_path", "must name the teacher's HF directory")


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
        teacher, where = self.teacher, f"{PREFIX}.teacher_models.{self.teacher_name}"
        if teacher.inference or teacher.num_replicas > 1:  # a layout asked for would silently be another
            raise ConfigError(f"{where}.inference" if teacher.inference else f"{where}.num_replicas",
                              "the teacher runs as one part on the actor's training ranks, in the actor's layout: "
                              "teacher servers of their own (inference, num_replicas > 1) are not supported yet")

    def _check_pool(self) -> None:
        if self.nnodes:
            raise ConfigError(f"{PREFIX}.nnodes", f"is {self.nnodes}: the teacher runs on the actor's training ranks "
                                                  "here (a part resident in its own phase), not in a pool of its own; "
                                                  "leave nnodes at 0")

    @property
    def teacher(self) -> TeacherModelConfig:
        return next(iter(self.teacher_models.values()))

    @property
    def teacher_name(self) -> str:
        return next(iter(self.teacher_models))


def distillation_on(config) -> bool:
    return config.distillation is not None and config.distillation.enabled


def check_distillation_run(config) -> None:
    """What a distillation run cannot serve yet, refused in one line each."""
    if not distillation_on(config):
        return
    rl, loss = config.rl_config, config.distillation.distillation_loss
    run_checks(
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
