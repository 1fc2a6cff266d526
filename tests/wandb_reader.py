"""Test scaffolding: the history rows of a wandb run file (`run-<id>.wandb`), read without the wandb service.

The file is a LevelDB-style log (wandb's datastore): a 7-byte header, then 32 KiB blocks of records, each a
7-byte header (crc32, length, type: 1 full, 2 first, 3 middle, 4 last) and its bytes; each whole record is a
`wandb_internal_pb2.Record`.
"""
import json
import struct
import time
from pathlib import Path

BLOCK_BYTES = 32768
HEADER_BYTES = 7


def history_rows(run_file: Path, *, timeout_seconds: float = 60.0) -> list[dict]:
    """The run's history rows once its `exit` record is on disk.

    CI once read no history right after `run.finish()` (not reproduced here, even with the cores loaded); the likely
    cause is the service's writer still holding the file's tail, so wait for the exit record, bounded.
    """
    deadline = time.monotonic() + timeout_seconds
    while True:
        records = _records(run_file)
        if any(record.WhichOneof("record_type") == "exit" for record in records) or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    kinds = [record.WhichOneof("record_type") for record in records]
    assert "exit" in kinds, f"{run_file} has no exit record after {timeout_seconds} s: {kinds}"
    return [{item.key or "/".join(item.nested_key): json.loads(item.value_json) for item in record.history.item}
            for record in records if record.WhichOneof("record_type") == "history"]


def _records(run_file: Path) -> list:
    from wandb.proto import wandb_internal_pb2

    data = run_file.read_bytes()
    assert data[:4] == b":W&B", run_file
    records, pending, position = [], b"", HEADER_BYTES
    while position + HEADER_BYTES <= len(data):
        left_in_block = BLOCK_BYTES - position % BLOCK_BYTES
        if left_in_block < HEADER_BYTES:  # the block's tail is padding
            position += left_in_block
            continue
        _, length, kind = struct.unpack("<IHB", data[position:position + HEADER_BYTES])
        if position + HEADER_BYTES + length > len(data):  # a record still being written
            break
        pending += data[position + HEADER_BYTES:position + HEADER_BYTES + length]
        position += HEADER_BYTES + length
        if kind in (1, 4):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            pending = b""
            records.append(record)
    return records
