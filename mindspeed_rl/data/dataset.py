"""Prompt datasets: read rows with HF ``datasets``, map fields, render the template, filter by length.

``megatron_training.data_path`` is a ``.jsonl`` / ``.json`` / ``.parquet`` file, a directory of such
files (read in name order, each on its own so that an error names its file and row), or a directory
written by ``cli/preprocess_data.py`` (token ids stored: loaded without re-tokenizing).
``PromptSampler`` gives the order in which the trainer takes them.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import tempfile
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

import numpy as np

from mindspeed_rl.errors import ConfigError
from mindspeed_rl.console import show_progress_bar
from mindspeed_rl.data.json_rows import row_lines
from mindspeed_rl.registries import OVERLONG_CHOICES, resolve_map_keys  # noqa: F401 (OVERLONG_CHOICES: API)
from mindspeed_rl.data.templates import (
    CHAT_PROMPT_TYPE,
    PromptFormatError,
    check_tokenizer_supports,
    prompt_messages,
    render_prompt_with_text,
)

FILE_FORMATS = {".jsonl": "json", ".json": "json", ".parquet": "parquet"}
PREPROCESSED_META_FILE = "prompt_dataset.json"
PREPROCESSED_FORMAT = "mindspeed_rl.prompt_dataset"
PREPROCESSED_FORMAT_VERSION = 1


@dataclass(frozen=True, kw_only=True)
class DataKeys:
    """The config keys that errors name; the preprocessing CLI has its own (``input``, ``seq_length``...)."""

    data_path: str = "megatron_training.data_path"
    prompt_type: str = "megatron_training.prompt_type"
    map_keys: str = "megatron_training.map_keys"
    max_prompt_length: str = "rl_config.max_prompt_length"
    overlong_prompts: str = "megatron_training.overlong_prompts"
    tokenizer: str = "megatron_training.tokenizer_name_or_path"


TRAINING_KEYS = DataKeys()


@dataclass(frozen=True, kw_only=True)
class PromptRecord:
    token_ids: list[int]
    label: str
    prompt_text: str  # the rendered prompt (after the template), for logging
    origin: str = ""  # "file:line" (jsonl) or "file: row N", for messages about this prompt


@dataclass(frozen=True, kw_only=True)
class PromptDataset:
    records: list[PromptRecord]
    num_filtered: int  # over-long prompts dropped (here and, for preprocessed data, at preprocessing)
    source: str  # what was read (path), for the start-up line


def load_prompt_dataset(data_path: str, *, tokenizer, prompt_type: str, map_keys: Mapping[str, str],
                        max_prompt_length: int, overlong_prompts: str = "filter", show_progress: bool = True,
                        keys: DataKeys = TRAINING_KEYS) -> PromptDataset:
    """Every usable prompt of ``data_path``; raises ConfigError naming the key, file and row of a problem."""
    if overlong_prompts not in OVERLONG_CHOICES:
        raise ConfigError(keys.overlong_prompts, f"must be one of {', '.join(OVERLONG_CHOICES)}, got {overlong_prompts!r}")
    if max_prompt_length < 1:
        raise ConfigError(keys.max_prompt_length, f"must be > 0, got {max_prompt_length}")
    check_tokenizer_supports(prompt_type, tokenizer, key=keys.prompt_type)
    fields = resolve_map_keys(map_keys, key=keys.map_keys)
    path = Path(data_path)
    if not path.exists():
        raise ConfigError(keys.data_path, f"{data_path} does not exist")
    if (path / PREPROCESSED_META_FILE).is_file():
        candidates, filtered_before = _read_preprocessed(path, tokenizer, prompt_type, keys)
    else:
        candidates, filtered_before = _read_raw(path, tokenizer, prompt_type, fields, keys, show_progress), 0
    if not candidates:
        raise ConfigError(keys.data_path, f"{data_path}: the dataset has no rows")
    records = []
    for record in candidates:
        if len(record.token_ids) <= max_prompt_length:  # MindSpeed-RL drops over-long prompts the same way
            records.append(record)
        elif overlong_prompts == "error":
            raise ConfigError(keys.max_prompt_length,
                              f"{record.origin}: the prompt has {len(record.token_ids)} tokens > {max_prompt_length} "
                              f"(set {keys.overlong_prompts}=filter to drop such prompts)")
    if len(records) < len(candidates):
        print(f"[data] {data_path}: dropped {len(candidates) - len(records)} prompts longer than "
              f"{keys.max_prompt_length}={max_prompt_length} tokens ({len(records)} kept)", flush=True)
    num_filtered = filtered_before + len(candidates) - len(records)
    if not records:
        raise ConfigError(keys.max_prompt_length, f"no prompt of {data_path} fits in {max_prompt_length} tokens")
    return PromptDataset(records=records, num_filtered=num_filtered, source=str(data_path))


def tokenizer_fingerprint(tokenizer, prompt_type: str) -> str:
    """sha256 of the vocabulary (and of the chat template for ``chat``): stored token ids are only valid
    for a tokenizer with this fingerprint."""
    digest = hashlib.sha256(json.dumps(sorted(tokenizer.get_vocab().items())).encode())
    if prompt_type == CHAT_PROMPT_TYPE:
        digest.update(str(tokenizer.chat_template).encode())
    return digest.hexdigest()


def save_prompt_dataset(dataset: PromptDataset, output_dir: str, *, metadata: Mapping[str, Any],
                        key: str = "output_prefix") -> Path:
    """Write ``dataset`` with ``datasets``' save_to_disk plus ``prompt_dataset.json``, atomically:
    built in a temporary sibling directory, then renamed over ``output_dir``. An existing
    ``output_dir`` is replaced only if it is itself a preprocessed dataset."""
    import datasets

    target = Path(output_dir).resolve()
    if target.exists() and not (target / PREPROCESSED_META_FILE).is_file():
        raise ConfigError(key, f"{target} exists and is not a preprocessed prompt dataset; refusing to overwrite it")
    target.parent.mkdir(parents=True, exist_ok=True)
    features = datasets.Features({"token_ids": datasets.List(datasets.Value("int32")), "label": datasets.Value("string"),
                                  "prompt_text": datasets.Value("string"), "origin": datasets.Value("string")})
    columns = {name: [getattr(r, name) for r in dataset.records] for name in features}
    meta = {"format": PREPROCESSED_FORMAT, "format_version": PREPROCESSED_FORMAT_VERSION,
            "num_records": len(dataset.records), "num_filtered": dataset.num_filtered, **metadata}
    staging = Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-", dir=target.parent))
    try:
        datasets.Dataset.from_dict(columns, features=features).save_to_disk(str(staging / "data"))
        for item in (staging / "data").iterdir():  # flatten: the dataset and its metadata side by side
            item.rename(staging / item.name)
        (staging / "data").rmdir()
        (staging / PREPROCESSED_META_FILE).write_text(json.dumps(meta, indent=2, sort_keys=True), encoding="utf-8")
        if target.exists():  # move the old one aside first: rename cannot replace a non-empty directory
            old = Path(tempfile.mkdtemp(prefix=f".{target.name}.old-", dir=target.parent))
            target.rename(old / "data")
            staging.rename(target)
            shutil.rmtree(old, ignore_errors=True)
        else:
            staging.rename(target)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return target


def _read_preprocessed(path: Path, tokenizer, prompt_type: str, keys: DataKeys) -> tuple[list[PromptRecord], int]:
    import datasets

    meta_file, meta = path / PREPROCESSED_META_FILE, _read_meta(path, keys)
    # The ids were rendered at preprocessing: a different template or tokenizer here would silently not apply.
    if meta.get("prompt_type") != prompt_type:
        raise ConfigError(keys.prompt_type, f"{path} was preprocessed with prompt_type={meta.get('prompt_type')!r} "
                                            f"({meta_file}), got {prompt_type!r}; set them equal or re-run preprocessing")
    if meta.get("tokenizer_fingerprint") != tokenizer_fingerprint(tokenizer, prompt_type):
        raise ConfigError(keys.tokenizer, f"{path} was tokenized with another tokenizer "
                                          f"({meta.get('tokenizer_name_or_path')}, per {meta_file}); re-run preprocessing")
    try:
        columns = datasets.load_from_disk(str(path)).to_dict()
    except Exception as error:  # datasets raises several types for a damaged directory
        raise ConfigError(keys.data_path, f"{path}: cannot load the preprocessed dataset ({_first_line(error)})") from None
    records = [PromptRecord(token_ids=ids, label=label, prompt_text=text, origin=origin) for ids, label, text, origin
               in zip(columns["token_ids"], columns["label"], columns["prompt_text"], columns["origin"])]
    filtered = int(meta.get("num_filtered", 0))
    if filtered:
        print(f"[data] {path}: {filtered} prompts longer than seq_length={meta.get('seq_length')} tokens were "
              f"dropped at preprocessing", flush=True)
    return records, filtered


def check_prompt_rows(data_path: str, *, map_keys: Mapping[str, str], keys: DataKeys = TRAINING_KEYS) -> int:
    """The number of rows of ``data_path`` after checking every row's mapped fields and prompt format,
    without a tokenizer: a data error can stop a run before the tokenizer or the model is loaded.
    Raises the same ConfigErrors as ``load_prompt_dataset`` for those problems."""
    fields = resolve_map_keys(map_keys, key=keys.map_keys)
    path = Path(data_path)
    if not path.exists():
        raise ConfigError(keys.data_path, f"{data_path} does not exist")
    if (path / PREPROCESSED_META_FILE).is_file():
        return int(_read_meta(path, keys).get("num_records", 0))
    count = 0
    for origin, prompt, _, system in _raw_rows(_read_tables(path, keys), fields, keys):
        try:
            prompt_messages(prompt, system)
        except PromptFormatError as error:
            raise ConfigError(keys.data_path, f"{origin}: field {fields['prompt']!r}: {error}") from None
        count += 1
    if not count:
        raise ConfigError(keys.data_path, f"{data_path}: the dataset has no rows")
    return count


def _read_meta(path: Path, keys: DataKeys) -> dict[str, Any]:
    meta_file = path / PREPROCESSED_META_FILE
    try:
        meta = json.loads(meta_file.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as error:
        raise ConfigError(keys.data_path, f"{meta_file}: unreadable metadata ({error})") from None
    if meta.get("format") != PREPROCESSED_FORMAT or meta.get("format_version") != PREPROCESSED_FORMAT_VERSION:
        raise ConfigError(keys.data_path, f"{meta_file}: not a version-{PREPROCESSED_FORMAT_VERSION} "
                                          f"{PREPROCESSED_FORMAT}; re-run cli/preprocess_data.py")
    return meta


def _read_raw(path: Path, tokenizer, prompt_type: str, fields: dict[str, str], keys: DataKeys,
              show_progress: bool) -> list[PromptRecord]:
    from tqdm.auto import tqdm

    tables = _read_tables(path, keys)
    records = []
    total = sum(len(table) for _, table, _ in tables)
    rows = tqdm(_raw_rows(tables, fields, keys), total=total, desc="tokenizing prompts", unit="prompt",
                disable=not (show_progress and show_progress_bar(total)))
    for origin, prompt, label, system in rows:
        try:
            text, token_ids = render_prompt_with_text(prompt, tokenizer=tokenizer, prompt_type=prompt_type,
                                                      system=system, key=keys.prompt_type)
        except PromptFormatError as error:
            raise ConfigError(keys.data_path, f"{origin}: field {fields['prompt']!r}: {error}") from None
        records.append(PromptRecord(token_ids=list(token_ids), label=label, prompt_text=text, origin=origin))
    return records


def _read_tables(path: Path, keys: DataKeys) -> list[tuple[Path, Any, list[int] | None]]:
    """(file, HF Dataset, each row's line or None) for each data file of ``path``."""
    tables = []
    for file in _data_files(path, keys):
        if file.stat().st_size == 0:
            raise ConfigError(keys.data_path, f"{file}: the file is empty")
        lines = row_lines(file, key=keys.data_path)  # what `datasets` would fail on without a line, said with one
        tables.append((file, _read_table(file, keys), lines))
    return tables


def _raw_rows(tables: list[tuple[Path, Any, list[int] | None]], fields: dict[str, str], keys: DataKeys) -> Iterator:
    """(origin, prompt, label, system) per row, the mapped fields checked."""
    for file, table, line_numbers in tables:
        for row_index, row in enumerate(table):
            origin = f"{file}:{line_numbers[row_index]}" if line_numbers else f"{file}: row {row_index + 1}"
            yield (origin, *_row_values(row, origin, fields, keys))


def _row_values(row: Mapping[str, Any], origin: str, fields: dict[str, str],
                keys: DataKeys) -> tuple[Any, str, Optional[str]]:
    prompt = _field(row, fields["prompt"], origin, "prompt", keys)
    label = _field(row, fields["labels"], origin, "labels", keys)
    if isinstance(label, bool) or not isinstance(label, (str, int, float)):
        raise ConfigError(keys.data_path, f"{origin}: the label field {fields['labels']!r} must be a string or a "
                                          f"number, got {type(label).__name__}")
    if isinstance(label, float) and label.is_integer():
        # Arrow gives a column mixing 7 and 0.5 one float type; the file said 7, and "7.0" would fail
        # an exact-match verifier.
        label = int(label)
    system = _field(row, fields["system"], origin, "system", keys, required=False) if "system" in fields else None
    if system is not None and not isinstance(system, str):
        raise ConfigError(keys.data_path, f"{origin}: the system field {fields['system']!r} must be a string")
    return prompt, str(label), system or None


_MISSING = object()


def _field(row: Mapping[str, Any], dotted: str, origin: str, name: str, keys: DataKeys, *, required: bool = True):
    """The value at a dotted path (``reward_model.ground_truth``); a missing or null one is an error."""
    value: Any = row
    for part in dotted.split("."):
        value = value.get(part, _MISSING) if isinstance(value, Mapping) else _MISSING
        if value is _MISSING or value is None:
            break
    if value is _MISSING or value is None:
        if not required:
            return None
        raise ConfigError(keys.data_path, f"{origin}: the row has no {dotted!r} ({keys.map_keys}.{name}={dotted}); "
                                          f"its fields: {', '.join(sorted(k for k, v in row.items() if v is not None))}")
    return value


def _data_files(path: Path, keys: DataKeys) -> list[Path]:
    expected = "a .jsonl, .json or .parquet file, a directory of them, or a directory written by cli/preprocess_data.py"
    if path.is_file():
        if path.suffix not in FILE_FORMATS:
            raise ConfigError(keys.data_path, f"{path}: expected {expected}")
        return [path]
    files = sorted(p for p in path.iterdir() if p.is_file() and p.suffix in FILE_FORMATS and not p.name.startswith("."))
    if not files:
        raise ConfigError(keys.data_path, f"{path}: no .jsonl, .json or .parquet file in this directory (expected {expected})")
    return files


def _read_table(file: Path, keys: DataKeys):
    """The file's rows through HF ``datasets`` (its Arrow cache makes a second read cheap)."""
    import datasets

    fmt = FILE_FORMATS[file.suffix]
    verbosity, bars = datasets.logging.get_verbosity(), datasets.is_progress_bar_enabled()
    # datasets logs its own copy of a parse error before raising; ours names the key and is enough.
    datasets.logging.set_verbosity(datasets.logging.CRITICAL)
    datasets.disable_progress_bars()
    try:
        return datasets.load_dataset(fmt, data_files=[str(file)], split="train")
    except Exception as error:  # pyarrow / datasets raise many types for a malformed file
        cause = error.__cause__ or error
        if "corresponds to no data" in str(cause):  # what datasets says for a file without rows ("[]")
            raise ConfigError(keys.data_path, f"{file}: the file has no rows") from None
        raise ConfigError(keys.data_path, f"{file}: cannot read as {fmt} ({_first_line(cause)})") from None
    finally:
        datasets.logging.set_verbosity(verbosity)
        if bars:
            datasets.enable_progress_bars()


def _first_line(error: BaseException) -> str:
    text = str(error).strip()
    return text.splitlines()[0] if text else type(error).__name__


class PromptSampler:
    """Deterministic order from the seed; a new permutation every epoch; resumable.

    The epochs form one stream: a batch that reaches the end of an epoch continues with the next
    epoch's permutation, so no prompt is ever skipped (not even with ``shuffle=False`` and a dataset
    size that is not a multiple of ``batch_size``). Epoch e's permutation depends only on (seed, e),
    so the state is just (epoch, position). With fewer records than ``batch_size`` a batch holds
    some prompts more than once; that needs ``wrap_small_dataset``, else it is a config error.
    """

    def __init__(self, num_records: int, batch_size: int, *, seed: int, shuffle: bool, wrap_small_dataset: bool):
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        if num_records < 1:
            raise ConfigError(TRAINING_KEYS.data_path, "the dataset has no prompts")
        if num_records < batch_size and not wrap_small_dataset:
            raise ConfigError("megatron_training.global_batch_size",
                              f"{batch_size} prompts per iteration, but the dataset has only {num_records} usable "
                              f"prompts; lower it, or set megatron_training.wrap_small_dataset=true to repeat prompts")
        self.num_records, self.batch_size = num_records, batch_size
        self.seed, self.shuffle = seed, shuffle
        self._epoch, self._position = 0, 0
        self._order = self._permutation(0)

    @property
    def epoch(self) -> int:
        """Completed passes over the dataset."""
        return self._epoch

    def next_indices(self) -> list[int]:
        indices: list[int] = []
        while len(indices) < self.batch_size:
            take = min(self.batch_size - len(indices), self.num_records - self._position)
            indices += self._order[self._position:self._position + take]
            self._position += take
            if self._position == self.num_records:
                self._epoch, self._position = self._epoch + 1, 0
                self._order = self._permutation(self._epoch)
        return indices

    def state_dict(self) -> dict:
        return {"epoch": self._epoch, "position": self._position, "num_records": self.num_records,
                "seed": self.seed, "shuffle": self.shuffle}

    def load_state_dict(self, state: dict) -> None:
        # The position only means something for the same dataset and the same permutations.
        for name in ("num_records", "seed", "shuffle"):
            if state[name] != getattr(self, name):
                raise ConfigError(TRAINING_KEYS.data_path,
                                  f"cannot resume the data order: it was saved for {name}={state[name]!r}, "
                                  f"now {name}={getattr(self, name)!r}")
        if not 0 <= state["position"] < self.num_records:
            raise ValueError(f"position {state['position']} out of range for {self.num_records} records")
        self._epoch, self._position = int(state["epoch"]), int(state["position"])
        self._order = self._permutation(self._epoch)

    def _permutation(self, epoch: int) -> list[int]:
        if not self.shuffle:
            return list(range(self.num_records))
        # SeedSequence takes non-negative entropy; the mask keeps a negative seed deterministic too.
        return np.random.default_rng([self.seed & (2**64 - 1), epoch]).permutation(self.num_records).tolist()
