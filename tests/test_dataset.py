"""Prompt datasets read with HF `datasets` (jsonl, json, parquet, directories), field mapping, length
filtering, the errors a user meets, and the sampler's order.

Runs where: in-process, CPU, no download; rows are written here in the real datasets' schemas
(DeepScaleR's JSON array, DAPO-Math-17k's parquet with chat-message prompts and nested labels).
"""

import json

import datasets
import pytest
from test_templates import build_tokenizer

from mindspeed_rl.config import ConfigError
from mindspeed_rl.data.arith_task import make_arith_prompts, write_prompts_jsonl
from mindspeed_rl.data.dataset import PromptSampler, check_prompt_rows, load_prompt_dataset

DEFAULT_KEYS = {"prompt": "prompt", "labels": "answer"}
DAPO_KEYS = {"prompt": "prompt", "labels": "reward_model.ground_truth"}


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    return build_tokenizer(tmp_path_factory.mktemp("tokenizer"))


def load(path, tokenizer, *, prompt_type="empty", map_keys=DEFAULT_KEYS, max_prompt_length=512, **kwargs):
    return load_prompt_dataset(str(path), tokenizer=tokenizer, prompt_type=prompt_type, map_keys=map_keys,
                               max_prompt_length=max_prompt_length, show_progress=False, **kwargs)


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def dapo_rows(count):
    """DAPO-Math-17k's schema: data_source, prompt (chat messages), ability, reward_model, extra_info."""
    return [{"data_source": "math_dapo", "ability": "MATH", "extra_info": {"index": str(i)},
             "prompt": [{"content": f"Tom has {i} apples and buys 2 more. How many apples?", "role": "user"}],
             "reward_model": {"ground_truth": str(i + 2), "style": "rule-lighteval/MATH_v2"}} for i in range(count)]


def write_dapo_parquet(path, count):
    datasets.Dataset.from_list(dapo_rows(count)).to_parquet(str(path))
    return path


# --- reading ------------------------------------------------------------------------------------------

def test_demo_prompts_jsonl_loads_with_defaults_and_tokenizes_as_before(tmp_path, tokenizer):
    rows = make_arith_prompts(20, 9, seed=3)
    write_prompts_jsonl(tmp_path / "prompts.jsonl", rows)
    dataset = load(tmp_path / "prompts.jsonl", tokenizer)
    assert [r.token_ids for r in dataset.records] == [tokenizer.encode(row["prompt"], add_special_tokens=False)
                                                      for row in rows]
    assert [r.label for r in dataset.records] == [row["answer"] for row in rows]
    assert [r.prompt_text for r in dataset.records] == [row["prompt"] for row in rows]
    assert dataset.num_filtered == 0 and dataset.source == str(tmp_path / "prompts.jsonl")


def test_deepscaler_json_array_with_map_keys(tmp_path, tokenizer):
    rows = [{"problem": "What is 3 + 4?", "answer": "7", "solution": "3+4=7"},
            {"problem": "Half of 1?", "answer": "\\frac{1}{2}", "solution": "."}]
    (tmp_path / "deepscaler.json").write_text(json.dumps(rows))
    dataset = load(tmp_path / "deepscaler.json", tokenizer, prompt_type="qwen_r1",
                   map_keys={"prompt": "problem", "labels": "answer"})
    assert [r.label for r in dataset.records] == ["7", "\\frac{1}{2}"]
    assert dataset.records[0].prompt_text.endswith("\nWhat is 3 + 4?<|im_end|>\n<|im_start|>assistant\n")
    assert dataset.records[1].origin == f"{tmp_path / 'deepscaler.json'}: row 2"


def test_mindspeed_rl_map_keys_spelling_is_accepted(tmp_path, tokenizer):
    """MindSpeed-RL's configs say {prompt: problem, query: "", response: answer, system: ""}."""
    write_jsonl(tmp_path / "d.jsonl", [{"problem": "1+1", "answer": "2"}])
    dataset = load(tmp_path / "d.jsonl", tokenizer,
                   map_keys={"prompt": "problem", "query": "", "response": "answer", "system": ""})
    assert dataset.records[0].label == "2"


