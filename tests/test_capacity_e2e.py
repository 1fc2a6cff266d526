"""The planner's verdicts tested against a device that size (issue 39 item 5): `runtime.device_memory_limit` makes the
CPU engine refuse device memory past the capacity (memory/capacity.py), and 16 tiny layouts sampled from the knobs
users turn (world size 1-2, TP/PP/DP, inference TP, the three offload flags, the swap optimizer, micro-batch size,
packing, KV cache size) each run one iteration of the demo under a capacity chosen from its own plan:

- half the layouts get a capacity 15% above the plan's peak: the plan says FITS (the launch line too), and the run
  must finish its 2 iterations (exit 0) with every recorded phase's ledger total within the capacity and within 10%
  of the plan's total for that phase in iteration 2 (the plan at the iteration's batch width, as logged beside the
  ledger);
- the others get a capacity that the plan says a phase passes by >= 10% while every phase entered before it stays
  >= 10% below (the phase cycling through idle, the switch, generate, the reference pass and the update; the first
  iteration's phases before its update hold no Adam moments yet - torch makes them at the first step - and the plan
  says so): the launch line names that phase, and the run must fail (exit 1) with the one line `out of device memory
  in <that phase>: ...`, no traceback.

Prompts are of one length and `rl_config.max_prompt_length` is that length, so the launch plan's sequence length is
the batch's (the planner plans the longest sample a config allows).

Runs where: subprocesses through the CLI (1-2 rank processes, Ray for two), ~6 min on 2 cores: `make
test-capacity` (.ci/run runs it).
"""
from __future__ import annotations

import json
import random
from dataclasses import dataclass
from pathlib import Path

import pytest

from run_watch import launch

pytestmark = pytest.mark.capacity

REPO = Path(__file__).resolve().parents[1]
CONFIG = "grpo_tiny_cpu"
# 16: every two-rank layout of TWO_RANK_LAYOUTS (one in four) and every TARGETS phase (the odd half) drawn once
LAYOUTS = 16
MARGIN = 1.10  # the plan's distance from the capacity on each side of a verdict
FIT_HEADROOM = 1.15
BASE = ("megatron_training.train_iters=2", "megatron_training.global_batch_size=4", "rl_config.mini_batch_size=4",
        "rl_config.n_samples_per_prompt=8", "rl_config.max_prompt_length=4", "runtime.progress_seconds=0")
TWO_RANK_LAYOUTS = (  # (train TP, PP, DP by world size 2, inference TP, distributed optimizer)
    ("actor_config.tensor_model_parallel_size=2", "generate_config.infer_tensor_parallel_size=2"),
    ("actor_config.tensor_model_parallel_size=2", "generate_config.infer_tensor_parallel_size=1"),
    ("actor_config.pipeline_model_parallel_size=2", "generate_config.infer_tensor_parallel_size=2"),
    ("generate_config.infer_tensor_parallel_size=1", "megatron_training.use_distributed_optimizer=true"),
)
TARGETS = ("update", "generate", "switch", "idle", "ref_logprob")


@dataclass(frozen=True)
class Layout:
    overrides: tuple[str, ...]
    ranks: int


