"""Per-process RNG states (python, numpy, torch CPU, extra torch.Generators) for an exact resume."""

from __future__ import annotations

import os
import random
from pathlib import Path

import numpy as np
import torch


def capture_rng_state(generators: dict[str, torch.Generator] | None = None) -> dict:
    """Every RNG state of this process, plus the named generators (e.g. the mini-batch shuffler's)."""
    return {
        "python": random.getstate(),
        "numpy": np.random.get_state(),
        "torch": torch.get_rng_state(),
        "generators": {name: gen.get_state() for name, gen in (generators or {}).items()},
    }


def restore_rng_state(state: dict, generators: dict[str, torch.Generator] | None = None) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    for name, gen in (generators or {}).items():
        gen.set_state(state["generators"][name])


def rng_file(checkpoint_dir: str | os.PathLike, rank: int) -> Path:
    return Path(checkpoint_dir) / "rng" / f"rank_{rank:05d}.pt"


def save_rng_state(checkpoint_dir: str | os.PathLike, rank: int,
                   generators: dict[str, torch.Generator] | None = None) -> None:
    path = rng_file(checkpoint_dir, rank)
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.save(capture_rng_state(generators), path)


def load_rng_state(checkpoint_dir: str | os.PathLike, rank: int,
                   generators: dict[str, torch.Generator] | None = None) -> None:
    # weights_only=False: python's and numpy's states are tuples holding numpy arrays; the file was
    # verified against the manifest's sha256 before this is reached.
    restore_rng_state(torch.load(rng_file(checkpoint_dir, rank), weights_only=False), generators)