def test_dapo_parquet_with_chat_messages_and_nested_label(tmp_path, tokenizer):
    write_dapo_parquet(tmp_path / "dapo.parquet", 5)
    dataset = load(tmp_path / "dapo.parquet", tokenizer, map_keys=DAPO_KEYS)
    assert [r.label for r in dataset.records] == ["2", "3", "4", "5", "6"]
    text = "Tom has 3 apples and buys 2 more. How many apples?"
    assert dataset.records[3].prompt_text == text
    assert dataset.records[3].token_ids == tokenizer.encode(text, add_special_tokens=False)


def test_dapo_parquet_through_the_chat_template(tmp_path, tokenizer):
    write_dapo_parquet(tmp_path / "dapo.parquet", 2)
    dataset = load(tmp_path / "dapo.parquet", tokenizer, prompt_type="chat", map_keys=DAPO_KEYS)
    expected = tokenizer.apply_chat_template(dapo_rows(2)[1]["prompt"], add_generation_prompt=True,
                                             tokenize=True)["input_ids"]
    assert dataset.records[1].token_ids == expected


def test_directory_of_files_reads_every_file_in_name_order(tmp_path, tokenizer):
    write_jsonl(tmp_path / "b.jsonl", [{"prompt": "p3", "answer": "3"}])
    write_jsonl(tmp_path / "a.jsonl", [{"prompt": "p1", "answer": "1"}, {"prompt": "p2", "answer": "2"}])
    (tmp_path / "notes.txt").write_text("ignored: not a data file")
    dataset = load(tmp_path, tokenizer)
    assert [r.label for r in dataset.records] == ["1", "2", "3"]
    assert dataset.records[2].origin == f"{tmp_path / 'b.jsonl'}:1"


def test_numeric_labels_become_strings(tmp_path, tokenizer):
    write_jsonl(tmp_path / "d.jsonl", [{"prompt": "a", "answer": 7}, {"prompt": "b", "answer": 0.5}])
    assert [r.label for r in load(tmp_path / "d.jsonl", tokenizer).records] == ["7", "0.5"]


def test_system_field_from_map_keys(tmp_path, tokenizer):
    write_jsonl(tmp_path / "d.jsonl", [{"q": "1+1", "a": "2", "sys": "Be brief."}])
    dataset = load(tmp_path / "d.jsonl", tokenizer, prompt_type="qwen_math_r1",
                   map_keys={"prompt": "q", "labels": "a", "system": "sys"})
    assert dataset.records[0].prompt_text.startswith("<|im_start|>system\nBe brief.<|im_end|>\n")


# --- length filtering ---------------------------------------------------------------------------------

def overlong_file(tmp_path, tokenizer):
    rows = [{"prompt": "1+1", "answer": "2"}, {"prompt": "A conversation between User and Assistant. " * 4,
                                              "answer": "x"}, {"prompt": "2+2", "answer": "4"}]
    lengths = [len(tokenizer.encode(row["prompt"], add_special_tokens=False)) for row in rows]
    return write_jsonl(tmp_path / "d.jsonl", rows), max(lengths[0], lengths[2])


def test_overlong_prompts_are_filtered_with_a_printed_count(tmp_path, tokenizer, capsys):
    path, short_max = overlong_file(tmp_path, tokenizer)
    dataset = load(path, tokenizer, max_prompt_length=short_max)
    assert [r.label for r in dataset.records] == ["2", "4"] and dataset.num_filtered == 1
    assert f"dropped 1 prompts longer than rl_config.max_prompt_length={short_max} tokens" in capsys.readouterr().out


def test_a_prompt_exactly_at_the_limit_is_kept(tmp_path, tokenizer):
    write_jsonl(tmp_path / "d.jsonl", [{"prompt": "1+1", "answer": "2"}])
    limit = len(tokenizer.encode("1+1", add_special_tokens=False))
    assert load(tmp_path / "d.jsonl", tokenizer, max_prompt_length=limit).num_filtered == 0


