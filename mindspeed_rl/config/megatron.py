"""`megatron_training` and `actor_config`: the Megatron arguments, under MindSpeed-RL's key names.

MindSpeed-RL builds the actor's Megatron arguments as ``{**megatron_training, **actor_config}``;
here the two stay separate typed sections and the consumer reads each key from its own section.
Every key either reaches the engine/trainer or is validated to the one value that describes what
this engine does (``require_only``); MindSpeed-RL keys that would do nothing here are not in the
schema at all and are rejected with a reason (``mindspeed_rl/config/removed.py``).
"""

import os
import re
from dataclasses import dataclass, field
from typing import ClassVar, Optional

from mindspeed_rl.config.checks import (
    require_choice,
    require_in_range,
    require_non_negative,
    require_only,
    require_positive,
)
from mindspeed_rl.errors import ConfigError
from mindspeed_rl.config.dpo import check_dpo_keys
from mindspeed_rl.config.lora import check_lora

# Megatron's WSD also needs an anneal length (lr_wsd_decay_iters) that this schema has no key for.
LR_DECAY_STYLES = ("constant", "linear", "cosine", "inverse-square-root")
# MindSpeed's context-parallel exchanges MindSpeed-RL accepts (actor_config.context_parallel_algo).
CP_ALGORITHMS = ("megatron_cp_algo", "ulysses_cp_algo")
OVERLONG_PROMPT_POLICIES = ("filter", "error")
# their entry points: cli/train_grpo.py, train_dapo.py, train_ppo.py, train_dpo.py
TRAINING_STAGES = ("ray_grpo", "ray_dapo", "ray_ppo", "dpo")
# Our fields of a dataset row; values of map_keys name where each lives in the row.
MAP_KEYS_REQUIRED = ("prompt", "labels")
MAP_KEYS_OPTIONAL = ("system",)
_DOTTED_PATH = re.compile(r"^[^.\s]+(\.[^.\s]+)*$")


