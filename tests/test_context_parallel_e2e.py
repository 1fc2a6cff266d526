"""Context parallelism end to end: `python cli/train_grpo.py --config-name grpo_tiny_cpu_cp2` (Megatron CP2 on 2 ranks,
each sequence in 4 chunks, 2 per rank -> vLLM TP2) trains 2 iterations on packed token-budget micro-batches (as
MindSpeed-RL's CP recipes: use_remove_padding, use_dynamic_bsz). vLLM's log-probs equal Megatron's
context-parallel forward, every ledger category is the planner's (the activations within 10%: the planner's packed
micro-batch is the token budget, a rank's half of it) and each rank cuts its own full weights into its vLLM half
(nothing crosses ranks). (A CP2 checkpoint loading without CP: test_context_parallel_multiprocess.)

Runs where: a CLI subprocess (Ray, 2 ranks); ~40 s on 2 cores.
"""
import json

from cli_runner import run_cli
from planner_checks import assert_prediction_matches_ledger


def _records(run_dir):
    return [r for r in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines()) if "reward/mean" in r]


def test_cp2_trains_on_packed_batches_matching_vllm_and_the_plan(tmp_path):
    done = run_cli(tmp_path, "grpo_tiny_cpu_cp2", "megatron_training.train_iters=2",
                   "rl_config.use_remove_padding=true", "rl_config.use_dynamic_bsz=true",
                   "rl_config.max_packing_token_size=64")
    assert done.returncode == 0, done.stderr[-3000:]
    records = _records(tmp_path / "run")
    assert len(records) == 2
    for record in records:
        assert record["rollout/logprob_max_abs_diff"] < 1e-4
        assert record["resharding/bytes_received"] == 0 and record["resharding/bytes_local"] > 0
        assert_prediction_matches_ledger(record, activations_tolerance=0.10)
