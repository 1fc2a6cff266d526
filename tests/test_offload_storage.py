"""The storage offloader on plain tensors: bit-exact round trips that keep views valid, mirrors
allocated once, device storage really freed, dropped contents, re-bound tensors; and ROLL's
`state_offload_manager` driving it.

Runs where: in the pytest process, CPU, no distributed world; < 2 s.
"""
import sys

import pytest
import torch

from mindspeed_rl.accelerator import get_accelerator
from mindspeed_rl.memory import Offloader, state_offload_manager, state_offload_manger
from mindspeed_rl.memory.residency import ResidencyPolicy
from mindspeed_rl.workers.sharding_manager import ShardingManager, StateSet


def _tensors(seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    flat = torch.randn(4096, generator=g)
    return {
        "flat": flat,
        "view_a": flat[:1024].view(32, 32),          # two views of one storage: one slot, one copy
        "view_b": flat[2048:].view(64, 32).t(),      # non-contiguous view
        "bf16": torch.randn(300, 7, generator=g).to(torch.bfloat16),
        "int": torch.randint(0, 1000, (513,), generator=g),
    }


def test_round_trip_is_bit_exact_and_keeps_views():
    tensors = _tensors()
    expected = {k: v.clone() for k, v in tensors.items()}
    offloader = Offloader(get_accelerator("cpu"))
    offloader.register("states", lambda: tensors.values())
    nbytes = 4096 * 4 + 300 * 7 * 2 + 513 * 8
    assert offloader.resident_bytes() == {"states": nbytes}
    mirrors = None
    for _ in range(3):
        assert offloader.offload("states") == nbytes
        assert offloader.resident_bytes() == {"states": 0}
        assert all(t.untyped_storage().nbytes() == 0 for t in tensors.values()), "device storage must be freed"
        group = offloader.states["states"]
        ptrs = sorted(slot.mirror.data_ptr() for slot in group.slots.values())
        assert mirrors is None or ptrs == mirrors, "host mirrors are allocated once and reused"
        mirrors = ptrs
        assert offloader.reload("states") == nbytes
        for name, tensor in tensors.items():  # the same tensor objects, views included, hold the data again
            assert torch.equal(tensor, expected[name]), name
    tensors["view_a"].fill_(7.0)  # views still alias their base after the round trips
    assert torch.equal(tensors["flat"][:1024], torch.full((1024,), 7.0))
    assert offloader.bytes_copied == 6 * nbytes


def test_dropped_contents_come_back_as_zeros_and_cost_no_copy():
    grads = [torch.ones(100), torch.ones(10, 10)]
    offloader = Offloader(get_accelerator("cpu"))
    offloader.register("train_grads", lambda: grads, keep_contents=False)
    assert offloader.offload("train_grads") == 0
    assert offloader.reload("train_grads") == 0
    assert all(torch.equal(g, torch.zeros_like(g)) for g in grads)
    # A per-call override keeps them (the "keep grads" configuration).
    grads[0].fill_(3.0)
    assert offloader.offload("train_grads", keep_contents=True) == 800
    offloader.reload("train_grads")
    assert torch.equal(grads[0], torch.full((100,), 3.0))


def test_idempotent_and_follows_rebound_tensors():
    module = torch.nn.Linear(8, 4)
    offloader = Offloader(get_accelerator("cpu"))
    offloader.register("params", lambda: (p.data for p in module.parameters()))
    assert offloader.offload("params") == 4 * (32 + 4)
    assert offloader.offload("params") == 0, "offloading an offloaded state copies nothing"
    offloader.reload("params")
    assert offloader.reload("params") == 0
    module.weight.data = torch.zeros(4, 8)  # re-bound: the old storage must no longer be counted
    assert offloader.resident_bytes()["params"] == 4 * (32 + 4)
    with pytest.raises(KeyError, match="unknown offload state 'nope'"):
        offloader.offload("nope")
    with pytest.raises(ValueError, match="registered twice"):
        offloader.register("params", lambda: [])


def test_state_offload_manager_reloads_offloads_and_records_metrics():
    params, moments = [torch.randn(1000)], [torch.randn(500), torch.randn(500)]
    expected = [t.clone() for t in params + moments]
    offloader = Offloader(get_accelerator("cpu"))
    offloader.register("train_params", lambda: params)
    offloader.register("optimizer_states", lambda: moments)
    offloader.offload_all()
    strategy = StateSet(ShardingManager(offloader=offloader, policy=ResidencyPolicy.offloading()),
                        ["train_params", "optimizer_states"])

    metrics: dict[str, float] = {}
    with state_offload_manager(strategy, metrics, "actor_train/train_step"):
        assert offloader.resident_bytes() == {"train_params": 4000, "optimizer_states": 4000}
        assert all(torch.equal(a, b) for a, b in zip(params + moments, expected))
    assert offloader.resident_bytes() == {"train_params": 0, "optimizer_states": 0}
    assert metrics["offload/actor_train/train_step/reload_bytes"] == 8000
    assert metrics["offload/actor_train/train_step/offload_bytes"] == 8000
    for stage in ("onload", "execute", "offload", "total"):
        assert metrics[f"timing/actor_train/train_step/{stage}"] >= 0
    total = metrics["timing/actor_train/train_step/total"]
    parts = sum(metrics[f"timing/actor_train/train_step/{s}"] for s in ("onload", "execute", "offload"))
    assert abs(total - parts) < 1e-3

    # is_offload_states=False: the states stay on the device after the block, and nothing is copied out.
    metrics = {}
    with state_offload_manger(strategy, metrics, "ref", is_offload_states=False):  # ROLL's spelling works too
        pass
    assert offloader.resident_bytes() == {"train_params": 4000, "optimizer_states": 4000}
    assert metrics["offload/ref/offload_bytes"] == 0

    # An exception inside still offloads (the device must not stay full after a failed call).
    with pytest.raises(RuntimeError):
        with state_offload_manager(strategy, {}, "boom"):
            raise RuntimeError("failed step")
    assert offloader.resident_bytes() == {"train_params": 0, "optimizer_states": 0}


def _minor_faults() -> int:
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def _thp_available() -> bool:
    try:
        with open("/sys/kernel/mm/transparent_hugepage/enabled") as f:
            return "[never]" not in f.read()
    except OSError:
        return False


def test_large_storages_come_back_in_huge_pages_and_really_free_their_memory():
    """On CPU a reloaded storage is a fresh 2 MiB-aligned mapping: one page fault per 2 MiB instead
    of one per 4 KiB, and the memory leaves the process (RSS) while offloaded."""
    import psutil

    from mindspeed_rl.accelerator.host_memory import HUGE_PAGE_BYTES, huge_page_storage

    acc = get_accelerator("cpu")
    assert huge_page_storage(100).nbytes() == 100, "small requests use torch's allocator"
    storage = huge_page_storage(3 * HUGE_PAGE_BYTES + 5)
    assert storage.nbytes() == 3 * HUGE_PAGE_BYTES + 5 and storage.data_ptr() % HUGE_PAGE_BYTES == 0

    nbytes = 64 << 20
    big = torch.arange(nbytes // 4, dtype=torch.float32)  # from torch's allocator, 4 KiB-aligned
    view = big[1000:2000].view(10, 100)
    expected = big.clone()
    offloader = Offloader(acc)
    offloader.register("big", lambda: [big, view])
    process = psutil.Process()
    for round_trip in range(3):
        rss_resident = process.memory_info().rss
        assert offloader.offload("big") == nbytes
        assert big.untyped_storage().nbytes() == 0
        freed = rss_resident - process.memory_info().rss
        if round_trip == 0:  # the first offload also fills the new 64 MiB mirror: the two cancel out
            assert abs(freed) < 0.1 * nbytes, f"torch's storage was not freed: RSS grew by {-freed}"
        else:
            assert freed > 0.9 * nbytes, f"round {round_trip}: only {freed} bytes left the process"
        faults = _minor_faults()
        assert offloader.reload("big") == nbytes
        faults = _minor_faults() - faults
        assert big.data_ptr() % HUGE_PAGE_BYTES == 0
        assert torch.equal(big, expected) and torch.equal(view, expected[1000:2000].view(10, 100))
        if _thp_available():  # 4 KiB pages take nbytes / 4096 = 16384 faults, 2 MiB pages 32;
            # the bound leaves room for a few 2 MiB regions the kernel had to fill with small pages.
            assert faults < nbytes // 4096 // 8, f"{faults} page faults to reload 64 MiB"
    view.fill_(-1.0)  # the view still aliases the (re-acquired) storage
    assert torch.equal(big[1000:2000], torch.full((1000,), -1.0))


def test_a_dropped_large_storage_comes_back_as_zeros_without_touching_its_pages():
    """A KV cache is released and rebuilt every iteration and mostly never written: on CPU its fresh
    mapping is zeros as it comes, so the reload faults in no page; reading it shows the zeros."""
    nbytes = 32 << 20
    kv = torch.ones(nbytes // 4)
    offloader = Offloader(get_accelerator("cpu"))
    offloader.register("kv_cache", lambda: [kv], keep_contents=False)
    offloader.offload("kv_cache")
    faults = _minor_faults()
    assert offloader.reload("kv_cache") == 0
    # Writing 32 MiB faults 16 huge pages (8192 small ones); acquiring the mapping faults none.
    assert _minor_faults() - faults < 4, "the reload touched the pages of the storage it acquired"
    assert torch.count_nonzero(kv) == 0


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc_trim")
def test_return_free_heap_gives_freed_chunks_back_to_the_kernel():
    """Freed C-heap chunks below a live one stay in RSS until trimmed (what a long run accumulated)."""
    import ctypes

    import psutil

    from mindspeed_rl.accelerator.host_memory import return_free_heap

    libc = ctypes.CDLL("libc.so.6")
    libc.malloc.restype, libc.free.argtypes = ctypes.c_void_p, [ctypes.c_void_p]
    chunks = [libc.malloc(4096) for _ in range(25_000)]  # 100 MB in 4 KiB chunks, each touched
    for chunk in chunks:
        ctypes.memset(chunk, 1, 4096)
    top = libc.malloc(4096)  # above them: the heap cannot shrink from its end by itself
    for chunk in chunks:
        libc.free(chunk)
    before = psutil.Process().memory_info().rss
    return_free_heap()
    assert before - psutil.Process().memory_info().rss > 80e6
    libc.free(top)
