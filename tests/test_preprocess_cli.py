"""`cli/preprocess_data.py`: MindSpeed-RL's offline preprocessing flow, and the trainer's loading of its output.

Runs where: two tests start the CLI as a subprocess (one process, CPU, ~10 s each: imports torch,
transformers, datasets); the others call its `main(argv)` in-process. No download: the rows are
written here in DeepScaleR's and DAPO-Math-17k's schemas, the tokenizer is trained here.
"""

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest
from test_dataset import DAPO_KEYS, dapo_rows, write_dapo_parquet
from test_templates import build_tokenizer

from mindspeed_rl.config import ConfigError
from mindspeed_rl.data.dataset import PREPROCESSED_META_FILE, load_prompt_dataset

REPO = Path(__file__).resolve().parents[1]
CLI = REPO / "cli" / "preprocess_data.py"


def _cli_module():
    spec = importlib.util.spec_from_file_location("preprocess_data_cli", CLI)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


cli = _cli_module()


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory):
    out = tmp_path_factory.mktemp("tokenizer")
    build_tokenizer(out)
    return out


@pytest.fixture(scope="module")
def tokenizer(tokenizer_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(tokenizer_dir))


def deepscaler_json(tmp_path):
    rows = [{"problem": f"What is {i} + 4?", "answer": str(i + 4), "solution": "."} for i in range(6)]
    path = tmp_path / "deepscaler.json"
    path.write_text(json.dumps(rows))
    return path


def run_main(*overrides, config_name="deepscaler"):
    return cli.main(["--config-name", config_name, *overrides])


def test_cli_writes_a_dataset_the_trainer_loads_without_retokenizing(tmp_path, tokenizer_dir, tokenizer):
    """Subprocess, the user's command: DAPO-Math-17k parquet through the chat template, one prompt too long."""
    rows = dapo_rows(4)
    rows[2]["prompt"][0]["content"] = "A conversation between User and Assistant. " * 10
    import datasets
    datasets.Dataset.from_list(rows).to_parquet(str(tmp_path / "dapo.parquet"))
    lengths = [len(tokenizer.apply_chat_template(r["prompt"], add_generation_prompt=True)["input_ids"]) for r in rows]
    seq_length = max(lengths[:2] + lengths[3:])
    out = tmp_path / "out" / "data"
    done = subprocess.run(
        [sys.executable, str(CLI), "--config-name", "dapo_math_17k", f"input={tmp_path / 'dapo.parquet'}",
         f"tokenizer_name_or_path={tokenizer_dir}", f"output_prefix={out}", "prompt_type=chat",
         f"seq_length={seq_length}"], cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert f"3 prompts written to {out} (1 longer than seq_length={seq_length} dropped)" in done.stdout
    assert "tokenizing prompts" not in done.stderr  # 3 prompts, off a terminal: no bar (mindspeed_rl/console.py)
    meta = json.loads((out / PREPROCESSED_META_FILE).read_text())
    assert meta["prompt_type"] == "chat" and meta["tokenizer_name_or_path"] == str(tokenizer_dir)

    kwargs = dict(tokenizer=tokenizer, prompt_type="chat", map_keys=DAPO_KEYS, max_prompt_length=seq_length,
                  show_progress=False)
    preprocessed, direct = load_prompt_dataset(str(out), **kwargs), load_prompt_dataset(str(tmp_path / "dapo.parquet"), **kwargs)
    assert preprocessed.records == direct.records
    assert preprocessed.num_filtered == direct.num_filtered == 1


def test_cli_config_error_is_one_line_and_exit_2(tmp_path, tokenizer_dir):
    done = subprocess.run(
        [sys.executable, str(CLI), "--config-name", "deepscaler", f"input={deepscaler_json(tmp_path)}",
         f"tokenizer_name_or_path={tokenizer_dir}", f"output_prefix={tmp_path / 'out'}", "prompt_type=qwen"],
        cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert done.returncode == 2
    assert "Traceback" not in done.stderr
    assert done.stderr.strip().splitlines() == [
        f"config error: prompt_type: unknown template 'qwen'; known: chat, empty, qwen_math_r1, qwen_r1, qwen_retool "
        f"(named templates live in {REPO / 'configs' / 'prompt_templates.yaml'})"]


def test_deepscaler_round_trip_with_qwen_r1(tmp_path, tokenizer_dir, tokenizer):
    source = deepscaler_json(tmp_path)
    out = tmp_path / "data"
    assert run_main(f"input={source}", f"tokenizer_name_or_path={tokenizer_dir}", f"output_prefix={out}") == 0
    kwargs = dict(tokenizer=tokenizer, prompt_type="qwen_r1", map_keys={"prompt": "problem", "labels": "answer"},
                  max_prompt_length=2048, show_progress=False)
    assert load_prompt_dataset(str(out), **kwargs).records == load_prompt_dataset(str(source), **kwargs).records


def test_mindspeed_rl_style_config_in_its_own_config_dir(tmp_path, tokenizer_dir):
    """A user's own YAML (--config-dir) with MindSpeed-RL's map_keys spelling from its deepscaler.yaml."""
    (tmp_path / "configs").mkdir()
    (tmp_path / "configs" / "my_data.yaml").write_text(
        f"input: {deepscaler_json(tmp_path)}\ntokenizer_name_or_path: {tokenizer_dir}\n"
        f"output_prefix: {tmp_path / 'data'}\nprompt_type: qwen_r1\nseq_length: 1024\n"
        'map_keys: {"prompt":"problem", "query":"", "response": "answer", "system":""}\n')
    assert cli.main(["--config-dir", str(tmp_path / "configs"), "--config-name", "my_data"]) == 0
    assert json.loads((tmp_path / "data" / PREPROCESSED_META_FILE).read_text())["num_records"] == 6


def test_rerun_replaces_the_previous_output(tmp_path, tokenizer_dir, capsys):
    out = tmp_path / "data"
    common = [f"tokenizer_name_or_path={tokenizer_dir}", f"output_prefix={out}", "prompt_type=empty",
              f"map_keys={{prompt: prompt, labels: {DAPO_KEYS['labels']}}}"]
    assert run_main(f"input={write_dapo_parquet(tmp_path / 'a.parquet', 3)}", *common) == 0
    assert run_main(f"input={write_dapo_parquet(tmp_path / 'b.parquet', 5)}", *common) == 0
    assert json.loads((out / PREPROCESSED_META_FILE).read_text())["num_records"] == 5
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".data.")]  # no staging left behind


