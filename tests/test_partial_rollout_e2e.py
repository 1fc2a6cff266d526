"""Partial rollout through the CLI (issue 53's command, shrunk): the GRPO demo with
`rl_config.partial_rollout_max_split=4` (max_tokens 4: one-token cuts) cuts samples, resumes them first in the next
iteration, keeps every trained token within N - 1 = 3 policy versions, and a run resumed from its iteration-2
checkpoint (carried samples and sampler restored) writes the records of the uninterrupted run; the mismatch ledger
splits the older tokens' staleness by age. Split 1 (off):
tests/test_train_grpo_e2e.py::test_two_iterations_write_metrics asserts token age 0 in every record.

Run-ahead (`rl_config.async_engine=true`): the DAPO demo on 2 ranks (vLLM DP2) stops each generate at a full batch,
resumes the aborted samples, keeps the bound, and resumes from its checkpoint into the same records.

Runs where: two CLI runs of the one-rank demo in a subprocess (no Ray), about a minute; two 2-rank runs (Ray).
"""
import json

import pytest

from cli_runner import run_cli

VOLATILE_PREFIXES = ("timing/", "memory/", "offload/")
VOLATILE_SUFFIXES = ("_tps", "seconds")
PARTIAL = ("rl_config.partial_rollout_max_split=4", "megatron_training.global_batch_size=8",
           "rl_config.mini_batch_size=8", "rl_config.n_samples_per_prompt=8", "megatron_training.train_iters=4",
           "megatron_training.save_interval=2", "rl_config.mismatch_ledger=true")


def _records(path, *, stable=False) -> list[dict]:
    records = [json.loads(line) for line in path.read_text().splitlines()]
    if stable:  # wall-clock and memory figures differ between any two runs
        records = [{k: v for k, v in r.items() if not k.startswith(VOLATILE_PREFIXES)
                    and not k.endswith(VOLATILE_SUFFIXES)} for r in records]
    return records


@pytest.fixture(scope="module")
def partial_run(tmp_path_factory):
    root = tmp_path_factory.mktemp("partial")
    done = run_cli(root, "grpo_tiny_cpu", *PARTIAL, f"actor_config.save={root / 'save'}",
                   f"synthetic_data.data_dir={root / 'assets'}")
    assert done.returncode == 0, done.stderr[-3000:]
    return root


def test_cut_samples_resume_first_and_no_trained_token_is_older_than_n_minus_1(partial_run):
    records = _records(partial_run / "run" / "metrics.jsonl")
    assert [r["iteration"] for r in records] == [1, 2, 3, 4]
    assert any(r["rollout/resumed_samples"] > 0 for r in records)
    assert all(r["rollout/token_age_max"] <= 3 for r in records)
    # tokens sampled by older weights are off-policy: the old-log-prob pass ran for every batch holding one
    for r in records:
        assert r["actor/old_logprobs_from_update"] == float(r["rollout/token_age_max"] == 0)
    assert records[-1]["rollout/carried_groups"] == 0  # the last iteration draws no new prompts
    # The mismatch ledger: vLLM re-scores a batch holding older tokens under the trained weights; only those tokens
    # are stale, their share split by age.
    for r in records:
        by_age = {k: v for k, v in r.items() if k.startswith("mismatch/staleness_age")}
        if r["rollout/token_age_max"] == 0:
            assert r["mismatch/staleness"] == 0 and not by_age
        else:
            assert r["mismatch/staleness"] > 0 and sum(by_age.values()) == pytest.approx(r["mismatch/staleness"])
            assert max(int(k[len("mismatch/staleness_age"):]) for k in by_age) == r["rollout/token_age_max"]
    assert (partial_run / "save" / "iter_0000002" / "carried_samples.json").is_file()


def test_a_run_resumed_with_samples_in_flight_writes_the_uninterrupted_runs_records(partial_run, tmp_path):
    done = run_cli(tmp_path, "grpo_tiny_cpu", *PARTIAL, f"actor_config.load={partial_run / 'save' / 'iter_0000002'}",
                   "actor_config.finetune=false", f"synthetic_data.data_dir={partial_run / 'assets'}")
    assert done.returncode == 0, done.stderr[-3000:]
    resumed = _records(tmp_path / "run" / "metrics.jsonl", stable=True)
    uninterrupted = _records(partial_run / "run" / "metrics.jsonl", stable=True)[2:]
    assert resumed == uninterrupted
    assert any(r["rollout/resumed_samples"] > 0 for r in resumed)


# Run-ahead (async_engine) on the DAPO demo (its responses end at different lengths, up to 8 tokens) on 2 ranks,
# Megatron DP2, vLLM TP1 x DP2: the stop is decided together by both inference ranks after each decode step.
RUN_AHEAD = ("rl_config.partial_rollout_max_split=4", "rl_config.async_engine=true",
             "generate_config.infer_tensor_parallel_size=1", "rl_config.actor_resource.num_npus=2",
             "rl_config.eval_before_train=false", "rl_config.eval_interval=100",
             "megatron_training.train_iters=4", "megatron_training.save_interval=2")


@pytest.fixture(scope="module")
def run_ahead(tmp_path_factory):
    root = tmp_path_factory.mktemp("run_ahead")
    done = run_cli(root, "dapo_tiny_math_cpu", *RUN_AHEAD, f"actor_config.save={root / 'save'}",
                   f"synthetic_data.data_dir={root / 'assets'}", script="cli/train_dapo.py")
    assert done.returncode == 0, done.stderr[-3000:]
    return root


def test_run_ahead_aborts_the_unfinished_samples_at_a_full_batch_and_resumes_them(run_ahead):
    records = _records(run_ahead / "run" / "metrics.jsonl")
    assert [r["iteration"] for r in records] == [1, 2, 3, 4]
    assert all(r["rollout/partial_rounds"] <= 1 for r in records)  # no chunks: one generate, stopped or whole
    # resumed: carried with tokens but not done, which without chunks only the stop's abort makes
    assert any(r["rollout/resumed_samples"] > 0 for r in records)
    assert all(r["rollout/token_age_max"] <= 3 for r in records)
    for r in records:
        assert r["actor/old_logprobs_from_update"] == float(r["rollout/token_age_max"] == 0)


def test_a_run_ahead_run_resumed_from_its_checkpoint_writes_the_uninterrupted_runs_records(run_ahead, tmp_path):
    done = run_cli(tmp_path, "dapo_tiny_math_cpu", *RUN_AHEAD,
                   f"actor_config.load={run_ahead / 'save' / 'iter_0000002'}", "actor_config.finetune=false",
                   f"synthetic_data.data_dir={run_ahead / 'assets'}", script="cli/train_dapo.py")
    assert done.returncode == 0, done.stderr[-3000:]
    resumed = _records(tmp_path / "run" / "metrics.jsonl", stable=True)
    assert resumed == _records(run_ahead / "run" / "metrics.jsonl", stable=True)[2:]
