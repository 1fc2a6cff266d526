"""Where each row of a JSON data file is, checked before `datasets` reads it: `datasets` reports a bad byte
with a traceback, a bad line by its row index among the non-blank ones, and a non-object row as a schema
clash; here each is one ConfigError with the file and the 1-based line."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Iterator

from mindspeed_rl.errors import ConfigError

BOM = "\ufeff"  # a UTF-8 byte-order mark: allowed at the start of the file


def row_lines(file: Path, *, key: str) -> list[int] | None:
    """The 1-based line of each row of a .jsonl file (None for other files), after the checks `datasets` would
    otherwise fail without a line, for .jsonl and .json files: UTF-8 bytes, valid JSON, one object per row."""
    if file.suffix == ".jsonl":
        return _jsonl_row_lines(file, key)
    if file.suffix != ".json":
        return None
    raw = file.read_bytes()
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as error:
        line_start = raw.rfind(b"\n", 0, error.start) + 1
        raise _not_utf8(file, raw.count(b"\n", 0, error.start) + 1, raw, error.start, line_start, key) from None
    try:
        value = json.loads(text.lstrip(BOM))
    except json.JSONDecodeError as error:
        if error.msg == "Extra data":  # `datasets` reads a .json file of JSON lines too
            return _jsonl_row_lines(file, key)
        raise ConfigError(key, f"{file}:{error.lineno}: not valid JSON ({error.msg} at column {error.colno})") from None
    if isinstance(value, dict):
        return None  # columns by name: rows have no lines of their own
    if not isinstance(value, list):
        raise ConfigError(key, f"{file}:1: a JSON {_json_kind(value)}; expected an array of row objects or a "
                               ".jsonl file with one object per line")
    for element, offset in zip(value, _array_element_offsets(text)):
        if not isinstance(element, dict):
            raise ConfigError(key, f"{file}:{text.count(chr(10), 0, offset) + 1}: a JSON {_json_kind(element)} where "
                                   "each element of the array must be one row object ({...})")
    return None  # an array's rows are named by their index ("row N"): several may share a line


def _jsonl_row_lines(file: Path, key: str) -> list[int]:
    """Line by line, so a file of any size is checked in bounded memory; blank lines hold no row (as in
    `datasets`), so row i is on the i-th non-blank line."""
    lines = []
    with file.open("rb") as handle:
        for number, raw in enumerate(handle, start=1):
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as error:
                raise _not_utf8(file, number, raw, error.start, 0, key) from None
            if not line.strip():
                continue
            try:
                row = json.loads(line.lstrip(BOM) if number == 1 else line)
            except json.JSONDecodeError as error:
                raise ConfigError(key, f"{file}:{number}: not valid JSON ({error.msg} at column {error.colno})") \
                    from None
            if not isinstance(row, dict):
                raise ConfigError(key, f"{file}:{number}: a JSON {_json_kind(row)} where each line must be one "
                                       "row object ({...})")
            lines.append(number)
    return lines


def _not_utf8(file: Path, line: int, raw: bytes, at: int, line_start: int, key: str) -> ConfigError:
    return ConfigError(key, f"{file}:{line}: not UTF-8 text (byte 0x{raw[at]:02x} at column {at - line_start + 1}); "
                            "save the file as UTF-8")


def _array_element_offsets(text: str) -> Iterator[int]:
    """Where each element of the (valid) JSON array `text` starts."""
    decoder, index = json.JSONDecoder(), text.index("[") + 1
    while True:
        index = _skip_space(text, index)
        if text[index] == "]":
            return
        yield index
        _, index = decoder.raw_decode(text, index)
        index = _skip_space(text, index)
        index += text[index] == ","


def _skip_space(text: str, index: int) -> int:
    while text[index] in " \t\r\n":
        index += 1
    return index


def _json_kind(value: Any) -> str:
    return {list: "array", str: "string", bool: "boolean", type(None): "null"}.get(type(value), "number")
