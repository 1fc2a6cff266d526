"""Every key of the config schema takes effect: no key is accepted and then ignored.

A key (a field of a config dataclass, walked from GRPOConfig through nested sections and the model
block) has a reader when code in `mindspeed_rl/` or `cli/` reads it as an attribute (AST, not text):

- outside `mindspeed_rl/config/`: the engines, workers, trainer and CLI, where keys take effect;
- in `mindspeed_rl/config/model_check.py`, which the trainer calls at start to compare the model
  block with the checkpoint the engines build (that comparison is the block's effect);
- in `mindspeed_rl/config/resources.py`, whose ResourcePlan is the actor's world size when
  `actor_train.device_mapping` gives it, the device -> roles table the trainer prints and the cluster
  check it runs at start (`GRPOConfig.resource_plan`, read by the trainer);
- in the body of a config property (e.g. `GRPOConfig.world_size`) that itself has a reader.

Validation elsewhere in `mindspeed_rl/config/` is not an effect. Keys whose only effect is to
reject every value but the one this engine implements are listed in VALIDATED_ONLY with the reason.

The scan matches attribute names, not types (Python has none to read here): `x.f` counts for every
config dataclass with a field `f`, except that `<...>.<section>.f` (e.g. `config.rl_config.epochs`,
`gen.sampling_config.logprobs`) counts only for that section. A common name (`dtype`, `seed`) can
therefore be matched by an unrelated object; a key with no match at all certainly has no reader.
"""

import ast
import inspect
import textwrap
import typing
from dataclasses import fields, is_dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any, Optional, Union

from mindspeed_rl.config import GRPOConfig

REPO_ROOT = Path(__file__).resolve().parents[1]
CONFIG_PACKAGE = REPO_ROOT / "mindspeed_rl" / "config"
# Config modules whose reads are effects: the trainer calls this one against the real checkpoint.
EFFECT_MODULES_IN_CONFIG = {CONFIG_PACKAGE / "model_check.py", CONFIG_PACKAGE / "resources.py"}
MODEL_BLOCK = "model.*"

VALIDATED_ONLY: dict[str, str] = {
    "megatron_training.use_mcore_models": "true only: the engine builds Megatron-core models",
    "megatron_training.tokenizer_type": "PretrainedFromHF only: the tokenizer is the HF one in tokenizer_name_or_path",
    "megatron_training.split": "'N,0,0' only: no validation/test splits, every row trains",
    "megatron_training.dataset_additional_keys": "['labels'] only: the label column feeds the verifiers",
    "rl_config.use_integrated_worker": "true only: the integrated worker is the only worker",
    "generate_config.data_parallel_size": "the inference layout's DP only (MindSpeed-RL derives it and overwrites what "
                                          "is written; config/their_keys.py)",
    "rl_config.rule_reward": "true only: rule verifiers are the only reward",
    "generate_config.enable_expert_parallel": "infer_expert_parallel_size > 1 only, which the engine reads",
    "actor_config.num_layer_list": "the layers of each training pipeline stage (Megatron's pipeline layout)",
    "rl_config.critic_resource": "the critic's device count only (its devices: the actor's, or critic.device_mapping)",
    "actor_config.lora_fusion": "the schema keeps false; true (MindSpeed's CCLoRA kernel) is a listed no-effect knob",
    "critic_config.lora_fusion": "the schema keeps false; true (MindSpeed's CCLoRA kernel) is a listed no-effect knob",
    "critic_config.context_parallel_algo": "checked as actor_config's; the planner counts the critic's update with "
                                           "actor_config.context_parallel_algo (the critic shares the actor's layout)",
    "critic_config.moe_tp_extend_ep": "the critic shares the actor's layout; the planner counts the critic's update with "
                                      "actor_config.moe_tp_extend_ep",
    **{f"profiler_config.integrated.{key}": "an Ascend-profiler choice torch.profiler lacks: checked, and listed at "
                                            "start as having no effect when profiling asks for it (config/profiler.py)"
       for key in ("profile_export_type", "profile_level", "profile_analysis")},
    "distillation.teacher_key": "verl's routing among several teachers: one teacher is accepted here, which takes "
                                "every sample (verl ignores the key with one teacher too)",
    "distillation.n_gpus_per_node": "verl's teacher pool: its size is n_gpus_per_node x nnodes, and nnodes must be 0 "
                                    "here (a teacher's own devices are ROLL's teacher.device_mapping)",
    "distillation.nnodes": "0 only: a teacher's own devices are ROLL's teacher.device_mapping (config/distillation.py)",
    "distillation.teacher_models.*.inference": "verl's teacher-server sizes: tensor_model_parallel_size and "
                                               "pipeline_model_parallel_size are a teacher's own layout on devices of "
                                               "its own (config/distillation.teacher_layout); other keys are refused",
    "distillation.distillation_loss.policy_loss_mode": "vanilla only, the one verl implements (PG OPD's PPO-clip loss)",
    "runtime.strict_keys": "read by config/loader.py from the raw tree, before the schema: no-effect keys become errors",
    "rl_config.rollout_correction.preset": "applied at load: it sets the rollout_is/rs keys it names "
                                           "(config/rollout_correction.py), which the correction reads",
    "rl_config.rollout_correction.rollout_rs_threshold_lower": "verl's key before 97eac9048, deprecated: mapped at "
                                                               "load into rollout_rs_threshold's lower_upper string, "
                                                               "which the correction reads",
    "rl_config.rollout_correction.bypass_mode": "false only: verl's bypass mode is refused at load, saying why",
    "rl_config.rollout_correction.loss_type": "ppo_clip only (verl's bypass-mode loss; reinforce refused, saying why)",
    # ROLL's role sections (config/resources.py): parsed, computed and checked; the values other than
    # these are refused at load as not supported yet, so they are listed here although resources.py reads them.
    "actor_train.num_gpus_per_worker": "1 only: a training role has one device per worker (computed)",
    "reference.num_gpus_per_worker": "1 only: a training role has one device per worker (computed)",
    "actor_infer.num_gpus_per_worker": "infer TP x PP only: vLLM's devices per worker (computed)",
    "actor_train.world_size": "len(device_mapping) // num_gpus_per_worker only (computed)",
    "actor_infer.world_size": "len(device_mapping) // num_gpus_per_worker only (computed)",
    "reference.world_size": "len(device_mapping) // num_gpus_per_worker only (computed)",
    "actor_infer.device_mapping": "actor_train's devices only: disaggregated or partly shared roles are not supported yet",
    "reference.device_mapping": "actor_train's devices only: a reference on other devices is not supported yet",
    "rewards.*.device_mapping": "a reward model: actor_train's devices or null; rule workers: null (CPU-only)",
    "rewards.*.num_gpus_per_worker": "0 for rule workers, 1 for a reward model (computed)",
    f"{MODEL_BLOCK}.use_mcore_models": "true only: the engine builds Megatron-core models",
    f"{MODEL_BLOCK}.make_vocab_size_divisible_by": "1 only: the embedding has the checkpoint's vocab_size rows",
    f"{MODEL_BLOCK}.disable_bias_linear": "true only: Qwen linear layers have no bias (QKV bias is add_qkv_bias)",
    f"{MODEL_BLOCK}.position_embedding_type": "rope only: the Qwen family",
    f"{MODEL_BLOCK}.normalization": "RMSNorm only: the Qwen family",
    f"{MODEL_BLOCK}.swiglu": "true only: the Qwen family",
}


