"""End to end through the CLI: the disaggregated demo with `async_generation_ratio=1` (one-step
off-policy), 3 GRPO iterations: the rollout of iteration k+1 runs on the inference slot while iteration
k updates on the training slot.

Oracles: iteration 1 is generated synchronously, so vLLM's log-probs equal Megatron's (< 1e-4); the
rollouts of iterations 2 and 3 come from the weights one update older than the ones they train, so
they differ from Megatron's by far more than the engines' arithmetic (> 1e-3), and `rollout/staleness`
says 1. Weights travel only when they changed: θ0 before iteration 1, none before rollout 2 (it
samples θ0 again), θ1 before rollout 3 (reported in iteration 3); each push moves exactly the
checkpoint's fp32 bytes and every range is fingerprint-verified on the inference rank. The mismatch ledger is on:
a stale rollout is re-scored by vLLM once the weights that train it are pushed, so its gap lands in staleness.

Runs where: subprocesses (Ray, 2 workers: one training rank, one inference rank); ~40 s on 2 cores.
"""
import json

import pytest
from safetensors.torch import load_file

from cli_runner import run_cli

ITERATIONS = 3


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    tmp_path = tmp_path_factory.mktemp("disaggregated_async")
    done = run_cli(tmp_path, "grpo_tiny_cpu_disaggregated", f"megatron_training.train_iters={ITERATIONS}",
                   "async_generation_ratio=1", f"synthetic_data.data_dir={tmp_path / 'assets'}",
                   "rl_config.mismatch_ledger=true")
    assert done.returncode == 0, done.stderr[-3000:]
    metrics = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    checkpoint = next((tmp_path / "assets").rglob("*.safetensors"))
    return metrics, checkpoint


def test_rollouts_after_the_first_are_one_update_stale(run):
    metrics, _ = run
    assert [m["iteration"] for m in metrics] == [1, 2, 3]
    assert [m["rollout/staleness"] for m in metrics] == [0, 1, 1]


def test_the_synchronous_first_rollout_matches_megatron(run):
    metrics, _ = run
    assert metrics[0]["rollout/logprob_max_abs_diff"] < 1e-4


def test_stale_rollouts_differ_from_the_trained_weights(run):
    metrics, _ = run
    assert all(m["rollout/logprob_max_abs_diff"] > 1e-3 for m in metrics[1:])


def test_weights_travel_only_when_they_changed_and_exactly_once(run):
    metrics, checkpoint = run
    model_bytes = sum(t.numel() * 4 for t in load_file(str(checkpoint)).values())  # fp32 on the wire
    assert [m.get("resharding/bytes_received_all_ranks") for m in metrics] == [model_bytes, None, model_bytes]
    assert [m.get("resharding/planned_bytes_received_all_ranks") for m in metrics] == [model_bytes, None, model_bytes]
    assert metrics[0]["resharding/ranges_verified"] > 0 and metrics[2]["resharding/ranges_verified"] > 0


def test_the_ledger_puts_a_stale_rollouts_gap_in_staleness(run):
    """Re-scored under the weights that train it (pushed for the next rollout, or for the re-score after the last),
    the stale rollout's gap is staleness; the rest, the engines' fp32 numerics, is ~1e-7 (triangle inequality: the
    end-to-end gap is within numerics of staleness)."""
    metrics, _ = run
    assert metrics[0]["mismatch/staleness"] == 0.0
    for record in metrics[1:]:
        assert record["mismatch/staleness"] > 1e-3 and record["mismatch/numerics"] < 1e-5
        assert abs(record["mismatch/staleness"] - record["rollout/logprob_mean_abs_diff"]) <= (
            record["mismatch/numerics"] + 1e-6)
        assert record["mismatch/total"] == pytest.approx(record["mismatch/staleness"] + record["mismatch/numerics"])
