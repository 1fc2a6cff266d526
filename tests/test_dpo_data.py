"""DPO's pairwise data (mindspeed_rl/data/preference.py): MindSpeed-RL's orca_rlhf rows ({system, question, chosen,
rejected}) through `cli/preprocess_data.py` with their configs/datasets/orca_rlhf.yaml keys (is_pairwise_dataset,
their pairwise handler), read back by the trainer as raw rows would be; and the demo's generated arithmetic pairs.

Runs where: in-process (the CLI's `main(argv)`), CPU, a tokenizer trained here; a few seconds."""
import json

import pytest
from test_preprocess_cli import cli, tokenizer, tokenizer_dir  # noqa: F401 (fixtures)

from mindspeed_rl.config import ConfigError
from mindspeed_rl.data.preference import (PREFERENCE_META_FILE, load_preference_dataset, make_arith_pairs,
                                          resolve_pair_fields, response_ids)
from mindspeed_rl.data.templates import render_prompt

ORCA_MAP_KEYS = {"prompt": "question", "query": "", "system": "system"}  # their orca_rlhf.yaml's


def orca_rows(tmp_path, count: int = 5):
    rows = [{"system": "You are helpful.", "question": f"What is {i} + 4?", "chosen": f"It is {i + 4}.",
             "rejected": f"It is {i + 5}."} for i in range(count)]
    path = tmp_path / "orca_rlhf.jsonl"
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path, rows


def test_orca_rows_preprocess_into_the_pairs_the_trainer_reads(tmp_path, tokenizer_dir, tokenizer):  # noqa: F811
    path, rows = orca_rows(tmp_path)
    out = tmp_path / "dpo"
    code = cli.main(["--config-name", "orca_rlhf", f"input={path}", f"tokenizer_name_or_path={tokenizer_dir}",
                     f"output_prefix={out}", "prompt_type=chat", "seq_length=4096"])
    assert code == 0 and (out / PREFERENCE_META_FILE).is_file()
    preprocessed = load_preference_dataset(str(out), tokenizer=tokenizer, prompt_type="chat",
                                           map_keys=ORCA_MAP_KEYS, max_length=4096)
    raw = load_preference_dataset(str(path), tokenizer=tokenizer, prompt_type="chat", map_keys=ORCA_MAP_KEYS,
                                  max_length=4096)
    assert [(p.prompt_ids, p.chosen_ids, p.rejected_ids) for p in preprocessed.pairs] == \
        [(p.prompt_ids, p.chosen_ids, p.rejected_ids) for p in raw.pairs]
    first = raw.pairs[0]
    assert first.prompt_ids == render_prompt(rows[0]["question"], tokenizer=tokenizer, prompt_type="chat",
                                             system=rows[0]["system"])
    assert first.chosen_ids == response_ids("It is 4.", tokenizer)
    assert first.chosen_ids[-1] == tokenizer.eos_token_id


def test_pairs_longer_than_seq_length_are_dropped_and_counted(tmp_path, tokenizer):  # noqa: F811
    path, _ = orca_rows(tmp_path)
    full = load_preference_dataset(str(path), tokenizer=tokenizer, prompt_type="empty", map_keys=ORCA_MAP_KEYS,
                                   max_length=4096)
    lengths = sorted(len(p.prompt_ids) + max(len(p.chosen_ids), len(p.rejected_ids)) for p in full.pairs)
    cut = load_preference_dataset(str(path), tokenizer=tokenizer, prompt_type="empty", map_keys=ORCA_MAP_KEYS,
                                  max_length=lengths[2])
    assert len(cut.pairs) == sum(length <= lengths[2] for length in lengths) and cut.num_filtered == 5 - len(cut.pairs)


def test_a_row_without_a_rejected_response_is_named(tmp_path, tokenizer):  # noqa: F811
    path = tmp_path / "bad.jsonl"
    path.write_text(json.dumps({"question": "q", "chosen": "a"}) + "\n")
    with pytest.raises(ConfigError, match=r"bad.jsonl:1: the row has no 'rejected'"):
        load_preference_dataset(str(path), tokenizer=tokenizer, prompt_type="empty", map_keys=ORCA_MAP_KEYS,
                                max_length=64)


def test_pair_fields_follow_their_map_keys_and_refuse_unknown_ones():
    assert resolve_pair_fields(ORCA_MAP_KEYS) == {"prompt": "question", "chosen": "chosen", "rejected": "rejected",
                                                  "system": "system"}
    with pytest.raises(ConfigError, match="megatron_training.map_keys.answer: is not a field of a pairwise row"):
        resolve_pair_fields({"prompt": "q", "answer": "a"})


def test_the_demo_pairs_prefer_the_right_sum_and_hold_out_unseen_pairs():
    train, held_out = make_arith_pairs(4, seed=1, eval_fraction=0.2)
    assert len(train) + len(held_out) == 25 * 8 and len(held_out) == 40  # every problem with every wrong sum
    for row in train + held_out:
        a, b = (int(x) for x in row["prompt"][:-1].split("+"))
        assert row["chosen"] == str(a + b) != row["rejected"] and 0 <= int(row["rejected"]) <= 8
    key = lambda row: (row["prompt"], row["rejected"])  # noqa: E731
    assert not {key(r) for r in train} & {key(r) for r in held_out}
