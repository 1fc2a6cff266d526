"""Preference pairs for DPO (`megatron_training.is_pairwise_dataset`): rows of a prompt with a chosen and a rejected
response, read raw (.jsonl/.json/.parquet, orca_rlhf's fields through map_keys) or from a directory written by
`cli/preprocess_data.py` with `is_pairwise_dataset: true`; and the CPU demo's generated set (the arithmetic task:
chosen = the right sum, rejected = a wrong one).

MindSpeed-RL's orca_rlhf recipe maps `{prompt: question, query: "", system: system}`; the responses are the rows'
`chosen` and `rejected` fields (their AlpacaStylePairwiseHandler's), which map_keys may rename. A non-empty `query`
is appended to the prompt on a new line (Alpaca's instruction + input). Each response is tokenized as is, with the
tokenizer's EOS after it, so the model learns where it ends.
"""
from __future__ import annotations

import json
import random
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mindspeed_rl.data.asset_cache import ensure_generated
from mindspeed_rl.data.dataset import DataKeys, TRAINING_KEYS, _field, _read_tables
from mindspeed_rl.data.templates import PromptFormatError, render_prompt
from mindspeed_rl.errors import ConfigError

PAIRS_FILE, EVAL_PAIRS_FILE = "pairs.jsonl", "eval_pairs.jsonl"
PREFERENCE_META_FILE = "preference_dataset.json"
PREFERENCE_FORMAT, PREFERENCE_FORMAT_VERSION = "mindspeed_rl.preference_dataset", 1
PAIR_TASK_NAME = "arith_pairs"
# MindSpeed-RL's map_keys fields a pairwise row may name; labels/response belong to prompt datasets.
PAIR_MAP_FIELDS = ("prompt", "query", "system", "chosen", "rejected")


@dataclass(frozen=True, kw_only=True)
class PreferencePair:
    prompt_ids: list[int]
    chosen_ids: list[int]
    rejected_ids: list[int]
    origin: str = ""  # "file:line", for messages


@dataclass(frozen=True, kw_only=True)
class PreferenceDataset:
    pairs: list[PreferencePair]
    num_filtered: int  # pairs longer than the length limit, dropped
    source: str


def resolve_pair_fields(map_keys: Mapping[str, str], *, key: str = TRAINING_KEYS.map_keys) -> dict[str, str]:
    """Our pair fields -> dotted row paths: prompt, chosen, rejected (defaults: their own names), system and query
    where given non-empty."""
    fields = {"prompt": "prompt", "chosen": "chosen", "rejected": "rejected"}
    for name, value in map_keys.items():
        if name in ("labels", "response"):  # a prompt dataset's answer column: pairs carry their responses
            continue
        if name not in PAIR_MAP_FIELDS:
            raise ConfigError(f"{key}.{name}", f"is not a field of a pairwise row (its fields: "
                                               f"{', '.join(PAIR_MAP_FIELDS)})")
        if not isinstance(value, str):
            raise ConfigError(f"{key}.{name}", f"expected a (dotted) field name string, got {value!r}")
        if value:
            fields[name] = value
    return fields


def load_preference_dataset(data_path: str, *, tokenizer, prompt_type: str, map_keys: Mapping[str, str],
                            max_length: int, keys: DataKeys = TRAINING_KEYS) -> PreferenceDataset:
    """Every pair of `data_path` whose prompt and longer response fit in `max_length` tokens (the others dropped and
    counted, as their seq_length does); ConfigError naming the key, file and row of a problem."""
    path = Path(data_path)
    if not path.exists():
        raise ConfigError(keys.data_path, f"{data_path} does not exist")
    if (path / PREFERENCE_META_FILE).is_file():
        pairs, filtered = _read_preprocessed_pairs(path, keys), 0
    else:
        fields = resolve_pair_fields(map_keys, key=keys.map_keys)
        pairs = [_tokenized_pair(row, origin, fields, tokenizer, prompt_type, keys)
                 for origin, row in _rows(path, keys)]
        filtered = 0
    kept = [pair for pair in pairs if pair_length(pair) <= max_length]
    if not kept:
        raise ConfigError(keys.data_path, f"{data_path}: no pair fits in {max_length} tokens ({len(pairs)} read)")
    return PreferenceDataset(pairs=kept, num_filtered=filtered + len(pairs) - len(kept), source=str(data_path))


def pair_length(pair: PreferencePair) -> int:
    """The tokens of the pair's longer sequence (prompt + response)."""
    return len(pair.prompt_ids) + max(len(pair.chosen_ids), len(pair.rejected_ids))


def _rows(path: Path, keys: DataKeys):
    for file, table, line_numbers in _read_tables(path, keys):
        for index, row in enumerate(table):
            yield (f"{file}:{line_numbers[index]}" if line_numbers else f"{file}: row {index + 1}"), row


