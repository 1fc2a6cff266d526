"""`cli/plan.py --search` (mindspeed_rl/planner/search.py): the layouts that fit with a 10% margin, fastest first by
the time model, and the `overrides:` line of the best, which planned again fits; none fitting names the three largest
consumers; the time model's parts scale with the rates they divide by.

Runs where: short `python cli/plan.py` subprocesses and in-process plans (no Ray, no vLLM, no model); ~10 s.
"""
import subprocess
import sys
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir

from mindspeed_rl.config import load_config
from mindspeed_rl.planner.from_config import architecture, plan_config, resolve_hf_config
from mindspeed_rl.planner.search import (Rates, forward_flops_per_token, forward_link_bytes, measure_peaks,
                                         predicted_seconds, search)

REPO = Path(__file__).resolve().parents[1]
RATES = Rates(matmul_flops_per_s=200e9, memory_bytes_per_s=40e9)
GIB = 1 << 30


def _plan_cli(*args: str) -> str:
    done = subprocess.run([sys.executable, "cli/plan.py", "--config-name", "grpo_qwen25_7b_A3", *args], cwd=REPO,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    return done.stdout


@pytest.fixture(scope="module")
def recipe():
    with initialize_config_dir(config_dir=str(REPO / "configs"), version_base="1.3"):
        cfg = compose(config_name="grpo_qwen25_7b_A3")
    config = load_config(cfg)
    return cfg, config, architecture(resolve_hf_config(config))


def test_the_best_overrides_at_32_gib_plan_as_fits_with_the_margin():
    searched = _plan_cli("--device-memory", "32GiB", "--search")
    assert "device memory 32.00 GiB: DOES NOT FIT" in searched  # the recipe as it is
    overrides = next(line for line in searched.splitlines() if line.startswith("overrides: "))[len("overrides: "):]
    planned = _plan_cli("--device-memory", "32GiB", *overrides.split())
    peak = next(line for line in planned.splitlines() if line.startswith("peak: "))
    assert "device memory 32.00 GiB: FITS" in planned
    assert int(peak.rsplit("(", 1)[1].split()[0]) <= 0.9 * 32 * GIB


def test_every_candidate_fits_with_the_margin_and_they_come_fastest_first(recipe):
    cfg, _, arch = recipe
    found = search(cfg, arch, device_memory=32 * GIB, rates=RATES)
    assert len(found) > 5
    assert all(c.peak_bytes <= 0.9 * 32 * GIB for c in found)
    totals = [c.total_seconds for c in found]
    assert totals == sorted(totals)


def test_nothing_fitting_names_the_three_largest_consumers():
    searched = _plan_cli("--device-memory", "4GiB", "--search")
    assert ("no layout fits with that margin; the largest consumers at this config's peak: activations 33.91 GiB, "
            "train_grads 7.09 GiB, optimizer_states 5.32 GiB") in searched
    assert "overrides:" not in searched


def test_the_time_model_divides_each_part_by_its_rate(recipe):
    _, config, arch = recipe
    plan, _ = plan_config(config, arch, device_memory=64 * GIB, with_switch=False)
    base = predicted_seconds(config, arch, plan, RATES)
    faster = predicted_seconds(config, arch, plan, Rates(matmul_flops_per_s=400e9, memory_bytes_per_s=40e9,
                                                         link_bytes_per_s=100e9, h2d_bytes_per_s=50e9))
    for phase in ("update", "log-probs", "switch", "offload"):
        assert faster[phase] == pytest.approx(base[phase] / 2, rel=1e-9), phase
    # 2 FLOPs per active parameter and token, plus the attention's, which grows with the sequence
    assert forward_flops_per_token(arch, 0) == 2 * arch.active_parameter_count()
    assert forward_flops_per_token(arch, 4096) > forward_flops_per_token(arch, 0)


def test_the_peaks_are_measured_here():
    peaks = measure_peaks(seconds=0.1, matmul_n=256, copy_bytes=16 << 20)
    assert peaks["matmul_flops_per_s"] > 1e8 and peaks["copy_bytes_per_s"] > 1e8


def test_a_device_s_rates_replace_the_measured_ones():
    searched = _plan_cli("--device-memory", "32GiB", "--search", "--matmul-tflops", "300", "--memory-gbps", "1600")
    assert "time model at 300000 GFLOP/s and 1600 GB/s" in searched
    done = subprocess.run([sys.executable, "cli/plan.py", "--config-name", "grpo_qwen25_7b_A3", "--device-memory",
                           "32GiB", "--search", "--matmul-tflops", "300"], cwd=REPO, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 2
    assert done.stderr.strip() == ("config error: --matmul-tflops: give it with --memory-gbps (a device's two rates), "
                                   "or neither")


def test_the_link_carries_each_parallelism_s_traffic(recipe):
    """TP2 all-reduces 2 x (1/2) of the activations twice per layer; CP2 passes its keys and values once per layer;
    PP2 sends the activations once; none of it at TP1 x PP1 x CP1."""
    from dataclasses import replace as with_

    from mindspeed_rl.planner.inputs import PlanInputs

    _, _, arch = recipe
    base = PlanInputs(arch=arch, world_size=8)
    tokens, h, layers = 1000.0, arch.hidden_size, arch.num_layers
    assert forward_link_bytes(arch, base, tokens_per_rank=tokens) == 0
    assert forward_link_bytes(arch, with_(base, tp=2), tokens_per_rank=tokens) == 2 * 2 * 0.5 * tokens * h * 2 * layers
    assert forward_link_bytes(arch, with_(base, cp=2), tokens_per_rank=tokens) == 2 * arch.kv_width * tokens * 2 * layers
    assert forward_link_bytes(arch, with_(base, pp=2), tokens_per_rank=tokens) == tokens * h * 2