@dataclass(kw_only=True)
class MegatronTrainingConfig:
    """`megatron_training`: Megatron arguments shared by every model role."""

    SECTION_KEY: ClassVar[str] = "megatron_training"

    # Name of the architecture block under top-level `model`; if set, must equal actor_config.model.
    model: Optional[str] = None
    # Kernel choices: honoured where the accelerator has the kernel, the plain one elsewhere (the
    # worker prints which requested kernels this device lacks).
    use_fused_rmsnorm: bool = False
    use_flash_attn: bool = False
    no_masked_softmax_fusion: bool = False
    # Megatron-LM's own default for bf16 training; the engine honours the value.
    attention_softmax_in_fp32: bool = True
    no_gradient_accumulation_fusion: bool = False
    use_fused_swiglu: bool = False
    use_fused_rotary_pos_emb: bool = False
    # Validated only: the engine always builds Megatron-core (mcore) GPT models.
    use_mcore_models: bool = True
    # Needs actor_config.tensor_model_parallel_size > 1 (checked in GRPOConfig).
    sequence_parallel: bool = False
    bf16: bool = False
    use_distributed_optimizer: bool = False
    # MindSpeed's swap optimizer: the optimizer states (Adam moments, fp32 masters) stay in host memory through every
    # phase; the step brings them to the device in swap_optimizer_times buckets (memory/swap_optimizer.py).
    swap_optimizer: bool = False
    swap_optimizer_times: int = 16
    # Validated only: the tokenizer is always the HF one in tokenizer_name_or_path.
    tokenizer_type: str = "PretrainedFromHF"
    # HF model directory: tokenizer, and the HF config/weights the engines are built from. null exactly
    # when synthetic_data.enabled generates the model (checked in GRPOConfig).
    tokenizer_name_or_path: Optional[str]
    # Prompts per iteration; the rollout has global_batch_size * rl_config.n_samples_per_prompt samples.
    global_batch_size: int
    # Save a checkpoint to actor_config.save every N iterations (and always after the last one);
    # null = only at the end (when actor_config.save is set).
    save_interval: Optional[int] = None
    # At the end of a successful run, write the actor's weights as an HF checkpoint directory to
    # <hydra run dir>/hf_export (safetensors, config, tokenizer), whatever actor_config.save says.
    save_hf: bool = False
    train_iters: int
    # ray_grpo (cli/train_grpo.py), ray_dapo (cli/train_dapo.py) or ray_ppo (cli/train_ppo.py): the same trainer,
    # DAPO's steps are rl_config keys, PPO's a critic_config; each entry point refuses the others' recipes so a
    # recipe runs as its authors ran it.
    stage: str = "ray_grpo"
    # DPO (stage dpo, cli/train_dpo.py; config/dpo.py, docs/dpo.md): MindSpeed-LLM's keys, which MindSpeed-RL's DPO
    # recipe sets here. The data are chosen/rejected pairs; the reference's weights are ref_model's (null: the
    # policy's initial ones).
    is_pairwise_dataset: bool = False
    dpo_loss_type: str = "sigmoid"
    dpo_beta: float = 0.1
    dpo_label_smoothing: float = 0.0
    pref_ftx: float = 0.0
    ref_model: Optional[str] = None
    refer_model_iter: int = 1
    # RL fine-tuning keeps dropout off (Megatron's default is 0.1) so that old and new log-probs of
    # the same weights agree.
    attention_dropout: float = 0.0
    hidden_dropout: float = 0.0
    # Ours. Response tokens whose log-probs and entropy are computed at a time, in fp32, from the vocabulary
    # shard (engines/vocab_parallel.py): the extra memory is about 12 x this x vocab/TP bytes, however long
    # the sequences (1024 x 152064 / 2 x 12 = 0.9 GiB for Qwen2.5 at TP2).
    logprob_chunk_tokens: int = 1024
    # Validated only: the label column is the one extra key, and the verifiers read it.
    dataset_additional_keys: list[str] = field(default_factory=lambda: ["labels"])
    # A .jsonl/.json/.parquet file, a directory of them, or a directory from cli/preprocess_data.py. null
    # exactly when synthetic_data.enabled generates the data (checked in GRPOConfig).
    data_path: Optional[str]
    # Ours. Held-out prompts for rl_config.eval_interval / eval_before_train, in data_path's formats and map_keys.
    eval_data_path: Optional[str] = None
    # Validated only: "N,0,0"; there are no validation/test splits (every row trains).
    split: str = "100,0,0"
    no_shuffle: bool = False
    seed: int = 1234
    # Ours. Prompt template name from configs/prompt_templates.yaml, or "chat" for the tokenizer's own
    # chat template; the data code checks the name against the template file.
    prompt_type: str = "empty"
    # Ours. Our row fields -> dotted paths in a dataset row: `prompt` and `labels` required, `system`
    # optional; e.g. DAPO-Math-17k: {prompt: prompt, labels: reward_model.ground_truth}. A YAML that
    # gives some of the fields keeps the defaults of the others (OmegaConf merges mappings).
    map_keys: dict[str, str] = field(default_factory=lambda: {"prompt": "prompt", "labels": "answer"})
    # Ours. Prompts longer than rl_config.max_prompt_length: "filter" drops them (count printed),
    # "error" stops at start. Never truncated.
    overlong_prompts: str = "filter"
    # Ours. A dataset smaller than global_batch_size: false = error at start, true = wrap around.
    wrap_small_dataset: bool = False

    def __post_init__(self) -> None:
        prefix = self.SECTION_KEY
        require_positive(prefix, self, "global_batch_size", "train_iters", "logprob_chunk_tokens", "swap_optimizer_times")
        require_in_range(prefix, self, "attention_dropout", 0.0, 1.0, high_open=True)
        require_in_range(prefix, self, "hidden_dropout", 0.0, 1.0, high_open=True)
        require_only(prefix, self, "use_mcore_models", True, "the engine builds Megatron-core (mcore) models only")
        require_only(prefix, self, "tokenizer_type", "PretrainedFromHF",
                     "the tokenizer is the HF one in megatron_training.tokenizer_name_or_path")
        require_choice(prefix, self, "stage", TRAINING_STAGES)
        if self.save_interval is not None and self.save_interval < 1:
            raise ConfigError(f"{prefix}.save_interval", f"must be a positive number of iterations or null, "
                                                        f"got {self.save_interval}")
        require_only(prefix, self, "dataset_additional_keys", ["labels"],
                     "the label column is the only extra dataset key and feeds rl_config.verifier_function")
        require_choice(prefix, self, "overlong_prompts", OVERLONG_PROMPT_POLICIES)
        if not self.prompt_type:
            raise ConfigError(f"{prefix}.prompt_type", "must name a prompt template (e.g. empty, chat), got ''")
        self._check_split()
        self._check_map_keys()
        check_dpo_keys(prefix, self)

    def _check_split(self) -> None:
        parts = self.split.split(",")
        try:
            weights = [float(part) for part in parts]
        except ValueError:
            weights = []
        if len(weights) != 3 or weights[0] <= 0 or weights[1:] != [0.0, 0.0]:
            raise ConfigError(
                f"{self.SECTION_KEY}.split",
                f"must be train-only 'N,0,0' like '100,0,0' (there are no validation or test splits: "
                f"every row of data_path trains), got {self.split!r}",
            )

    def _check_map_keys(self) -> None:
        key = f"{self.SECTION_KEY}.map_keys"
        missing = [name for name in MAP_KEYS_REQUIRED if name not in self.map_keys]
        if missing:
            required, absent = ", ".join(MAP_KEYS_REQUIRED), ", ".join(missing)
            raise ConfigError(key, f"must map {required} to row fields, missing {absent}")
        known = MAP_KEYS_REQUIRED + MAP_KEYS_OPTIONAL
        for name, path in self.map_keys.items():
            if name not in known:
                raise ConfigError(f"{key}.{name}", f"unknown field (known: {', '.join(known)})")
            if not _DOTTED_PATH.match(path):
                raise ConfigError(f"{key}.{name}", f"must be a dotted path into a row like reward_model.ground_truth, "
                                                   f"got {path!r}")