def sampled_layouts(count: int, seed: int = 39) -> list[Layout]:
    """`count` layouts drawn from the knobs (a fixed seed: the same list every run)."""
    rng = random.Random(seed)
    layouts = []
    for index in range(count):
        ranks = 2 if index % 4 == 3 else 1
        swap = rng.random() < 0.3
        offload = {key: rng.random() < 0.6 for key in ("param", "grad", "optimizer")}
        if swap:
            offload["optimizer"] = False  # as their swap recipes set it
        overrides = [f"generate_config.offload_train_{key}={str(value).lower()}" for key, value in offload.items()]
        overrides += [f"megatron_training.swap_optimizer={str(swap).lower()}", "megatron_training.swap_optimizer_times=4",
                      f"actor_config.micro_batch_size={rng.choice((2, 8, 32))}",
                      f"rl_config.use_remove_padding={str(rng.random() < 0.3).lower()}",
                      f"generate_config.cpu_kvcache_space_gb={rng.choice((0.002, 0.004, 0.008))}"]
        if ranks == 2:
            overrides += ["rl_config.actor_resource.num_npus=2", *TWO_RANK_LAYOUTS[(index // 4) % len(TWO_RANK_LAYOUTS)]]
        layouts.append(Layout(tuple(overrides), ranks))
    return layouts


def _plan(overrides: tuple[str, ...]):
    from hydra import compose, initialize_config_dir

    from mindspeed_rl.config import load_config
    from mindspeed_rl.planner.from_config import architecture, plan_config, resolve_hf_config

    with initialize_config_dir(config_dir=str(REPO / "configs"), version_base="1.3"):
        config = load_config(compose(config_name=CONFIG, overrides=list(overrides)))
    return plan_config(config, architecture(resolve_hf_config(config)), with_switch=False, device="cpu")[0]


def run_order(plan) -> list[tuple[str, int]]:
    """(phase, the plan's largest rank's bytes) in the order a run enters them: the first iteration (no Adam moments
    before its update), then the steady state of every later one."""
    return [(phase, total) for totals in (plan.first_iteration_totals(), plan.totals())
            for phase, (_, total) in totals.items()]


def capacity_for(entered: list[tuple[str, int]], index: int) -> tuple[int, str | None]:
    """(capacity bytes, the phase the plan says runs out first, None: fits) for layout `index`: even ones fit with
    headroom; odd ones run out at a target phase that passes the capacity by MARGIN while every phase entered before
    it stays MARGIN below (the first target, from index // 2 on, that has such a gap)."""
    if index % 2 == 0:
        return int(max(total for _, total in entered) * FIT_HEADROOM), None
    for shift in range(len(TARGETS)):
        target = TARGETS[(index // 2 + shift) % len(TARGETS)]
        for position, (phase, total) in enumerate(entered):
            if phase != target:
                continue
            high = total / MARGIN
            # the first phase (idle) has nothing before it: half its bytes
            low = max(max((t for _, t in entered[:position]), default=0) * MARGIN, high / 2)
            if low < high:
                return int((low * high) ** 0.5), target
    raise AssertionError(f"no phase of {entered} stands {MARGIN}x above every phase entered before it")


LAYOUT_LIST = sampled_layouts(LAYOUTS)


def test_the_sample_covers_both_verdicts_and_both_world_sizes():
    assert len(LAYOUT_LIST) >= 16
    assert {layout.ranks for layout in LAYOUT_LIST} == {1, 2}
    assert len({layout.overrides for layout in LAYOUT_LIST}) == len(LAYOUT_LIST)


@pytest.mark.parametrize("index", range(LAYOUTS))
def test_the_plans_verdict_holds_on_a_device_that_size(tmp_path, index):
    layout = LAYOUT_LIST[index]
    overrides = (*BASE, *layout.overrides)
    plan = _plan(overrides)
    entered = run_order(plan)
    capacity, runs_out_in = capacity_for(entered, index)
    assert (plan.first_over(capacity) or (None,))[0] == runs_out_in
    run = launch(tmp_path, CONFIG, *overrides, f"runtime.device_memory_limit={capacity}", shared_ray=True)
    code, _ = run.finish(timeout=240)
    stderr = run.stderr_text()
    verdict = "fits" if runs_out_in is None else f"does not fit: {runs_out_in} needs"
    assert any(line.startswith("[plan] runtime.device_memory_limit") and f": {verdict}" in line
               for line in run.stdout_text().splitlines()), run.stdout_text()[-2000:]
    if runs_out_in is None:
        assert code == 0, stderr[-3000:]
        _assert_the_ledger_matches_the_plan(tmp_path / "run" / "metrics.jsonl", capacity)
    else:
        assert code == 1, run.stdout_text()[-3000:] + stderr[-3000:]
        lines = [line for line in stderr.splitlines() if line.startswith("out of device memory in ")]
        assert lines and lines[0].startswith(f"out of device memory in {runs_out_in}: "), (runs_out_in, entered,
                                                                                          stderr[-2000:])
        assert "Traceback" not in stderr


def _assert_the_ledger_matches_the_plan(metrics_file: Path, capacity: int) -> None:
    """Iteration 2's record: every phase in its steady state, which the plan describes."""
    record = json.loads(metrics_file.read_text().splitlines()[-1])
    assert record["iteration"] == 2
    phases = [key.split("/")[1] for key in record if key.startswith("memory/") and key.endswith("/predicted_bytes")
              and key.count("/") == 2]
    assert phases
    for phase in phases:
        measured, predicted = record[f"memory/{phase}/total_bytes"], record[f"memory/{phase}/predicted_bytes"]
        assert measured <= capacity, (phase, measured, capacity)
        assert abs(predicted - measured) <= 0.10 * measured, (phase, predicted, measured)
