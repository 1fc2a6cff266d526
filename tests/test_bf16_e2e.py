"""bf16 end to end: `python cli/train_grpo.py --config-name grpo_tiny_cpu_bf16_tp2pp2` (Megatron bf16
TP2 x PP2 -> vLLM bfloat16 TP1 x DP4, the 7B recipe's layout, 4 ranks on gloo) runs a GRPO
iteration (one: bf16 has no fast path on this CPU, and the suite has a time budget); the switch moves bytes,
checks every range's fingerprint, and vLLM's sampled-token log-probs stay within the bf16 gap that
docs/bf16_logprobs.md measures; the update's bytes are the planner's. verl's rollout correction is on (token-level
truncated IS with the token veto): its weights are pi_old / pi_rollout of that bf16 gap, within a few percent of 1.

Runs where: a subprocess (Ray starts 4 worker processes); minutes on 2 cores (bf16 has no AMX here).
"""
import json
import math

import torch
from cli_runner import run_cli
from planner_checks import assert_prediction_matches_ledger
from resharding_oracle import LOGPROB_TOLERANCE


def test_bf16_tp2pp2_to_infer_dp4_runs(tmp_path):
    done = run_cli(tmp_path, "grpo_tiny_cpu_bf16_tp2pp2", "megatron_training.train_iters=1",
                   "rl_config.rollout_correction.preset=decoupled_token_is",
                   "rl_config.rollout_correction.rollout_token_veto_threshold=1e-4", timeout=1200)
    assert done.returncode == 0, done.stderr[-3000:]
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["iteration"] for r in records] == [1]
    for r in records:
        # Infer DP4 from two stages of two TP halves: every rank receives three quarters of the model
        # (it holds one quarter: half of its own stage's layers), in bf16 (2 bytes per element),
        # and copies one quarter locally.
        assert r["resharding/bytes_received"] > 0
        assert abs(r["resharding/bytes_received"] - 3 * r["resharding/bytes_local"]) / r["resharding/bytes_received"] < 0.1
        assert r["resharding/ranges_verified"] > 0
        assert 0.0 < r["rollout/logprob_max_abs_diff"] < LOGPROB_TOLERANCE[torch.bfloat16]
        assert r["actor/old_logprobs_from_update"] == 0.0  # the correction needs the old policy's own pass
        gap = r["rollout/logprob_max_abs_diff"]
        # Each weight is exp(old - rollout) of one token: inside [exp(-gap), exp(gap)] by the gap's own definition.
        assert math.exp(-gap) - 1e-6 <= r["rollout_corr/rollout_is_min"] <= r["rollout_corr/rollout_is_mean"]
        assert r["rollout_corr/rollout_is_mean"] <= r["rollout_corr/rollout_is_max"] <= math.exp(gap) + 1e-6
        assert r["rollout_corr/rollout_is_veto_fraction"] == 0.0 and 0.0 <= r["rollout_corr/k3_kl"] < gap
        # bf16 TP2 x PP2: bf16 params (norms too), fp32 grads and masters, two micro-batches in flight on stage 0.
        assert_prediction_matches_ledger(r)
