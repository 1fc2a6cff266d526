"""How a config's errors reach the user (in-process and through the CLIs): all of them in one run, plain
overrides of keys a YAML leaves out, and a user's --config-dir winning over ours."""

import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from mindspeed_rl.config import ConfigError, ConfigErrors
from mindspeed_rl.errors import error_lines, run_checks
from mindspeed_rl.config.overrides import as_upsert, hydra_argv
from tests.test_config import CONFIG_DIR, QWEN_7B, TINY, load, run_cli

REPO_ROOT = Path(__file__).resolve().parents[1]

# One bad key of each kind the loader finds: removed, unknown, mistyped, a value one section refuses, a value
# another section refuses.
FIVE_BAD_KEYS = {
    "+ref_config.micro_batch_size=1": "ref_config: not supported:",
    "+rl_config.learning_rate=1": "rl_config.learning_rate: unknown key",
    "actor_config.lr=fast": "actor_config.lr: expected float, got 'fast'",
    "rl_config.clip_ratio=-1": "rl_config.clip_ratio: must be > 0",
    "generate_config.sampling_config.temperature=0": "generate_config.sampling_config.temperature: must be > 0",
}


def test_five_bad_keys_are_reported_in_one_run() -> None:
    with pytest.raises(ConfigErrors) as info:
        load(TINY, *FIVE_BAD_KEYS)
    lines = str(info.value).splitlines()
    assert len(lines) == 5
    for expected in FIVE_BAD_KEYS.values():
        assert sum(line.startswith(expected) for line in lines) == 1, (expected, lines)


def test_the_cli_prints_every_error_one_line_each_and_exits_2(tmp_path: Path) -> None:
    result = run_cli(tmp_path, "--config-name", TINY, *FIVE_BAD_KEYS)
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 5 and all(line.startswith("config error: ") for line in lines), result.stderr
    assert "Traceback" not in result.stderr


def test_checks_across_sections_report_each_failure() -> None:
    message = str(load_error(QWEN_7B, "actor_config.tensor_model_parallel_size=3", "rl_config.mini_batch_size=7"))
    assert "actor_config.tensor_model_parallel_size: must divide rl_config.actor_resource.num_npus=16" in message
    assert "rl_config.mini_batch_size" in message


def load_error(name: str, *overrides: str) -> ConfigError:
    with pytest.raises(ConfigError) as info:
        load(name, *overrides)
    return info.value


def test_a_check_broken_by_an_earlier_error_is_not_reported() -> None:
    def bad() -> None:
        raise ConfigError("a", "bad")

    def consequence() -> None:
        raise ZeroDivisionError

    with pytest.raises(ConfigError, match="^a: bad$"):
        run_checks(bad, consequence)
    with pytest.raises(ZeroDivisionError):
        run_checks(consequence)


def test_the_same_error_from_two_checks_is_said_once() -> None:
    def bad() -> None:
        raise ConfigError("a", "bad")

    with pytest.raises(ConfigError) as info:
        run_checks(bad, bad)
    assert error_lines(info.value) == ["config error: a: bad"]


def test_config_errors_survive_pickling() -> None:
    import pickle

    errors = ConfigErrors([ConfigError("a", "one"), ConfigError("b", "two")])
    assert str(pickle.loads(pickle.dumps(errors))) == "a: one\nb: two"


@pytest.mark.parametrize("override, expected", [
    ("runtime.device=cpu", "++runtime.device=cpu"),
    ("+runtime.device=cpu", "+runtime.device=cpu"),
    ("~runtime.device", "~runtime.device"),
    ("hydra.run.dir=out", "hydra.run.dir=out"),
    ("model=qwen25_7b", "model=qwen25_7b"),  # a config group's choice, not a value
    ("--config-name=x", "--config-name=x"),
])
def test_plain_overrides_become_upserts(override: str, expected: str) -> None:
    assert as_upsert(override) == expected


def test_config_dir_becomes_the_primary_path_with_ours_after_it(tmp_path: Path) -> None:
    argv = hydra_argv(["train", "--config-name", "x", "--config-dir", str(tmp_path), "a.b=1"], our_config_dir="/ours")
    assert argv == ["train", "--config-path", str(tmp_path), "--config-name", "x", "hydra.searchpath=[file:///ours]",
                    "++a.b=1"]


def _user_dir(tmp_path: Path) -> Path:
    """A user's folder: our tiny recipe without its runtime block, with 4 samples per prompt and 3 layers, under
    our name, and a model block of our name with 3 layers (ours has 2: with it the recipe would not load)."""
    recipe = yaml.safe_load((CONFIG_DIR / f"{TINY}.yaml").read_text())
    del recipe["runtime"]
    recipe["rl_config"]["n_samples_per_prompt"] = 4
    recipe["synthetic_data"]["num_layers"] = 3
    (tmp_path / "user").mkdir()
    (tmp_path / "user" / f"{TINY}.yaml").write_text(yaml.safe_dump(recipe))
    (tmp_path / "user" / "model").mkdir()
    block = yaml.safe_load((CONFIG_DIR / "model" / "tiny_qwen2.yaml").read_text())
    block["tiny_qwen2"]["num_layers"] = 3
    (tmp_path / "user" / "model" / "tiny_qwen2.yaml").write_text(yaml.safe_dump(block))
    return tmp_path / "user"


def test_a_config_dir_recipe_wins_over_ours_and_takes_a_runtime_override(tmp_path: Path) -> None:
    user = _user_dir(tmp_path)
    result = run_cli(tmp_path, "--config-dir", str(user), "--config-name", TINY, "runtime.device=cpu", "--cfg", "job")
    assert result.returncode == 0, result.stderr
    job = yaml.safe_load(result.stdout)
    assert job["rl_config"]["n_samples_per_prompt"] == 4  # theirs, not our 16
    assert job["model"]["tiny_qwen2"]["num_layers"] == 3  # their model block too
    assert job["runtime"] == {"device": "cpu"}


def test_the_planner_reads_a_config_dir_recipe_without_runtime(tmp_path: Path) -> None:
    user = _user_dir(tmp_path)
    result = subprocess.run(
        [sys.executable, str(REPO_ROOT / "cli" / "plan.py"), "--config-dir", str(user), "--config-name", TINY,
         "runtime.device=cpu", "--json", "-"],
        cwd=tmp_path, capture_output=True, text=True, timeout=120,
    )
    assert result.returncode == 0, result.stderr  # with our 2-layer block: "must equal synthetic_data.num_layers=3"