def test_overlong_prompt_with_error_policy_names_file_and_line(tmp_path, tokenizer):
    path, short_max = overlong_file(tmp_path, tokenizer)
    with pytest.raises(ConfigError) as info:
        load(path, tokenizer, max_prompt_length=short_max, overlong_prompts="error")
    assert info.value.key == "rl_config.max_prompt_length"
    assert info.value.message.startswith(f"{path}:2: the prompt has ")


def test_every_prompt_overlong_is_an_error(tmp_path, tokenizer):
    write_jsonl(tmp_path / "d.jsonl", [{"prompt": "1+1+1+1", "answer": "4"}])
    with pytest.raises(ConfigError, match="rl_config.max_prompt_length: no prompt of .* fits in 1 tokens"):
        load(tmp_path / "d.jsonl", tokenizer, max_prompt_length=1)


# --- errors -------------------------------------------------------------------------------------------

def test_missing_path(tmp_path, tokenizer):
    with pytest.raises(ConfigError, match=f"megatron_training.data_path: {tmp_path / 'nope.jsonl'} does not exist"):
        load(tmp_path / "nope.jsonl", tokenizer)


def test_row_without_the_label_names_file_and_line(tmp_path, tokenizer):
    path = tmp_path / "prompts.jsonl"
    path.write_text('{"prompt": "1+1=", "answer": "2"}\n{"prompt": "2+2="}\n')
    with pytest.raises(ConfigError) as info:
        load(path, tokenizer)
    assert str(info.value).startswith(f"megatron_training.data_path: {path}:2: the row has no 'answer'")


def test_line_numbers_count_blank_lines(tmp_path, tokenizer):
    path = tmp_path / "prompts.jsonl"
    path.write_text('{"prompt": "1+1=", "answer": "2"}\n\n{"prompt": "2+2="}\n')
    with pytest.raises(ConfigError, match=f"{path}:3: the row has no 'answer'"):
        load(path, tokenizer)


def test_rows_are_checked_without_a_tokenizer(tmp_path):
    """check_prompt_rows lets a run stop on a data error before the tokenizer and model load."""
    good = write_jsonl(tmp_path / "good.jsonl", [{"prompt": "1+1=", "answer": "2"}] * 3)
    assert check_prompt_rows(str(good), map_keys=DEFAULT_KEYS) == 3
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "1+1=", "answer": "2"}\n{"prompt": "2+2="}\n')
    with pytest.raises(ConfigError, match=f"megatron_training.data_path: {bad}:2: the row has no 'answer'"):
        check_prompt_rows(str(bad), map_keys=DEFAULT_KEYS)


def test_json_array_without_rows(tmp_path, tokenizer):
    (tmp_path / "d.json").write_text("[]")
    with pytest.raises(ConfigError, match="megatron_training.data_path: .*d.json: the file has no rows"):
        load(tmp_path / "d.json", tokenizer)


def test_missing_nested_field_names_the_dotted_path(tmp_path, tokenizer):
    write_jsonl(tmp_path / "d.jsonl", [{"prompt": "a", "reward_model": {"style": "rule"}}])
    with pytest.raises(ConfigError, match="d.jsonl:1: the row has no 'reward_model.ground_truth'"):
        load(tmp_path / "d.jsonl", tokenizer, map_keys=DAPO_KEYS)


def test_malformed_chat_messages_name_the_row(tmp_path, tokenizer):
    write_jsonl(tmp_path / "d.jsonl", [{"prompt": [{"role": "assistant", "content": "x"}], "answer": "1"}])
    with pytest.raises(ConfigError, match="d.jsonl:1: field 'prompt': chat messages must alternate"):
        load(tmp_path / "d.jsonl", tokenizer)


def test_empty_file(tmp_path, tokenizer):
    (tmp_path / "d.jsonl").write_text("")
    with pytest.raises(ConfigError, match="megatron_training.data_path: .*d.jsonl: the file is empty"):
        load(tmp_path / "d.jsonl", tokenizer)


def test_unparseable_file(tmp_path, tokenizer):
    (tmp_path / "d.jsonl").write_text('{"prompt": "1", "answer": "2"}\n{bad json\n')
    with pytest.raises(ConfigError, match="megatron_training.data_path: .*d.jsonl:2: not valid JSON"):
        load(tmp_path / "d.jsonl", tokenizer)