@dataclass(kw_only=True)
class ActorConfig:
    """`actor_config`: the actor's training layout and optimizer."""

    SECTION_KEY: ClassVar[str] = "actor_config"

    # Name of the architecture block under top-level `model`.
    model: str
    # Samples per forward/backward on one data-parallel rank.
    micro_batch_size: int
    tensor_model_parallel_size: int = 1
    pipeline_model_parallel_size: int = 1
    expert_model_parallel_size: int = 1
    # Megatron's context parallelism: each sequence split over this many ranks (models/context_parallel.py);
    # padded and packed micro-batches, Qwen2/Qwen3 and Qwen3-MoE.
    context_parallel_size: int = 1
    # MindSpeed's CP exchange (megatron_cp_algo: ring attention; ulysses_cp_algo: heads all-to-all, MindSpeed-RL's
    # default). Every one computes the same attention, which this engine computes by gathering each layer's keys and
    # values; the planner counts the named algorithm's buffers when it plans for an accelerator (planner/activations.py).
    # None: this engine's gather. hybrid_cp_algo is refused with CP > 1, as MindSpeed-RL's validate_config does.
    context_parallel_algo: Optional[str] = None
    # MindSpeed's TP-extended expert parallelism: the TP ranks hold whole experts (num_experts / (TP x EP) each) and,
    # with sequence parallelism, dispatch only their own s / TP tokens. Each rank holds 1/(TP x EP) of the expert
    # weights in either layout; the dispatched tokens differ, which the planner counts on an accelerator
    # (planner/activations.py). This engine splits each expert over TP instead (Megatron's layout).
    moe_tp_extend_ep: bool = False
    lr: float
    # Megatron's OptimizerParamScheduler: warmup over lr_warmup_fraction of all optimizer steps, then
    # decay to min_lr.
    lr_decay_style: str = "constant"
    min_lr: float = 0.0
    weight_decay: float = 0.01
    lr_warmup_fraction: float = 0.0
    # Global gradient-norm clip; 0 disables clipping (Megatron semantics).
    clip_grad: float = 1.0
    adam_beta1: float = 0.9
    adam_beta2: float = 0.999
    adam_eps: float = 1e-8
    # MindSpeed-RL: with `load` = one of our checkpoints, true loads its weights only (iteration 0),
    # false resumes the run (iteration, data order, optimizer, scheduler, RNG).
    finetune: bool = True
    # An HF directory (initial weights; None = megatron_training.tokenizer_name_or_path, or the model
    # synthetic_data generates), or one of our checkpoints (a dir with manifest.json, or a save root with
    # `latest`); see mindspeed_rl/checkpoint/FORMAT.md.
    load: Optional[str] = None
    # Save root for checkpoints (iter_NNNNNNN dirs + `latest`); null = never save.
    save: Optional[str] = None
    # MindSpeed-RL: on resume (finetune false), skip the optimizer (and scheduler) / RNG states.
    no_load_optim: bool = False
    no_load_rng: bool = False
    # MindSpeed-RL: checkpoints without the optimizer states (the fp32 masters and Adam moments, 6x a bf16 model's
    # bytes) / without the RNG states. A resume from one says in one line what restarts (checkpoint/trainer_state.py).
    no_save_optim: bool = False
    no_save_rng: bool = False
    # Ours. Keep only the newest N checkpoints under `save`; null keeps all.
    keep_last_n: Optional[int] = None
    # Megatron's activation recompute in the update (MindSpeed-RL's keys, Megatron's meaning): `full` keeps
    # only each recomputed layer's input and runs its forward again in backward; `selective` recomputes the
    # core attention only. `uniform` recomputes chunks of recompute_num_layers layers; `block` the first
    # recompute_num_layers layers of each pipeline stage. Same loss and gradients, fewer activation bytes.
    recompute_granularity: Optional[str] = None
    recompute_method: Optional[str] = None
    recompute_num_layers: Optional[int] = None
    # MindSpeed-RL's layers per pipeline stage, "16,17,16,15" (one count per stage, adding up to the model's
    # layers; checked against the model in config/algorithm_checks.py). Null: Megatron's even split.
    num_layer_list: Optional[str] = None
    # LoRA (MindSpeed-RL's keys, also read from megatron_training where its recipes put them; config/lora.py):
    # adapters of rank lora_r and scale lora_alpha / lora_r on the Megatron linears named in lora_target_modules
    # (linear_qkv, linear_proj, linear_fc1, linear_fc2); empty: no LoRA, every weight trains. lora_filter:
    # checkpoints hold the adapters only (the backbone is the HF checkpoint's). lora_fusion: MindSpeed's CCLoRA
    # overlap kernel on NPU, which computes the same adapters; true is listed as having no effect (config/no_effect.py).
    lora_r: int = 16
    lora_alpha: float = 32.0
    lora_target_modules: list[str] = field(default_factory=list)
    lora_filter: bool = False
    lora_fusion: bool = False

    def _check_context_parallel_algo(self) -> None:
        key, algo = f"{self.SECTION_KEY}.context_parallel_algo", self.context_parallel_algo
        if algo is not None and algo not in (*CP_ALGORITHMS, "hybrid_cp_algo"):
            raise ConfigError(key, f"must be one of {', '.join(CP_ALGORITHMS)} (or hybrid_cp_algo at "
                                   f"context_parallel_size 1), got {algo!r}")
        if algo == "hybrid_cp_algo" and self.context_parallel_size > 1:
            raise ConfigError(key, "hybrid_cp_algo is refused with context_parallel_size > 1, as MindSpeed-RL refuses "
                                   f"it (its validate_config: ring or Ulysses only); use one of {', '.join(CP_ALGORITHMS)}")

    @property
    def uses_lora(self) -> bool:
        return bool(self.lora_target_modules)

    @property
    def pipeline_stage_layers(self) -> Optional[tuple[int, ...]]:
        """num_layer_list as counts; None for the even split (unset, or PP 1)."""
        if self.num_layer_list is None or self.pipeline_model_parallel_size == 1:
            return None
        from mindspeed_rl.models.pipeline_stages import parse_num_layer_list

        return parse_num_layer_list(self.num_layer_list)

    def __post_init__(self) -> None:
        prefix = self.SECTION_KEY
        require_positive(
            prefix,
            self,
            "micro_batch_size",
            "tensor_model_parallel_size",
            "pipeline_model_parallel_size",
            "expert_model_parallel_size",
            "context_parallel_size",
            "lr",
            "adam_eps",
        )
        require_non_negative(prefix, self, "min_lr", "weight_decay", "clip_grad")
        self._check_context_parallel_algo()
        if self.min_lr > self.lr:
            raise ConfigError(f"{prefix}.min_lr", f"must be <= {prefix}.lr={self.lr}, got {self.min_lr}")
        require_choice(prefix, self, "lr_decay_style", LR_DECAY_STYLES)
        # Megatron asserts warmup steps < total steps.
        require_in_range(prefix, self, "lr_warmup_fraction", 0.0, 1.0, high_open=True)
        require_in_range(prefix, self, "adam_beta1", 0.0, 1.0, high_open=True)
        require_in_range(prefix, self, "adam_beta2", 0.0, 1.0, high_open=True)
        check_recompute(prefix, self)
        check_lora(prefix, self)
        if self.keep_last_n is not None and self.keep_last_n < 1:
            raise ConfigError(f"{prefix}.keep_last_n", f"must be >= 1 or null (keep all), got {self.keep_last_n}")


