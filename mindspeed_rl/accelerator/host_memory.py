"""Host memory in 2 MiB pages: the CPU's "device" storages after a reload, and offload mirrors.

Why our own mapping: on CPU a storage freed at offload comes back at reload as new pages that the
kernel faults in and zeroes one page at a time. torch's allocator aligns large buffers to 4 KiB only
(with or without `THP_MEM_ALLOC_ENABLE`), so a 4 MiB tensor gets at most one huge page and the rest
in 4 KiB pages, and page faults, not the copy, set the reload time. A mapping aligned to 2 MiB and
advised `MADV_HUGEPAGE` faults once per 2 MiB. Measured side by side on this 2-core machine
(benchmarks/bench_offload.py, 1 GiB, raw copy ~19 GiB/s): reload went from 0.30 to 0.83 of raw copy
with 4 MiB tensors and from 0.72 to 0.82 with 64 MiB tensors; offload from 0.54 to 0.91 and 0.90
to 0.94. What remains is the kernel zeroing the fresh pages, the price of really freeing them.

The storage returned owns its mapping: when the last tensor or storage that uses it goes, the
mapping is unmapped and the memory returns to the kernel.
"""
from __future__ import annotations

import functools
import mmap
import os
from pathlib import Path

import torch

HUGE_PAGE_BYTES = 2 << 20
_enabled = True


def set_huge_pages(enabled: bool) -> None:
    """Turn 2 MiB mappings on or off for this process (a benchmark's ablation; on by default)."""
    global _enabled
    _enabled = enabled


def huge_pages_enabled() -> bool:
    return _enabled


def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def _address(region: mmap.mmap) -> int:
    probe = torch.frombuffer(region, dtype=torch.uint8, count=1)
    address = probe.data_ptr()
    del probe  # an exported buffer would keep the region from ever being unmapped
    return address


def _advise_huge(region: mmap.mmap, offset: int, length: int) -> None:
    advice = getattr(mmap, "MADV_HUGEPAGE", None)
    if advice is None:
        return
    try:
        region.madvise(advice, offset, length)
    except OSError:
        pass  # a kernel without transparent huge pages: small pages still work, only slower


def huge_page_storage(nbytes: int, *, zeroed: bool = False) -> torch.UntypedStorage:
    """`nbytes` of host memory, 2 MiB-aligned and in huge pages where the kernel has them; zeros with `zeroed`.

    Small requests (under one huge page) come from torch's allocator: a mapping of their own would
    round them up to 2 MiB. A mapping is zeros as it comes (the kernel zeroes each page at its first
    touch), so `zeroed` costs nothing there: writing zeros would fault in every page now, also the
    ones never used (most of a KV cache sized for longer sequences than a run samples).
    """
    assert nbytes >= 0
    if nbytes < HUGE_PAGE_BYTES or not _enabled:
        factory = torch.zeros if zeroed else torch.empty
        return factory(nbytes, dtype=torch.uint8).untyped_storage()
    length = _round_up(nbytes, HUGE_PAGE_BYTES)
    # Linux aligns an anonymous mapping whose length is a multiple of 2 MiB; older kernels may
    # not, and then one spare huge page of address space (never touched, so never resident) lets
    # the storage start on a boundary.
    region = mmap.mmap(-1, length, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    offset = 0
    if _address(region) % HUGE_PAGE_BYTES:
        region.close()
        region = mmap.mmap(-1, length + HUGE_PAGE_BYTES, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        offset = -_address(region) % HUGE_PAGE_BYTES
    _advise_huge(region, offset, length)
    # frombuffer's storage holds the region until the storage dies; then the region is unmapped.
    return torch.frombuffer(region, dtype=torch.uint8, count=nbytes, offset=offset).untyped_storage()


def _glibc_malloc_trim():
    import ctypes
    import ctypes.util

    try:
        return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").malloc_trim
    except (OSError, AttributeError):
        return None  # musl, macOS: no malloc_trim, nothing to do


# MINDSPEED_RL_KEEP_FREE_HEAP=1 turns it off: benchmarks/bench_soak.py's side-by-side ablation.
_malloc_trim = None if os.environ.get("MINDSPEED_RL_KEEP_FREE_HEAP") == "1" else _glibc_malloc_trim()


def return_free_heap() -> None:
    """Give the C heap's free pages back to the kernel (glibc's `malloc_trim(0)`); a no-op elsewhere.

    Why: every iteration allocates and frees many small and mid-size buffers outside torch's tensors
    (tokenizer, vLLM's scheduler, pickled RPC payloads, Megatron's bookkeeping). glibc keeps freed chunks
    in its arenas, and a run's arenas fragment: RSS rose 0.33-0.88 MB per 100 iterations of the demo while
    the Python objects alive stayed the same (benchmarks/bench_soak.py; a week-long run would hold
    gigabytes of free heap). Called once per iteration per process, it costs about a millisecond.
    """
    if _malloc_trim is not None:
        _malloc_trim(0)


@functools.lru_cache(maxsize=None)
def last_level_cache_bytes(default: int = 32 << 20) -> int:
    """The largest CPU cache of this host (sysfs; `default` where the kernel does not say)."""
    sizes = []
    for entry in Path("/sys/devices/system/cpu/cpu0/cache").glob("index*/size"):
        text = entry.read_text().strip().upper()
        units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
        try:
            sizes.append(int(text[:-1]) * units[text[-1]] if text[-1] in units else int(text))
        except (ValueError, IndexError):
            continue
    return max(sizes, default=default)
