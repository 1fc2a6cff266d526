"""The tiny math demo's generated assets: DAPO-schema parquet, chat tokenizer, tiny checkpoint, config.

Runs in one process on CPU; everything is real (HF datasets, transformers' AutoTokenizer, the
project's verifiers and config loader), nothing is downloaded.
"""

import json
import re
from pathlib import Path

import pytest

from mindspeed_rl.data import rewards
from mindspeed_rl.data.tiny_math import (
    DATA_FILE,
    EVAL_FILE,
    MANIFEST_FILE,
    TEMPLATES,
    answer_token,
    build_tiny_math_tokenizer,
    correct_response,
    ensure_tiny_math_assets,
    make_word_problems,
    tiny_math_vocab_size,
)

CONFIGS = Path(__file__).resolve().parents[1] / "configs"
MAX_OPERAND = 4
SMALL = dict(hidden_size=32, ffn_hidden_size=64, num_layers=2, num_attention_heads=4, num_query_groups=2)
PARAMS = dict(SMALL, num_prompts=64, max_operand=MAX_OPERAND, seed=3)


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    return ensure_tiny_math_assets(tmp_path_factory.mktemp("tiny_math"), **PARAMS)


@pytest.fixture(scope="module")
def hf_tokenizer(assets):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(assets[0]), local_files_only=True)


@pytest.fixture(scope="module")
def rows(assets):
    import datasets

    return datasets.load_dataset("parquet", data_files=str(assets[1]), split="train")


@pytest.fixture(scope="module")
def demo_config():
    from hydra import compose, initialize_config_dir

    from mindspeed_rl.config import load_config

    with initialize_config_dir(config_dir=str(CONFIGS), version_base="1.3"):
        return load_config(compose(config_name="grpo_tiny_math_cpu"))


def _chat_ids(tokenizer, messages) -> list[int]:
    # transformers 5 returns a BatchEncoding from tokenize=True.
    return list(tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)["input_ids"])


def test_parquet_reads_back_with_datasets_in_dapo_schema(rows):
    from datasets import List, Value

    features = rows.features
    assert list(features) == ["data_source", "prompt", "ability", "reward_model", "extra_info"]
    assert features["prompt"] == List({"content": Value("string"), "role": Value("string")})
    assert features["reward_model"] == {"ground_truth": Value("string"), "style": Value("string")}
    assert features["extra_info"] == {"index": Value("string")}
    assert len(rows) == PARAMS["num_prompts"]
    assert all(row["prompt"][0]["role"] == "user" and len(row["prompt"]) == 1 for row in rows)
    assert len({row["extra_info"]["index"] for row in rows}) == len(rows)


def _parse_problem(text: str) -> tuple[int, int, int]:
    """(template index, a, b) of a generated problem: the test's own reading of the wordings."""
    found = []
    for index, template in enumerate(TEMPLATES):
        pattern = re.escape(template.text)
        for slot, group in (("{a}", r"(?P<a>\d+)"), ("{b}", r"(?P<b>\d+)"), ("{name}", r"\w+"), ("{item}", r"\w+")):
            pattern = pattern.replace(re.escape(slot), group)
        if match := re.fullmatch(pattern, text):
            found.append((index, int(match["a"]), int(match["b"])))
    assert len(found) == 1, text
    return found[0]


def test_labels_are_the_problems_answers(rows):
    for row in rows:
        index, a, b = _parse_problem(row["prompt"][0]["content"])
        assert 1 <= a <= MAX_OPERAND and 1 <= b <= MAX_OPERAND
        expected = a - b if TEMPLATES[index].subtract else a + b
        assert expected >= 0
        assert row["reward_model"]["ground_truth"] == str(expected)


def test_every_wording_occurs_and_generation_is_seeded():
    first = make_word_problems(200, MAX_OPERAND, seed=5)
    assert first == make_word_problems(200, MAX_OPERAND, seed=5)
    assert first != make_word_problems(200, MAX_OPERAND, seed=6)
    used = {_parse_problem(row["prompt"][0]["content"])[0] for row in first}
    assert used == set(range(len(TEMPLATES)))


def test_chat_template_renders_qwen_style(hf_tokenizer):
    messages = [{"role": "user", "content": "Tom has 3 apples and gets 2 more. How many apples now?"}]
    text = hf_tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert text == ("<|im_start|>user\nTom has 3 apples and gets 2 more. How many apples now?<|im_end|>\n"
                    "<|im_start|>assistant\n")
    config = json.loads(Path(hf_tokenizer.name_or_path, "tokenizer_config.json").read_text())
    assert "<|im_start|>" in config["chat_template"]


def test_chat_prompts_round_trip_through_token_ids(hf_tokenizer, rows):
    for row in rows:
        text = hf_tokenizer.apply_chat_template(row["prompt"], add_generation_prompt=True, tokenize=False)
        ids = _chat_ids(hf_tokenizer, row["prompt"])
        assert hf_tokenizer.decode(ids) == text
        assert ids == hf_tokenizer.encode(text, add_special_tokens=False)


def test_chat_prompts_fit_the_configs_max_prompt_length(hf_tokenizer, demo_config):
    # Every wording at the largest operands: the longest prompts the generator can write.
    longest = max(len(_chat_ids(hf_tokenizer, row["prompt"]))
                  for row in make_word_problems(500, MAX_OPERAND, seed=0))
    assert longest <= demo_config.rl_config.max_prompt_length
    sampling = demo_config.generate_config.sampling_config
    assert demo_config.rl_config.max_prompt_length + sampling.max_tokens <= demo_config.generate_config.max_model_len


