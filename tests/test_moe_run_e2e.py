"""End to end: the CLI trains a tiny Qwen3-MoE checkpoint (router + 8 experts, q/k norms) for 2 GRPO iterations on 2
ranks in bf16 with routing replay; vLLM's log-probs follow Megatron's after every switch (the routes replayed) and the
planner's predicted bytes per phase equal the ledger's (states within 10%, activations within 30%).

Runs where: a CLI subprocess (Ray, 2 workers); ~38 s on 2 cores.
"""
import json

from cli_runner import run_cli
from planner_checks import assert_prediction_matches_ledger


def test_routing_replay_runs_the_rollouts_experts_across_layouts(tmp_path):
    """bf16, where vLLM's and Megatron's routers disagree on near-ties; training TP2 with sequence parallelism and
    packed micro-batches, inference DP2 (vLLM all-gathers the DP ranks' tokens for its MoE layers; its capture keeps
    this rank's). Every record: no (token, layer) ran other experts than the rollout's while the routers alone would
    have chosen others for some, and the mismatch ledger has no routing share."""
    from mindspeed_rl.data.arith_task import make_arith_prompts, write_prompts_jsonl
    from mindspeed_rl.data.tiny_moe import create_tiny_qwen3_moe_checkpoint

    model_dir = create_tiny_qwen3_moe_checkpoint(tmp_path / "moe", vocab_size=16, seed=1, num_experts=8)
    write_prompts_jsonl(tmp_path / "prompts.jsonl", make_arith_prompts(64, 4, 1))
    done = run_cli(tmp_path, "grpo_tiny_cpu_tp2_infer_dp2", "megatron_training.train_iters=2",
                   "synthetic_data.enabled=false", f"megatron_training.tokenizer_name_or_path={model_dir}",
                   f"megatron_training.data_path={tmp_path / 'prompts.jsonl'}", "rl_config.use_remove_padding=true",
                   "megatron_training.bf16=true", "generate_config.dtype=bfloat16",
                   "rl_config.routing_replay=true", "rl_config.mismatch_ledger=true")
    assert done.returncode == 0, done.stderr[-3000:]
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["iteration"] for r in records] == [1, 2]
    assert sum(r["mismatch/router_disagreement"] for r in records) > 0
    for record in records:
        assert record["mismatch/routing_flips"] == 0.0 and record["mismatch/routing"] == 0.0
        assert record["rollout/logprob_max_abs_diff"] < 0.1  # bf16; without replay a flipped token reaches 0.3
        assert_prediction_matches_ledger(record)
