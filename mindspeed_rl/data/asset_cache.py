"""Generated demo assets under a directory, made once and reused while their parameters match.

A manifest (`assets.json`) records the generation parameters; it is removed before regenerating and
written last, so a crash mid-way never leaves new files under an old manifest.
"""
from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path
from typing import Any, Callable, Iterable

MANIFEST_FILE = "assets.json"


def ensure_generated(root: Path, params: dict[str, Any], *, required: Iterable[str],
                     generate: Callable[[Path, dict[str, Any]], None]) -> None:
    """Run `generate(root, params)` unless `root` holds every `required` file under a manifest equal to `params`."""
    if _cache_matches(root, params, required):
        return
    root.mkdir(parents=True, exist_ok=True)
    (root / MANIFEST_FILE).unlink(missing_ok=True)
    generate(root, params)
    write_text_atomic(root / MANIFEST_FILE, json.dumps(params, indent=2, sort_keys=True))


def _cache_matches(root: Path, params: dict[str, Any], required: Iterable[str]) -> bool:
    manifest = root / MANIFEST_FILE
    if not manifest.is_file() or not all((root / name).is_file() for name in required):
        return False
    try:
        return json.loads(manifest.read_text(encoding="utf-8")) == params
    except json.JSONDecodeError:
        return False


def write_text_atomic(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp_name = tempfile.mkstemp(prefix=f".{path.name}.tmp-", dir=path.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as handle:
            handle.write(text)
        os.replace(tmp_name, path)
    except BaseException:
        Path(tmp_name).unlink(missing_ok=True)
        raise