def _tokenized_pair(row: Mapping[str, Any], origin: str, fields: dict[str, str], tokenizer, prompt_type: str,
                    keys: DataKeys) -> PreferencePair:
    prompt = _field(row, fields["prompt"], origin, "prompt", keys)
    query = _field(row, fields["query"], origin, "query", keys, required=False) if "query" in fields else None
    system = _field(row, fields["system"], origin, "system", keys, required=False) if "system" in fields else None
    if query:
        prompt = f"{prompt}\n{query}"
    try:
        prompt_ids = render_prompt(prompt, tokenizer=tokenizer, prompt_type=prompt_type, system=system or None,
                                   key=keys.prompt_type)
    except PromptFormatError as error:
        raise ConfigError(keys.data_path, f"{origin}: field {fields['prompt']!r}: {error}") from None
    responses = []
    for name in ("chosen", "rejected"):
        text = _field(row, fields[name], origin, name, keys)
        if not isinstance(text, str) or not text:
            raise ConfigError(keys.data_path, f"{origin}: the {name} field {fields[name]!r} must be a non-empty string")
        responses.append(response_ids(text, tokenizer))
    return PreferencePair(prompt_ids=list(prompt_ids), chosen_ids=responses[0], rejected_ids=responses[1],
                          origin=origin)


def response_ids(text: str, tokenizer) -> list[int]:
    """A response's tokens and the tokenizer's EOS (where it has one)."""
    ids = list(tokenizer.encode(text, add_special_tokens=False))
    return ids + ([tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else [])


# -- preprocessed pairs (cli/preprocess_data.py with is_pairwise_dataset) ---------------------------------------
def save_preference_dataset(dataset: PreferenceDataset, output_dir: str, *, metadata: Mapping[str, Any]) -> Path:
    """The pairs' token ids as JSON lines plus preference_dataset.json, in `output_dir` (replaced if it is one)."""
    import shutil
    import tempfile

    target = Path(output_dir).resolve()
    if target.exists() and not (target / PREFERENCE_META_FILE).is_file():
        raise ConfigError("output_prefix", f"{target} exists and is not a preprocessed preference dataset; refusing "
                                           "to overwrite it")
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-", dir=target.parent))
    lines = [json.dumps({"prompt_ids": p.prompt_ids, "chosen_ids": p.chosen_ids, "rejected_ids": p.rejected_ids,
                         "origin": p.origin}) + "\n" for p in dataset.pairs]
    (staging / PAIRS_FILE).write_text("".join(lines), encoding="utf-8")
    meta = {"format": PREFERENCE_FORMAT, "format_version": PREFERENCE_FORMAT_VERSION, "num_pairs": len(dataset.pairs),
            "num_filtered": dataset.num_filtered, **metadata}
    (staging / PREFERENCE_META_FILE).write_text(json.dumps(meta, indent=2, sort_keys=True), encoding="utf-8")
    if target.exists():
        shutil.rmtree(target)
    staging.rename(target)
    return target


def _read_preprocessed_pairs(path: Path, keys: DataKeys) -> list[PreferencePair]:
    meta = json.loads((path / PREFERENCE_META_FILE).read_text(encoding="utf-8"))
    if meta.get("format") != PREFERENCE_FORMAT or meta.get("format_version") != PREFERENCE_FORMAT_VERSION:
        raise ConfigError(keys.data_path, f"{path / PREFERENCE_META_FILE}: not a version-{PREFERENCE_FORMAT_VERSION} "
                                          f"{PREFERENCE_FORMAT}; re-run cli/preprocess_data.py")
    rows = [json.loads(line) for line in (path / PAIRS_FILE).read_text(encoding="utf-8").splitlines() if line]
    return [PreferencePair(prompt_ids=r["prompt_ids"], chosen_ids=r["chosen_ids"], rejected_ids=r["rejected_ids"],
                           origin=r.get("origin", "")) for r in rows]


# -- the CPU demo's generated pairs --------------------------------------------------------------------------------
def make_arith_pairs(max_operand: int, seed: int, *, eval_fraction: float) -> tuple[list[dict], list[dict]]:
    """(train rows, held-out rows) `{"prompt": "a+b=", "chosen": "<a+b>", "rejected": "<a wrong sum>"}`: every
    problem with every wrong answer in the task's range, shuffled and split; the held-out pairs are (prompt,
    rejected) combinations the training never saw."""
    answers = range(2 * max_operand + 1)
    rows = [{"prompt": f"{a}+{b}=", "chosen": str(a + b), "rejected": str(wrong)}
            for a in range(max_operand + 1) for b in range(max_operand + 1) for wrong in answers if wrong != a + b]
    random.Random(seed).shuffle(rows)
    held_out = max(1, round(len(rows) * eval_fraction))
    return rows[held_out:], rows[:held_out]


def ensure_arith_pairs(data_dir: str, *, max_operand: int, seed: int, eval_fraction: float = 0.2) -> tuple[Path, Path]:
    """(pairs.jsonl, eval_pairs.jsonl) of this parameter set under `data_dir`, generated once (asset_cache)."""
    params = {"format_version": 1, "max_operand": max_operand, "seed": seed, "eval_fraction": eval_fraction}

    def generate(root: Path, params: dict) -> None:
        train, held_out = make_arith_pairs(params["max_operand"], params["seed"],
                                           eval_fraction=params["eval_fraction"])
        for name, rows in ((PAIRS_FILE, train), (EVAL_PAIRS_FILE, held_out)):
            (root / name).write_text("".join(json.dumps(row, sort_keys=True) + "\n" for row in rows), encoding="utf-8")

    root = ensure_generated(data_dir, PAIR_TASK_NAME, params, required=(PAIRS_FILE, EVAL_PAIRS_FILE), generate=generate)
    return root / PAIRS_FILE, root / EVAL_PAIRS_FILE
