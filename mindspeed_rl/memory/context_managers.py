"""ROLL's offload control surface: `state_offload_manager` and `log_gpu_memory_usage`. The strategy
objects it drives (`PhaseStates`, `StateSet`) move states through the sharding manager
(workers/sharding_manager.py), the one mover.

    with state_offload_manager(strategy, metrics, metric_infix, is_offload_states=True):
        ...  # the role's states are on the device here

reloads the strategy's states, runs the body, offloads them again unless `is_offload_states`
is False, and records into `metrics`: `timing/<infix>/onload`, `.../execute`, `.../offload`,
`.../total` (seconds) and `offload/<infix>/reload_bytes`, `.../offload_bytes` (bytes copied).
"""
from __future__ import annotations

import contextlib
import logging
import os
import time
from typing import Callable, Iterator

from mindspeed_rl.accelerator import Accelerator

_memory_sources: list[Callable[[], dict[str, int]]] = []
_accelerator: list[Accelerator] = []  # the one the registering worker runs on


def _reload(strategy, load_kwargs: dict) -> int | None:
    # ROLL's strategies call it load_states; ours reload_states. Accept both.
    reload = getattr(strategy, "reload_states", None) or strategy.load_states
    return reload(**load_kwargs)


@contextlib.contextmanager
def state_offload_manager(strategy, metrics: dict, metric_infix: str, is_offload_states: bool = True,
                          load_kwargs: dict | None = None) -> Iterator[None]:
    started = time.perf_counter()
    reloaded = _reload(strategy, load_kwargs or {})
    loaded = time.perf_counter()
    metrics[f"timing/{metric_infix}/onload"] = loaded - started
    metrics[f"offload/{metric_infix}/reload_bytes"] = float(reloaded or 0)
    try:
        yield
    finally:
        executed = time.perf_counter()
        offloaded = strategy.offload_states() if is_offload_states else 0
        done = time.perf_counter()
        metrics[f"timing/{metric_infix}/execute"] = executed - loaded
        metrics[f"timing/{metric_infix}/offload"] = done - executed
        metrics[f"timing/{metric_infix}/total"] = done - started
        metrics[f"offload/{metric_infix}/offload_bytes"] = float(offloaded or 0)


# ROLL spells its context manager `state_offload_manger`; code written against ROLL runs unchanged.
state_offload_manger = state_offload_manager


def register_memory_source(read_bytes: Callable[[], dict[str, int]], accelerator: Accelerator) -> None:
    """Let `log_gpu_memory_usage` report this process's ledger categories (the worker registers its own)."""
    _memory_sources.append(read_bytes)
    _accelerator[:] = [accelerator]


def clear_memory_sources() -> None:
    _memory_sources.clear()
    _accelerator.clear()


def _rss_bytes() -> int:
    import psutil

    return psutil.Process(os.getpid()).memory_info().rss


def log_gpu_memory_usage(head: str, logger: logging.Logger | None = None, rank: int | None = None) -> str | None:
    """Log device memory per ledger category, the allocator's counters and the host RSS.

    `rank=None` logs on every rank; an int logs only on that global rank. Returns the message
    (None on ranks that do not log).
    """
    import torch.distributed as dist

    if rank is not None and dist.is_initialized() and dist.get_rank() != rank:
        return None
    from mindspeed_rl.accelerator import get_accelerator

    accelerator = _accelerator[0] if _accelerator else get_accelerator()
    mib = 2**20
    parts = [head]
    for read_bytes in _memory_sources:
        by_category = read_bytes()
        parts.append(", ".join(f"{name} {value / mib:.1f} MiB" for name, value in by_category.items()))
        parts.append(f"ledger total {sum(by_category.values()) / mib:.1f} MiB")
    allocated = accelerator.memory_allocated_bytes()
    if allocated is not None:
        parts.append(f"allocated {allocated / mib:.1f} MiB, max allocated "
                     f"{accelerator.max_memory_allocated_bytes() / mib:.1f} MiB")
    parts.append(f"host rss {_rss_bytes() / mib:.1f} MiB")
    message = " | ".join(parts)
    (logger or logging.getLogger("mindspeed_rl.memory")).info(message)
    return message