@dataclass(kw_only=True)
class CriticConfig(ActorConfig):
    """`critic_config` (PPO, MindSpeed-RL's section): the critic's training layout and optimizer, the same keys as
    actor_config's. `load`: its initial weights (an HF reward model, whose score head becomes the value head, or a
    causal LM with a fresh head; null: the actor's initial weights), or one of our checkpoints' critic. The
    critic is colocated with the actor: its parallel sizes are the actor's (config/algorithm_checks.py)."""

    SECTION_KEY: ClassVar[str] = "critic_config"

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.load:  # relative to where the run was launched, whichever directory a rank runs in
            self.load = os.path.abspath(os.path.expanduser(self.load))


RECOMPUTE_GRANULARITIES = ("full", "selective")
RECOMPUTE_METHODS = ("uniform", "block")


def check_recompute(prefix: str, actor: "ActorConfig") -> None:
    """Megatron's rules (TransformerConfig), said with the key: full needs a method and a layer count,
    selective takes neither."""
    granularity, method, layers = actor.recompute_granularity, actor.recompute_method, actor.recompute_num_layers
    if granularity is None:
        for name in ("recompute_method", "recompute_num_layers"):
            if getattr(actor, name) is not None:
                raise ConfigError(f"{prefix}.{name}", f"is read only with recompute_granularity full, got {getattr(actor, name)!r}")
        return
    require_choice(prefix, actor, "recompute_granularity", RECOMPUTE_GRANULARITIES)
    if granularity == "selective":
        for name in ("recompute_method", "recompute_num_layers"):
            if getattr(actor, name) is not None:
                raise ConfigError(f"{prefix}.{name}", f"must be null with recompute_granularity selective "
                                                      f"(it recomputes the core attention of every layer), got {getattr(actor, name)!r}")
        return
    require_choice(prefix, actor, "recompute_method", RECOMPUTE_METHODS)
    if layers is None or layers < 1:
        raise ConfigError(f"{prefix}.recompute_num_layers", f"must be >= 1 with recompute_granularity full, got {layers!r}")
