"""The memory ledger's pieces on plain tensors: records and their metric names, the activation
meter against hand-counted saved tensors, the timeline built from metrics records, and
`log_gpu_memory_usage`.

Runs where: in the pytest process, CPU; < 3 s.
"""
import logging
import struct

import torch

from mindspeed_rl.accelerator import get_accelerator
from mindspeed_rl.memory import ActivationMeter, MemoryLedger, Offloader, log_gpu_memory_usage
from mindspeed_rl.memory.context_managers import clear_memory_sources, register_memory_source
from mindspeed_rl.memory.timeline import build_timeline, main as timeline_main, plot_memory_timeline


def test_ledger_records_what_the_offloader_holds():
    params, grads = [torch.zeros(256)], [torch.zeros(64)]
    offloader = Offloader(get_accelerator("cpu"))
    offloader.register("train_params", lambda: params)
    offloader.register("train_grads", lambda: grads, keep_contents=False)
    ledger = MemoryLedger(offloader.resident_bytes, get_accelerator("cpu"))
    ledger.record("update", extra={"activations": 100})
    offloader.offload("train_grads")
    record = ledger.record("after_update")
    assert ledger.latest("update").bytes_by_category == {"train_params": 1024, "train_grads": 256, "activations": 100}
    assert record.metrics() == {
        "memory/after_update/train_params_bytes": 1024.0,
        "memory/after_update/train_grads_bytes": 0.0,
        "memory/after_update/total_bytes": 1024.0,
    }, "no allocator on CPU: no allocator_bytes / unaccounted_bytes keys"


def test_the_ledger_counts_the_host_mirrors_and_the_host_only_states():
    params, grads, host_copy = [torch.zeros(256)], [torch.zeros(64)], [torch.zeros(32, dtype=torch.float64)]
    offloader = Offloader(get_accelerator("cpu"))
    offloader.register("train_params", lambda: params)
    offloader.register("train_grads", lambda: grads, keep_contents=False)
    offloader.register_host("inference_weights_host", lambda: host_copy)
    ledger = MemoryLedger(offloader.resident_bytes, get_accelerator("cpu"), read_host_states=offloader.host_bytes)
    assert ledger.record("initialize").host_bytes_by_category == {
        "train_params": 0, "train_grads": 0, "inference_weights_host": 256}, "no mirror before the first offload"
    offloader.offload_all()
    offloader.reload_all()  # the mirror stays for the next offload; dropped grads never had one
    assert ledger.record("update").metrics() == {
        "memory/update/train_params_bytes": 1024.0, "memory/update/train_grads_bytes": 256.0,
        "memory/update/total_bytes": 1280.0,
        "memory/update/host/train_params_bytes": 1024.0, "memory/update/host/train_grads_bytes": 0.0,
        "memory/update/host/inference_weights_host_bytes": 256.0, "memory/update/host/total_bytes": 1280.0,
    }


def test_the_ledger_keeps_the_latest_record_of_each_phase_however_long_the_run():
    ledger = MemoryLedger(lambda: {"train_params": 1}, get_accelerator("cpu"))
    for iteration in range(1000):
        ledger.record("update", extra={"activations": iteration})
        ledger.record("after_update")
    assert len(ledger.records) == 2
    assert ledger.latest("update").bytes_by_category["activations"] == 999


def test_activation_meter_counts_saved_tensors_once_and_not_parameters():
    weight = torch.nn.Parameter(torch.randn(1000))
    x = torch.randn(1000)
    meter = ActivationMeter(exclude_storage_keys={weight.untyped_storage()._cdata})
    with meter:
        for _ in range(3):  # sequential micro-batches: the peak is one graph's, not the sum
            scaled = x * weight          # saves x (for dweight) and weight (excluded: a parameter)
            out = torch.exp(scaled)      # saves its result
            halves = out[:500] * out[500:]  # saves two views of `out`'s storage: counted once
            halves.sum().backward()
            assert meter._live_bytes == 0, "the graph is gone after backward"
    assert meter.peak_bytes == x.nbytes + out.nbytes
    with torch.no_grad(), ActivationMeter(set()) as idle:
        torch.exp(x * weight)
    assert idle.peak_bytes == 0, "forward-only work saves nothing"


