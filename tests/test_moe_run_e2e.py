"""End to end: the CLI trains a tiny Qwen3-MoE checkpoint (router + 4 experts, q/k norms) for 2 GRPO
iterations on 1 rank; vLLM's log-probs follow Megatron's after every switch and the planner's predicted
bytes per phase equal the ledger's (states within 10%, activations within 30%).

Runs where: a CLI subprocess (Ray, 1 worker); ~40 s on 2 cores.
"""
import json

from cli_runner import run_cli
from planner_checks import assert_prediction_matches_ledger


def test_a_moe_checkpoint_trains_and_its_memory_is_predicted(tmp_path):
    from mindspeed_rl.data.arith_task import make_arith_prompts, write_prompts_jsonl
    from mindspeed_rl.data.tiny_moe import create_tiny_qwen3_moe_checkpoint

    model_dir = create_tiny_qwen3_moe_checkpoint(tmp_path / "moe", vocab_size=16, seed=1)
    write_prompts_jsonl(tmp_path / "prompts.jsonl", make_arith_prompts(64, 4, 1))
    # The demo's model block describes the dense tiny model: the run says so and builds the checkpoint's.
    done = run_cli(tmp_path, "grpo_tiny_cpu", "megatron_training.train_iters=2", "synthetic_data.enabled=false",
                   f"megatron_training.tokenizer_name_or_path={model_dir}",
                   f"megatron_training.data_path={tmp_path / 'prompts.jsonl'}")
    assert done.returncode == 0, done.stderr[-3000:]
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["iteration"] for r in records] == [1, 2]
    for record in records:
        assert record["rollout/logprob_max_abs_diff"] < 1e-4
        assert_prediction_matches_ledger(record)
