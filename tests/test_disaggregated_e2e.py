"""End to end through the CLI: configs/grpo_tiny_cpu_disaggregated.yaml, Megatron training on device
slot 0 and vLLM generating on slot 1, 2 GRPO iterations.

Oracles: the inference rank receives exactly the model's parameter bytes at every push (infer TP1
holds every HF tensor once; nothing is local in this mode), counted from the checkpoint file, not
from the plan; every pushed range's fingerprint matches its training shard on the far side (a
mismatch stops the run); and vLLM's sampled-token log-probs equal Megatron's on the same samples
(< 1e-4, fp32), which holds only if the inference weights are the training weights of that step.

Runs where: subprocesses (Ray, 2 workers: one training rank, one inference rank); ~1 min on 2 cores.
"""
import json

import pytest
from safetensors.torch import load_file

from cli_runner import run_cli

ITERATIONS = 2


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    tmp_path = tmp_path_factory.mktemp("disaggregated")
    done = run_cli(tmp_path, "grpo_tiny_cpu_disaggregated", f"megatron_training.train_iters={ITERATIONS}",
                   f"synthetic_data.data_dir={tmp_path / 'assets'}")
    assert done.returncode == 0, done.stderr[-3000:]
    metrics = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    checkpoint = next((tmp_path / "assets").rglob("*.safetensors"))
    return done, metrics, checkpoint


def test_every_iteration_completes(run):
    _, metrics, _ = run
    assert [m["iteration"] for m in metrics] == list(range(1, ITERATIONS + 1))


def test_start_prints_which_role_is_on_which_device(run):
    done, _, _ = run
    assert "[resources] disaggregated: actor_train on device(s) 0, actor_infer on device(s) 1" in done.stdout
    assert "actor_train rank 0" in done.stdout and "actor_infer rank 0" in done.stdout


def test_each_push_moves_exactly_the_model_bytes(run):
    _, metrics, checkpoint = run
    model_bytes = sum(t.numel() * 4 for t in load_file(str(checkpoint)).values())  # fp32 on the wire
    for m in metrics:
        assert m["resharding/bytes_received_all_ranks"] == model_bytes
        assert m["resharding/planned_bytes_received_all_ranks"] == model_bytes
        assert m["resharding/bytes_sent_all_ranks"] == model_bytes


def test_every_pushed_range_is_verified_on_the_inference_rank(run):
    _, metrics, _ = run
    assert all(m["resharding/ranges_verified"] > 0 for m in metrics)


def test_vllm_logprobs_equal_megatron_after_each_push(run):
    _, metrics, _ = run
    assert all(m["rollout/logprob_max_abs_diff"] < 1e-4 for m in metrics)
    assert metrics[-1]["actor/kl_loss"] > 0  # the policy moved: the second push carried new weights
