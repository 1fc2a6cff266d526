"""Byte sizes as people write and read them: `runtime.device_memory_limit`, `cli/plan.py --device-memory`, the
planner's tables and the out-of-memory line."""
from __future__ import annotations

import math

GIB = 1 << 30


def format_bytes(value: float) -> str:
    if value == 0:
        return "-"
    for unit, size in (("GiB", GIB), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if abs(value) >= size:
            return f"{value / size:.2f} {unit}"
    return f"{int(value)} B"


def parse_bytes(text: str) -> int:
    """'64GiB', '80GB', '512MiB', '1.5TiB', '123' (bytes)."""
    units = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
             "KIB": 1 << 10, "MIB": 1 << 20, "GIB": 1 << 30, "TIB": 1 << 40, "K": 1 << 10, "M": 1 << 20,
             "G": 1 << 30, "T": 1 << 40}
    stripped = text.strip().replace(" ", "")
    number = stripped.rstrip("KMGTiBkmgtib")
    unit = stripped[len(number):].upper()
    if unit not in units or not number:
        raise ValueError(f"{text!r} is not a size like 64GiB, 80GB or 1.5TiB")
    try:
        value = float(number)
    except ValueError:
        raise ValueError(f"{text!r} is not a size like 64GiB, 80GB or 1.5TiB") from None
    if value <= 0 or not math.isfinite(value):
        raise ValueError(f"{text!r} must be a positive size")
    return int(value * units[unit])