def _rows_then(line_10: bytes) -> bytes:
    """Eight rows, a blank line (no row: line 10 is the ninth row), then `line_10`."""
    return b"".join(b'{"prompt": "%d+1=", "answer": "%d"}\n' % (i, i + 1) for i in range(8)) + b"\n" + line_10 + b"\n"


def test_bytes_that_are_not_utf8_name_file_line_and_column(tmp_path, tokenizer):
    path = tmp_path / "d.jsonl"
    path.write_bytes(_rows_then(b'{"prompt": "caf\xe9", "answer": "1"}'))
    with pytest.raises(ConfigError) as info:
        check_prompt_rows(str(path), map_keys=DEFAULT_KEYS)
    assert str(info.value) == (f"megatron_training.data_path: {path}:10: not UTF-8 text (byte 0xe9 at column 16); "
                               "save the file as UTF-8")


def test_a_line_that_is_not_json_is_named_by_its_line_not_its_row(tmp_path, tokenizer):
    path = tmp_path / "d.jsonl"
    path.write_bytes(_rows_then(b"junk"))
    with pytest.raises(ConfigError, match=f"megatron_training.data_path: {path}:10: not valid JSON "
                                          r"\(Expecting value at column 1\)"):
        load(path, tokenizer)


def test_json_that_is_not_an_object_is_not_a_row(tmp_path, tokenizer):
    path = tmp_path / "d.jsonl"
    path.write_bytes(_rows_then(b'["1+1=", "2"]'))
    with pytest.raises(ConfigError, match=f"{path}:10: a JSON array where each line must be one row object"):
        check_prompt_rows(str(path), map_keys=DEFAULT_KEYS)


def test_a_json_array_element_that_is_not_an_object_names_its_line(tmp_path, tokenizer):
    path = tmp_path / "d.json"
    path.write_text(json.dumps([{"prompt": "1+1=", "answer": "2"}, "2+2=", {"prompt": "x", "answer": "y"}], indent=1))
    with pytest.raises(ConfigError, match=f"{path}:6: a JSON string where each element of the array must be"):
        load(path, tokenizer)


def test_bytes_that_are_not_utf8_in_a_json_array_name_their_line(tmp_path, tokenizer):
    path = tmp_path / "d.json"
    path.write_bytes(b'[\n {"prompt": "1+1=", "answer": "2"},\n {"prompt": "\xff", "answer": "2"}\n]\n')
    with pytest.raises(ConfigError, match=f"{path}:3: not UTF-8 text \\(byte 0xff at column 14\\)"):
        load(path, tokenizer)


def test_a_json_file_of_json_lines_is_read_as_rows_with_their_lines(tmp_path, tokenizer):
    path = tmp_path / "d.json"
    path.write_text('{"prompt": "1+1=", "answer": "2"}\n\n{"prompt": "2+2="}\n')
    with pytest.raises(ConfigError, match=f"{path}:3: the row has no 'answer'"):
        load(path, tokenizer)


def test_unsupported_file_type(tmp_path, tokenizer):
    (tmp_path / "d.csv").write_text("prompt,answer\n1,2\n")
    with pytest.raises(ConfigError, match="expected a .jsonl, .json or .parquet file"):
        load(tmp_path / "d.csv", tokenizer)


def test_directory_without_data_files(tmp_path, tokenizer):
    (tmp_path / "readme.md").write_text("x")
    with pytest.raises(ConfigError, match="no .jsonl, .json or .parquet file in this directory"):
        load(tmp_path, tokenizer)


def test_unknown_map_keys_field(tmp_path, tokenizer):
    write_jsonl(tmp_path / "d.jsonl", [{"prompt": "a", "answer": "1"}])
    with pytest.raises(ConfigError, match=r"megatron_training.map_keys: unknown fields \['question'\]"):
        load(tmp_path / "d.jsonl", tokenizer, map_keys={**DEFAULT_KEYS, "question": "q"})