def test_correct_answer_is_one_token_per_piece(hf_tokenizer):
    for answer in range(2 * MAX_OPERAND + 1):
        ids = hf_tokenizer.encode(correct_response(answer), add_special_tokens=False)
        assert hf_tokenizer.convert_ids_to_tokens(ids) == ["<think>", "</think>", "<answer>", answer_token(answer),
                                                            "</answer>"]


def test_answers_outside_the_task_still_round_trip(hf_tokenizer):
    text = "<think></think><answer>\\boxed{12}</answer>"
    ids = hf_tokenizer.encode(text, add_special_tokens=False)
    assert hf_tokenizer.convert_ids_to_tokens(ids)[3:7] == ["\\boxed{", "1", "2", "}"]
    assert hf_tokenizer.decode(ids) == text


def test_format_tokens_survive_skip_special_tokens(hf_tokenizer):
    # The trainer decodes responses with skip_special_tokens=True; only the chat markers may vanish.
    ids = hf_tokenizer.encode(correct_response(5) + "<|im_end|>", add_special_tokens=False)
    assert hf_tokenizer.decode(ids, skip_special_tokens=True) == correct_response(5)


def test_correct_response_earns_math_17k_acc_and_format(hf_tokenizer):
    for answer in range(2 * MAX_OPERAND + 1):
        ids = hf_tokenizer.encode(correct_response(answer) + "<|im_end|>", add_special_tokens=False)
        response = hf_tokenizer.decode(ids, skip_special_tokens=True)
        assert rewards.math_17k_acc(response, str(answer)) == 1.0
        assert rewards.format_reward(response, str(answer)) == 1.0
        assert rewards.math_17k_acc(response, str(answer + 1)) == 0.0


def test_vocabulary_is_small_contiguous_and_matches_the_model(assets, hf_tokenizer):
    config = json.loads((assets[0] / "config.json").read_text())
    assert len(hf_tokenizer) == config["vocab_size"] == tiny_math_vocab_size(MAX_OPERAND) < 80
    assert sorted(hf_tokenizer.get_vocab().values()) == list(range(len(hf_tokenizer)))
    assert hf_tokenizer.eos_token == "<|im_end|>"
    assert hf_tokenizer.pad_token_id == 0 == config["eos_token_id"]


def test_checkpoint_loads_with_the_requested_sizes(assets):
    import torch
    from transformers import Qwen2ForCausalLM

    model = Qwen2ForCausalLM.from_pretrained(str(assets[0]))
    assert (model.config.hidden_size, model.config.intermediate_size) == (32, 64)
    logits = model(torch.tensor([[1, 2, 3]])).logits
    assert logits.shape == (1, 3, tiny_math_vocab_size(MAX_OPERAND)) and torch.isfinite(logits).all()


def test_reuses_and_gives_other_parameters_their_own_directory(tmp_path):
    import pyarrow.parquet as pq

    model_dir, data_path = ensure_tiny_math_assets(tmp_path, **PARAMS)
    root = model_dir.parent
    assert data_path.parent == root and root.parent == tmp_path and root.name.startswith("math_word-")
    weights = model_dir / "model.safetensors"
    first = (weights.stat().st_mtime_ns, data_path.stat().st_mtime_ns)
    assert ensure_tiny_math_assets(tmp_path, **PARAMS) == (model_dir, data_path)
    assert (weights.stat().st_mtime_ns, data_path.stat().st_mtime_ns) == first

    other_model, other_data = ensure_tiny_math_assets(tmp_path, **dict(PARAMS, num_prompts=20))
    other = other_model.parent
    assert other != root and pq.read_table(other_data).num_rows == 20
    assert json.loads((other / MANIFEST_FILE).read_text())["num_prompts"] == 20
    # the first set is untouched
    assert pq.read_table(data_path).num_rows == 64
    assert (weights.stat().st_mtime_ns, data_path.stat().st_mtime_ns) == first
    # atomic writes leave no staging files behind
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([".lock", root.name, other.name])
    for directory in (root, other):
        assert sorted(p.name for p in directory.iterdir()) == sorted([MANIFEST_FILE, DATA_FILE, EVAL_FILE, "model"])


def test_vocab_size_pads_with_fillers_and_rejects_too_small():
    natural = tiny_math_vocab_size(MAX_OPERAND)
    padded = build_tiny_math_tokenizer(MAX_OPERAND, vocab_size=natural + 3)
    assert padded.get_vocab_size(with_added_tokens=True) == natural + 3
    assert padded.id_to_token(natural) == "<|unused_0|>"
    with pytest.raises(ValueError, match="too small"):
        build_tiny_math_tokenizer(MAX_OPERAND, vocab_size=natural - 1)


def test_demo_config_selects_the_math_task_and_its_model(demo_config):
    assert demo_config.synthetic_data.task == "math_word"
    assert demo_config.megatron_training.prompt_type == "chat"
    assert demo_config.megatron_training.map_keys == {"prompt": "prompt", "labels": "reward_model.ground_truth"}
    assert demo_config.rl_config.verifier_function == ["math_17k_acc", "format"]
    assert demo_config.selected_model.padded_vocab_size == tiny_math_vocab_size(demo_config.synthetic_data.max_operand)
    assert demo_config.megatron_training.train_iters == 100


def test_the_held_out_split_has_no_training_problem_text(tmp_path):
    import pandas as pd

    _, data_path = ensure_tiny_math_assets(tmp_path, num_prompts=64, max_operand=4, hidden_size=32, ffn_hidden_size=64,
                                           num_layers=1, num_attention_heads=2, num_query_groups=1, seed=3)
    train = {row[0]["content"] for row in pd.read_parquet(data_path)["prompt"]}
    held_out = [row[0]["content"] for row in pd.read_parquet(data_path.with_name(EVAL_FILE))["prompt"]]
    assert len(held_out) >= 32 and not set(held_out) & train
