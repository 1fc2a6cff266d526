"""Every field of MindSpeed-RL's config classes loads here (issue 55, item 5): their class files are kept verbatim in
tests/data/mindspeed_rl_config_cls (from Ascend/MindSpeed-RL 05a90d77, 2026-04-22); each class's fields and defaults
are read from its `__init__` with ast (never imported: they import MindSpeed-RL), added at their defaults to the tiny
CPU recipe wherever the recipe does not set them, and the tree goes through load_config. No key may be "unknown"; the
multimodal keys say their one line only away from their defaults."""

import ast
from pathlib import Path
from typing import Any

import pytest
from omegaconf import OmegaConf

from mindspeed_rl.config import ConfigError, load_config
from mindspeed_rl.config.no_effect import NO_EFFECT_KEYS
from mindspeed_rl.config.their_keys import MULTIMODAL_DEFAULTS, MULTIMODAL_MESSAGE
from tests.test_config import TINY, compose_cfg, config_error, run_cli

CLASS_FILES = Path(__file__).resolve().parent / "data" / "mindspeed_rl_config_cls"
# Their default this engine refuses on purpose, with its reason in config/no_effect.py: false (learned absolute
# positions) is their MegatronConfig default, while every model of theirs and here uses RoPE.
REFUSED_DEFAULTS = {"megatron_training.use_rotary_position_embeddings"}
_UNSET = object()


def class_fields(path: Path) -> dict[str, dict[str, Any]]:
    """{class name: {field: default}} from each class's `__init__`: the first `self.<field> = <value>` of each field.
    A value that is not a literal (a constructor argument such as their `role`, a path computed at import) is no
    key of the YAML and is left out."""
    classes = {}
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.ClassDef):
            init = next(item for item in node.body if isinstance(item, ast.FunctionDef) and item.name == "__init__")
            arguments = {argument.arg for argument in init.args.args[1:]}
            defaults: dict[str, Any] = {}
            for statement in init.body:
                target = statement.targets[0] if isinstance(statement, ast.Assign) else None
                if (isinstance(target, ast.Attribute) and isinstance(target.value, ast.Name)
                        and target.value.id == "self" and target.attr not in defaults):
                    value = _literal(statement.value, defaults, arguments)
                    if value is not _UNSET:
                        defaults[target.attr] = value
            classes[node.name] = defaults
    return classes


def _literal(node: ast.expr, known: dict[str, Any], arguments: set[str]) -> Any:
    """A default: a literal, `self.<earlier field>`, `config_dict.get(key, default)`, or `a ** b`."""
    if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "self":
        return known.get(node.attr, _UNSET)
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "get":
        return _literal(node.args[1], known, arguments)
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Pow):
        base, exponent = _literal(node.left, known, arguments), _literal(node.right, known, arguments)
        return _UNSET if _UNSET in (base, exponent) else base ** exponent
    try:
        return ast.literal_eval(node)
    except ValueError:
        return _UNSET


def their_fields() -> dict[str, dict[str, Any]]:
    found: dict[str, dict[str, Any]] = {}
    for path in sorted(CLASS_FILES.glob("*.py")):
        found.update(class_fields(path))
    return found


def every_field_tree(overrides: dict[str, Any] | None = None) -> dict[str, Any]:
    """The tiny recipe plus every field of their classes at its default where the recipe sets none. Their
    MegatronConfig merges megatron_training, actor_config and the selected model block: a field goes where this
    engine reads it (its schema or its no-effect table), else into megatron_training. `overrides`: dotted keys set
    afterwards."""
    tree = OmegaConf.to_container(compose_cfg(TINY), resolve=False)
    fields = their_fields()
    block_name = tree["megatron_training"]["model"]
    megatron_homes = {"megatron_training": tree["megatron_training"], "actor_config": tree["actor_config"],
                      "model.*": tree["model"][block_name]}
    for key, default in fields["MegatronConfig"].items():
        if any(key in home for home in megatron_homes.values()):
            continue
        home = next((name for name in megatron_homes if _read_in(name, key)), "megatron_training")
        megatron_homes[home][key] = default
    for section, name in (("rl_config", "RLConfig"), ("generate_config", "GenerateConfig")):
        for key, default in fields[name].items():
            tree[section].setdefault(key, default)
    profiler = tree.setdefault("profiler_config", {}).setdefault("integrated", {})
    for key, default in fields["ProfilerConfig"].items():
        profiler.setdefault(key, default)
    tree["msprobe_config"] = dict(fields["MsprobeConfig"])
    for dotted, value in (overrides or {}).items():
        *parents, last = dotted.split(".")
        node = tree
        for parent in parents:
            node = node.setdefault(parent, {})
        node[last] = value
    return tree