def test_map_keys_without_labels(tmp_path, tokenizer):
    write_jsonl(tmp_path / "d.jsonl", [{"prompt": "a", "answer": "1"}])
    with pytest.raises(ConfigError, match="megatron_training.map_keys.labels: required"):
        load(tmp_path / "d.jsonl", tokenizer, map_keys={"prompt": "prompt"})


def test_unknown_prompt_type(tmp_path, tokenizer):
    write_jsonl(tmp_path / "d.jsonl", [{"prompt": "a", "answer": "1"}])
    with pytest.raises(ConfigError, match="megatron_training.prompt_type: unknown template 'x'; known: chat, empty"):
        load(tmp_path / "d.jsonl", tokenizer, prompt_type="x")


def test_bad_overlong_policy(tmp_path, tokenizer):
    write_jsonl(tmp_path / "d.jsonl", [{"prompt": "a", "answer": "1"}])
    with pytest.raises(ConfigError, match="megatron_training.overlong_prompts: must be one of filter, error"):
        load(tmp_path / "d.jsonl", tokenizer, overlong_prompts="truncate")


# --- sampler ------------------------------------------------------------------------------------------

def epochs(sampler, count):
    """``count`` epochs' worth of indices, split per epoch (the dataset size divides the batches here)."""
    flat = [i for _ in range(count * sampler.num_records // sampler.batch_size) for i in sampler.next_indices()]
    return [flat[e * sampler.num_records:(e + 1) * sampler.num_records] for e in range(count)]


def test_sampler_reshuffles_every_epoch_and_each_epoch_is_a_permutation():
    first, second = epochs(PromptSampler(32, 8, seed=1, shuffle=True, wrap_small_dataset=False), 2)
    assert sorted(first) == sorted(second) == list(range(32))
    assert first != second


def test_sampler_order_is_reproducible_from_the_seed():
    make = lambda seed: epochs(PromptSampler(32, 8, seed=seed, shuffle=True, wrap_small_dataset=False), 2)
    assert make(7) == make(7)
    assert make(7) != make(8)


def test_sampler_without_shuffle_is_in_file_order_and_skips_nothing():
    sampler = PromptSampler(10, 4, seed=1, shuffle=False, wrap_small_dataset=False)
    assert [sampler.next_indices() for _ in range(3)] == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 0, 1]]
    assert sampler.epoch == 1


def test_sampler_state_dict_resumes_the_same_sequence():
    original = PromptSampler(30, 8, seed=3, shuffle=True, wrap_small_dataset=False)
    for _ in range(5):  # into the second epoch, mid-permutation
        original.next_indices()
    resumed = PromptSampler(30, 8, seed=3, shuffle=True, wrap_small_dataset=False)
    resumed.load_state_dict(json.loads(json.dumps(original.state_dict())))  # as a checkpoint stores it
    assert [resumed.next_indices() for _ in range(6)] == [original.next_indices() for _ in range(6)]


def test_sampler_refuses_a_state_for_another_dataset_size():
    state = PromptSampler(30, 8, seed=3, shuffle=True, wrap_small_dataset=False).state_dict()
    with pytest.raises(ConfigError, match="saved for num_records=30, now num_records=31"):
        PromptSampler(31, 8, seed=3, shuffle=True, wrap_small_dataset=False).load_state_dict(state)


def test_dataset_smaller_than_the_batch_is_an_error():
    with pytest.raises(ConfigError) as info:
        PromptSampler(5, 16, seed=1, shuffle=True, wrap_small_dataset=False)
    assert info.value.key == "megatron_training.global_batch_size"
    assert "only 5 usable prompts" in info.value.message and "wrap_small_dataset=true" in info.value.message


def test_dataset_smaller_than_the_batch_wraps_when_allowed():
    sampler = PromptSampler(5, 16, seed=1, shuffle=True, wrap_small_dataset=True)
    batches = [sampler.next_indices() for _ in range(5)]  # 80 draws = 16 full epochs of 5
    flat = [i for batch in batches for i in batch]
    assert all(len(batch) == 16 for batch in batches)
    assert all(sorted(flat[e * 5:(e + 1) * 5]) == list(range(5)) for e in range(16))