def test_output_over_a_foreign_directory_is_refused(tmp_path, tokenizer_dir, capsys):
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "keep.txt").write_text("mine")
    code = run_main(f"input={deepscaler_json(tmp_path)}", f"tokenizer_name_or_path={tokenizer_dir}",
                    f"output_prefix={tmp_path / 'data'}")
    assert code == 2
    assert "config error: output_prefix: " in capsys.readouterr().err
    assert (tmp_path / "data" / "keep.txt").read_text() == "mine"


def test_missing_input(tmp_path, tokenizer_dir, capsys):
    code = run_main(f"input={tmp_path / 'none.json'}", f"tokenizer_name_or_path={tokenizer_dir}",
                    f"output_prefix={tmp_path / 'out'}")
    assert code == 2
    assert capsys.readouterr().err.strip() == f"config error: input: {tmp_path / 'none.json'} does not exist"


def test_missing_tokenizer(tmp_path, capsys):
    code = run_main(f"input={deepscaler_json(tmp_path)}", f"tokenizer_name_or_path={tmp_path / 'model'}",
                    f"output_prefix={tmp_path / 'out'}")
    assert code == 2
    assert capsys.readouterr().err.strip() == f"config error: tokenizer_name_or_path: {tmp_path / 'model'} does not exist"


def test_unknown_override_key(capsys):
    assert run_main("seq_lenght=10") == 2
    err = capsys.readouterr().err.strip()
    assert err == ("config error: seq_lenght: unknown key (valid keys: input, tokenizer_name_or_path, output_prefix, "
                   "prompt_type, map_keys, seq_length, overlong_prompts, is_pairwise_dataset, handler_name)")


def test_a_schema_key_the_yaml_leaves_out_is_set_without_a_plus(tmp_path):
    """A user's dataset YAML lists what it changes; a plain override sets any other key of the schema."""
    from cli.preprocess_data import _compose

    (tmp_path / "mine.yaml").write_text("input: ./rows.jsonl\n")
    assert _compose(str(tmp_path), "mine", ["seq_length=10"]).seq_length == 10


def test_unknown_config_name(capsys):
    assert run_main(config_name="no_such_dataset") == 2
    assert capsys.readouterr().err.startswith("config error: --config-name: ")


def test_non_positive_seq_length(capsys):
    assert run_main("seq_length=0") == 2
    assert capsys.readouterr().err.strip() == "config error: seq_length: must be > 0, got 0"


@pytest.mark.parametrize("name, labels, prompt_type", [("deepscaler", "answer", "qwen_r1"),
                                                        ("dapo_math_17k", "reward_model.ground_truth", "empty")])
def test_shipped_dataset_configs_validate(name, labels, prompt_type):
    from hydra import compose, initialize_config_dir

    from mindspeed_rl.config.preprocess import load_preprocess_config

    with initialize_config_dir(config_dir=str(cli.DATASETS_CONFIG_DIR), version_base="1.3"):
        config = load_preprocess_config(compose(config_name=name))
    assert config.map_keys["labels"] == labels and config.prompt_type == prompt_type
    assert config.seq_length == 2048  # the 7B recipe's rl_config.max_prompt_length


def preprocessed(tmp_path, tokenizer_dir):
    out = tmp_path / "data"
    assert run_main(f"input={deepscaler_json(tmp_path)}", f"tokenizer_name_or_path={tokenizer_dir}",
                    f"output_prefix={out}") == 0
    return out


def test_loading_with_another_template_than_preprocessed_is_an_error(tmp_path, tokenizer_dir, tokenizer):
    out = preprocessed(tmp_path, tokenizer_dir)
    with pytest.raises(ConfigError, match="megatron_training.prompt_type: .* preprocessed with prompt_type='qwen_r1'"):
        load_prompt_dataset(str(out), tokenizer=tokenizer, prompt_type="empty", map_keys={"prompt": "problem",
                            "labels": "answer"}, max_prompt_length=2048, show_progress=False)


def test_loading_with_another_tokenizer_than_preprocessed_is_an_error(tmp_path, tokenizer_dir):
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    out = preprocessed(tmp_path, tokenizer_dir)
    other = Tokenizer(models.BPE())
    other.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    other.train_from_iterator(["something else entirely"] * 5, trainer=trainers.BpeTrainer(
        vocab_size=300, show_progress=False, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    with pytest.raises(ConfigError, match="megatron_training.tokenizer_name_or_path: .* another tokenizer"):
        load_prompt_dataset(str(out), tokenizer=PreTrainedTokenizerFast(tokenizer_object=other), prompt_type="qwen_r1",
                            map_keys={"prompt": "problem", "labels": "answer"}, max_prompt_length=2048,
                            show_progress=False)