def _record(iteration: int, scale: int) -> dict:
    record = {"iteration": iteration, "reward/mean": 0.5}
    for i, phase in enumerate(("generate", "ref_logprob", "old_logprob", "update")):
        record[f"memory/{phase}/train_params_bytes"] = scale * (i >= 2)
        record[f"memory/{phase}/kv_cache_bytes"] = 3 * scale * (i == 0)
        record[f"memory/{phase}/reference_params_bytes"] = scale * (i == 1)
        record[f"memory/{phase}/total_bytes"] = 0  # marks the phase as recorded
    return record


def test_timeline_takes_the_last_iterations_phase_by_phase(tmp_path):
    records = [_record(i, 2**20 * i) for i in range(1, 6)]
    timeline = build_timeline(records, last_iterations=2)
    assert timeline.labels == [f"it {i}\n{p}" for i in (4, 5) for p in ("generate", "ref_logprob", "old_logprob", "update")]
    assert set(timeline.bytes_by_category) == {"train_params", "kv_cache", "reference_params"}, "empty categories are left out"
    mib = 2**20
    assert timeline.bytes_by_category["kv_cache"] == [12 * mib, 0, 0, 0, 15 * mib, 0, 0, 0]
    assert timeline.totals() == [12 * mib, 4 * mib, 4 * mib, 4 * mib, 15 * mib, 5 * mib, 5 * mib, 5 * mib]

    out = tmp_path / "memory_timeline.png"
    plot_memory_timeline(records, out, last_iterations=2)
    header = out.read_bytes()[:24]
    assert header[:8] == b"\x89PNG\r\n\x1a\n"
    width, height = struct.unpack(">II", header[16:24])
    assert width >= 800 and height >= 500


def test_timeline_cli_rejects_bad_input(tmp_path, capsys):
    try:
        timeline_main([str(tmp_path / "missing.jsonl")])
    except SystemExit as exit_request:
        assert exit_request.code == 2
    assert "metrics:" in capsys.readouterr().err


def test_log_gpu_memory_usage_reports_the_ledger(caplog):
    clear_memory_sources()
    register_memory_source(lambda: {"train_params": 3 * 2**20, "kv_cache": 2**20}, get_accelerator("cpu"))
    try:
        with caplog.at_level(logging.INFO):
            message = log_gpu_memory_usage(head="model_loading", logger=logging.getLogger("t"), rank=None)
        assert message.startswith("model_loading | train_params 3.0 MiB, kv_cache 1.0 MiB | ledger total 4.0 MiB")
        assert "host rss" in message and message in caplog.text
    finally:
        clear_memory_sources()


def test_ledger_cross_checks_the_device_allocator(caplog):
    """On CUDA/NPU every record carries the allocator's own count. This machine has neither, so the
    accelerator below is the CPU one with a stand-in allocator count; the ledger logic is the real one."""
    import dataclasses

    from mindspeed_rl.accelerator import Accelerator

    @dataclasses.dataclass(frozen=True)
    class CountingAccelerator(Accelerator):
        allocated: int = 0

        def memory_allocated_bytes(self) -> int:
            return self.allocated

    params = [torch.zeros(256)]
    offloader = Offloader(get_accelerator("cpu"))
    offloader.register("train_params", lambda: params)
    honest = MemoryLedger(offloader.resident_bytes, CountingAccelerator(name="cpu", allocated=1024 + 300))
    metrics = honest.record("update").metrics()
    assert metrics["memory/update/allocator_bytes"] == 1324.0
    assert metrics["memory/update/unaccounted_bytes"] == 300.0  # e.g. workspace no category owns

    with caplog.at_level(logging.WARNING, logger="mindspeed_rl.memory.ledger"):
        MemoryLedger(offloader.resident_bytes, CountingAccelerator(name="cpu", allocated=512)).record("update")
    assert "counts 1024 bytes but the allocator holds 512" in caplog.text