# --- the schema ----------------------------------------------------------------------------------


def _strip_optional(annotation: Any) -> Any:
    if typing.get_origin(annotation) is Union:
        args = [arg for arg in typing.get_args(annotation) if arg is not type(None)]
        return args[0] if len(args) == 1 else annotation
    return annotation


def _section_class(annotation: Any) -> Optional[type]:
    """The dataclass a field holds: directly, optionally, or as the values of a mapping (`model`)."""
    inner = _strip_optional(annotation)
    if typing.get_origin(inner) is dict:
        inner = typing.get_args(inner)[1]
    return inner if is_dataclass(inner) else None


def schema_keys(cls: type = GRPOConfig, prefix: str = "") -> list[tuple[str, type, str]]:
    """(dotted key, owning dataclass, field name) for every field, nested sections included."""
    keys = []
    hints = typing.get_type_hints(cls)
    for f in fields(cls):
        key = f"{prefix}{f.name}"
        keys.append((key, cls, f.name))
        child = _section_class(hints[f.name])
        if child is not None:
            is_mapping = typing.get_origin(_strip_optional(hints[f.name])) is dict
            keys += schema_keys(child, f"{key}.*." if is_mapping else f"{key}.")
    return keys


def config_classes() -> set[type]:
    return {GRPOConfig} | {cls for _, cls, _ in schema_keys()}


def section_attributes() -> dict[str, set[type]]:
    """Attribute name -> the dataclasses reached through it (`rl_config` -> RLConfig)."""
    by_name: dict[str, set[type]] = {}
    for cls in config_classes():
        hints = typing.get_type_hints(cls)
        for f in fields(cls):
            child = _section_class(hints[f.name])
            if child is not None and typing.get_origin(_strip_optional(hints[f.name])) is not dict:
                by_name.setdefault(f.name, set()).add(child)
    return by_name


# --- the code ------------------------------------------------------------------------------------

Read = tuple[Optional[str], str]  # (section attribute the receiver ends in, or None; attribute read)


def _reads_in(node: ast.AST) -> set[Read]:
    reads: set[Read] = set()
    for sub in ast.walk(node):
        if isinstance(sub, ast.Attribute) and isinstance(sub.ctx, ast.Load):
            receiver = sub.value.attr if isinstance(sub.value, ast.Attribute) else None
            reads.add((receiver, sub.attr))
        elif (
            isinstance(sub, ast.Call)
            and isinstance(sub.func, ast.Name)
            and sub.func.id == "getattr"
            and len(sub.args) >= 2
            and isinstance(sub.args[1], ast.Constant)
            and isinstance(sub.args[1].value, str)
        ):
            reads.add((None, sub.args[1].value))
    return reads