def _read_in(section: str, key: str) -> bool:
    from dataclasses import fields as dataclass_fields

    from mindspeed_rl.config.megatron import ActorConfig, MegatronTrainingConfig
    from mindspeed_rl.config.model_arch import ModelArchConfig

    schema = {"megatron_training": MegatronTrainingConfig, "actor_config": ActorConfig, "model.*": ModelArchConfig}
    return key in {field.name for field in dataclass_fields(schema[section])} or f"{section}.{key}" in NO_EFFECT_KEYS


def load_errors(tree: dict[str, Any], notices: list[str] | None = None) -> list[ConfigError]:
    try:
        load_config(OmegaConf.create(tree), notices=notices)
    except ConfigError as error:
        return error.all()
    return []


def _keys(errors: list[ConfigError]) -> set[str]:
    return {error.key for error in errors}


def test_their_class_files_are_read_field_by_field() -> None:
    fields = their_fields()
    assert set(fields) == {"RLConfig", "GenerateConfig", "MegatronConfig", "ProfilerConfig", "MsprobeConfig"}
    assert fields["RLConfig"]["advantage_whiten"] is True and fields["RLConfig"]["data_strategy"] == "td"
    assert fields["RLConfig"]["ref_max_packing_token_size"] == 4096  # `self.max_packing_token_size`
    assert fields["RLConfig"]["mini_batch_size"] == 1  # the first assignment, not the one after update()
    assert fields["MegatronConfig"]["initial_loss_scale"] == 2 ** 32
    assert "role" not in fields["MsprobeConfig"]  # set by their code, not by the YAML
    assert len(fields["MegatronConfig"]) > 150 and len(fields["RLConfig"]) > 100


def test_every_field_at_its_default_is_no_unknown_key() -> None:
    errors = load_errors(every_field_tree())
    assert [str(error) for error in errors if "unknown key" in error.message] == []
    # What remains are the defaults refused on purpose (a value error each, saying what works), nothing else.
    assert _keys(errors) == REFUSED_DEFAULTS, [str(error) for error in errors]
    assert not any(MULTIMODAL_MESSAGE in error.message for error in errors)


def test_every_field_loads_with_the_refused_defaults_at_what_works() -> None:
    notices: list[str] = []
    config = load_config(OmegaConf.create(every_field_tree(dict.fromkeys(REFUSED_DEFAULTS, True))), notices=notices)
    listed = {notice.split(" ", 1)[0] for notice in notices}
    # Item 4's keys: each listed once at start with its reason (config/no_effect.py).
    assert {f"rl_config.{key}" for key in ("advantage_whiten", "data_strategy", "num_samples_per_step",
                                           "tp_split_expert", "runtime_env_path",
                                           "num_cpus_for_placement_group")} <= listed
    assert config.generate_config.data_parallel_size is None
    assert "msprobe_config" in listed  # the whole section, once: its switch is off
    # The multimodal keys at their defaults are accepted silently.
    assert not listed & set(MULTIMODAL_DEFAULTS)


def test_a_multimodal_key_off_its_default_is_one_line() -> None:
    errors = load_errors(every_field_tree({**dict.fromkeys(REFUSED_DEFAULTS, True), "rl_config.is_multimodal": True,
                                           "generate_config.limit_mm_image_per_prompt": 4}))
    assert [str(error) for error in errors] == [
        f"rl_config.is_multimodal: {MULTIMODAL_MESSAGE} (also set: generate_config.limit_mm_image_per_prompt); "
        "leave the multimodal keys at their defaults"]


@pytest.mark.parametrize("value, expected", [
    ("/path/to/tokenizer", []),  # their GenerateConfig's placeholder default, which nothing of theirs reads
    ("data/tok/", []),  # the same path
    ("data/other", ["generate_config.tokenizer_name_or_path: must equal megatron_training.tokenizer_name_or_path "
                    "('data/tok'), got 'data/other': one tokenizer serves Megatron and vLLM (MindSpeed-RL's vLLM "
                    "engine reads megatron_training's too); leave it out or set the same path"]),
])
def test_generate_tokenizer_must_name_megatron_trainings(value: str, expected: list[str]) -> None:
    from mindspeed_rl.config.their_keys import lift_generate_tokenizer

    tree = {"megatron_training": {"tokenizer_name_or_path": "data/tok"},
            "generate_config": {"tokenizer_name_or_path": value}}
    assert [str(error) for error in lift_generate_tokenizer(tree)] == expected
    assert tree == {"megatron_training": {"tokenizer_name_or_path": "data/tok"}, "generate_config": {}}


def test_generate_data_parallel_size_must_match_the_inference_layout() -> None:
    overrides = dict.fromkeys(REFUSED_DEFAULTS, True)
    config = load_config(OmegaConf.create(every_field_tree({**overrides, "generate_config.data_parallel_size": 1})))
    assert config.infer_data_parallel_size == 1
    errors = load_errors(every_field_tree({**overrides, "generate_config.data_parallel_size": 2}))
    assert [str(error) for error in errors] == [
        "generate_config.data_parallel_size: must equal the inference data-parallel size 1 (inference devices 1 / "
        "(infer_tensor_parallel_size 1 x infer_pipeline_parallel_size 1)), got 2; or leave it null (derived)"]


def test_msprobe_on_loads_with_its_dump_path_made_absolute() -> None:
    overrides = dict.fromkeys(REFUSED_DEFAULTS, True)
    config = load_config(OmegaConf.create(every_field_tree({**overrides, "msprobe_config.msprobe": True,
                                                            "msprobe_config.dump_path": "rel/dump"})))
    assert config.msprobe_config.msprobe and config.msprobe_config.dump_path == str(Path("rel/dump").resolve())


def test_msprobe_on_without_the_package_is_one_error_saying_how_to_install_it(monkeypatch) -> None:
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "msprobe" else real(name, *a))
    overrides = dict.fromkeys(REFUSED_DEFAULTS, True)
    errors = load_errors(every_field_tree({**overrides, "msprobe_config.msprobe": True}))
    assert _keys(errors) == {"msprobe_config.msprobe"} and "pip install mindstudio-probe" in errors[0].message


def test_msprobe_on_with_a_disaggregated_actor_is_refused_as_theirs_collects_colocated_only() -> None:
    message = config_error("grpo_tiny_cpu_disaggregated", "+msprobe_config.msprobe=true")
    assert message.startswith("msprobe_config.msprobe: true with a disaggregated actor"), message


def test_msprobe_keys_are_checked_whether_on_or_off() -> None:
    overrides = dict.fromkeys(REFUSED_DEFAULTS, True)
    errors = load_errors(every_field_tree({**overrides, "msprobe_config.step_start": 3,
                                           "msprobe_config.dump_pth": "x", "msprobe_config.key_data_dump": 1}))
    assert [str(error) for error in errors][:2] == [
        "msprobe_config.key_data_dump: expected bool, got 1",
        "msprobe_config.dump_pth: unknown key (valid keys of msprobe_config: msprobe, dump_path, key_data_dump, "
        "configurations_dump, actor_train_dump, actor_infer_dump, token_range_start, token_range_end, reference_dump, "
        "critic_train_dump, step_start, step_end)"]
    for switch in (False, True):
        errors = load_errors(every_field_tree({**overrides, "msprobe_config.step_start": 3,
                                               "msprobe_config.msprobe": switch}))
        assert [str(error) for error in errors] == ["msprobe_config.step_end: must be >= step_start=3, got 0"]
    errors = load_errors(every_field_tree({**overrides, "runtime.strict_keys": True}))
    assert "msprobe_config" in _keys(errors)


def test_cli_says_every_error_of_these_keys_at_once_and_exits_2(tmp_path: Path) -> None:
    # (generate_config.data_parallel_size is a check across sections, made once every section is valid.)
    result = run_cli(tmp_path, "--config-name", TINY, "+rl_config.is_multimodal=true", "+msprobe_config.step_start=1",
                     "+generate_config.tokenizer_name_or_path=./other")
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert all(line.startswith("config error: ") for line in lines), lines
    assert {line.split(":", 2)[1].strip() for line in lines} == {
        "rl_config.is_multimodal", "msprobe_config.step_end", "generate_config.tokenizer_name_or_path"}


def test_packing_needs_their_two_megatron_flags_true_as_their_validate_config_does() -> None:
    from mindspeed_rl.config.their_keys import packing_flag_errors

    tree = {"rl_config": {"use_remove_padding": True},
            "actor_config": {"pipeline_model_parallel_size": 2},
            "megatron_training": {"reset_attention_mask": False, "no_pad_to_seq_lengths": False}}
    assert [error.key for error in packing_flag_errors(tree)] == ["megatron_training.reset_attention_mask",
                                                                  "megatron_training.no_pad_to_seq_lengths"]
    tree["rl_config"]["use_remove_padding"] = False  # nothing packed: either value computes the same
    assert packing_flag_errors(tree) == []