def _source_files() -> list[Path]:
    return sorted([*(REPO_ROOT / "mindspeed_rl").rglob("*.py"), *(REPO_ROOT / "cli").rglob("*.py")])


@lru_cache(maxsize=1)
def effect_reads() -> frozenset[Read]:
    """Reads where keys take effect, plus the reads of config properties that have such readers."""
    reads: set[Read] = set()
    for path in _source_files():
        if path.parent == CONFIG_PACKAGE and path not in EFFECT_MODULES_IN_CONFIG:
            continue
        reads |= _reads_in(ast.parse(path.read_text(encoding="utf-8"), filename=str(path)))
    # A property read where keys take effect passes the effect on to what it reads (world_size ->
    # num_npus). Repeat until stable: properties may read properties.
    properties = _config_properties()
    while True:
        names = {name for _, name in reads}
        added = set().union(*(body for name, body in properties.items() if name in names)) - reads
        if not added:
            return frozenset(reads)
        reads |= added


def _config_properties() -> dict[str, set[Read]]:
    properties: dict[str, set[Read]] = {}
    for cls in config_classes():
        for name, member in inspect.getmembers(cls, lambda m: isinstance(m, property)):
            tree = ast.parse(textwrap.dedent(inspect.getsource(member.fget)))
            properties.setdefault(name, set()).update(_reads_in(tree))
    return properties


def has_reader(cls: type, field_name: str, reads: frozenset[Read]) -> bool:
    sections = section_attributes()
    for receiver, name in reads:
        if name != field_name:
            continue
        if receiver in sections and cls not in sections[receiver]:
            continue  # `<...>.rl_config.seed` reads RLConfig's field, not another section's
        return True
    return False


# --- tests ---------------------------------------------------------------------------------------


def test_every_config_key_has_a_reader_or_is_validated_only() -> None:
    from mindspeed_rl.config.no_effect import NO_EFFECT_KEYS

    reads = effect_reads()
    # A listed no-effect key (critic_config.save: actor_config.save decides) is dropped, with its notice, before
    # the schema sees the tree: its field keeps the default whatever the YAML says.
    unread = [
        key
        for key, cls, name in schema_keys()
        if key not in VALIDATED_ONLY and key not in NO_EFFECT_KEYS and not has_reader(cls, name, reads)
    ]
    assert unread == [], f"keys accepted and then ignored (give them an effect, or remove them): {unread}"


def test_validated_only_lists_schema_keys() -> None:
    keys = {key for key, _, _ in schema_keys()}
    assert sorted(set(VALIDATED_ONLY) - keys) == []


def test_schema_walk_reaches_nested_sections_and_the_model_block() -> None:
    keys = {key for key, _, _ in schema_keys()}
    assert {"generate_config.sampling_config.logprobs", "rl_config.actor_resource.num_npus",
            "rl_config.integrated_mode_config.ref_model_load_path", "model.*.num_layers",
            "synthetic_data.task"} <= keys


def test_model_check_is_called_where_keys_take_effect() -> None:
    # The model block's fields count as read in model_check.py only because the trainer calls it.
    reads = set()
    for path in _source_files():
        if path.parent != CONFIG_PACKAGE:
            reads |= {name for _, name in _reads_in(ast.parse(path.read_text(encoding="utf-8")))}
            reads |= _names_in(path)
    assert "check_model_block_against_hf" in reads


def test_the_resource_plan_is_read_where_keys_take_effect() -> None:
    # resources.py's reads count as effects only because the trainer reads the plan it builds.
    reads = set()
    for path in _source_files():
        if path.parent != CONFIG_PACKAGE:
            reads |= {name for _, name in _reads_in(ast.parse(path.read_text(encoding="utf-8")))}
    assert {"resource_plan", "table", "check_ray_cluster"} <= reads


def _names_in(path: Path) -> set[str]:
    tree = ast.parse(path.read_text(encoding="utf-8"))
    return {node.id for node in ast.walk(tree) if isinstance(node, ast.Name)}


def test_reader_scan_sees_section_chains_and_getattr() -> None:
    tree = ast.parse("x = cfg.rl_config.epochs\ny = getattr(arch, 'swiglu')\nz = mt.seed")
    assert _reads_in(tree) >= {("rl_config", "epochs"), (None, "swiglu"), (None, "seed")}


def test_a_read_through_another_section_does_not_count() -> None:
    from mindspeed_rl.config import RLConfig

    assert not has_reader(RLConfig, "epochs", frozenset({("generate_config", "epochs")}))
    assert has_reader(RLConfig, "epochs", frozenset({("rl_config", "epochs")}))
    assert has_reader(RLConfig, "epochs", frozenset({(None, "epochs")}))
    assert not has_reader(RLConfig, "epochs", frozenset({(None, "epoch")}))
