"""End to end through the CLI: five roles on each of 2 device slots (Megatron TP2): vLLM, a reward model
(`rewards.rm`), the reference, the actor and PPO's critic (`cli/train_ppo.py --config-name ppo_tiny_cpu` at TP2 with
`rewards.rm.model_path=synthetic`), 2 iterations, evaluated before the first and after the second on the generated
task's evaluation split (no eval file given: each of its problems once). (One run for the reward model's and the critic's residency checks and the evaluation's scoring: the suite's
time budget.)

Oracles: the reward-phase ledger holds exactly one rank's share of the reward model's parameters, counted
from the checkpoint file (TP2 halves every tensor but the replicated norms and score row), and nothing
else; the planner predicted the same bytes; every other phase holds none of them; reward/mean is the rule
total plus weight x reward/model_score (the combination rule, on means), in training and in the evaluation (which
scores as training does: eval/reward/mean and eval/reward_model/mean); the critic trains and is on the device
only in its two phases, the actor's Adam states never in the critic's.

Runs where: subprocesses (Ray, 2 ranks); ~1 min on 2 cores.
"""
import json

import pytest
from safetensors.torch import load_file

from cli_runner import run_cli

ITERATIONS = 2
WEIGHT = 0.5  # rewards.rm.weight
OTHER_PHASES = ("generate", "ref_logprob", "old_logprob", "critic_values", "update", "critic_update")


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    tmp_path = tmp_path_factory.mktemp("reward_model")
    done = run_cli(tmp_path, "ppo_tiny_cpu", f"megatron_training.train_iters={ITERATIONS}",
                   f"synthetic_data.data_dir={tmp_path / 'assets'}", "actor_config.tensor_model_parallel_size=2",
                   "critic_config.tensor_model_parallel_size=2", "rewards.rm.model_path=synthetic",
                   f"rewards.rm.weight={WEIGHT}",
                   "rl_config.eval_before_train=true", f"rl_config.eval_interval={ITERATIONS}", script="cli/train_ppo.py")
    assert done.returncode == 0, done.stderr[-3000:]
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    metrics = [record for record in records if "reward/mean" in record]
    evals = [record for record in records if "eval/reward/mean" in record]
    reward_dir = next((tmp_path / "assets").glob("reward_model-*"))
    actor_file = next(p for p in (tmp_path / "assets").rglob("*.safetensors") if reward_dir not in p.parents)
    return done, metrics, reward_dir, actor_file, evals


def _per_rank_bytes_at_tp2(reward_dir) -> int:
    state = load_file(str(reward_dir / "model.safetensors"))
    replicated = sum(t.numel() * 4 for name, t in state.items() if "norm" in name or name.startswith("score"))
    split = sum(t.numel() * 4 for t in state.values()) - replicated
    return split // 2 + replicated


def test_every_iteration_completes_and_logs_the_model_score(run):
    _, metrics, _, _, _ = run
    assert [m["iteration"] for m in metrics] == list(range(1, ITERATIONS + 1))
    assert all(m["reward/model_score"] != 0.0 for m in metrics)


def test_the_start_table_puts_the_reward_model_on_the_actors_devices(run):
    done, _, _, _, _ = run
    (row,) = [line for line in done.stdout.splitlines() if line.startswith("  0,1 ")]
    assert {"actor_train", "actor_infer", "reference", "critic", "rewards.rm"} <= {
        role.strip() for role in row.split(maxsplit=1)[1].split(",")}, row
    assert "[plan] reward:" in done.stdout


def test_the_reward_phase_holds_exactly_one_ranks_share_of_the_reward_model(run):
    _, metrics, reward_dir, _, _ = run
    expected = _per_rank_bytes_at_tp2(reward_dir)
    for m in metrics:
        assert m["memory/reward/reward_params_bytes"] == expected
        assert m["memory/reward/total_bytes"] == expected
        assert m["memory/after_reward/reward_params_bytes"] == 0


def test_the_planner_predicted_the_reward_phase(run):
    _, metrics, reward_dir, _, _ = run
    for m in metrics:
        assert m["memory/reward/reward_params_predicted_bytes"] == _per_rank_bytes_at_tp2(reward_dir)
        assert m["memory/reward/predicted_bytes"] == m["memory/reward/total_bytes"]


def test_no_other_phase_holds_the_reward_model(run):
    _, metrics, _, _, _ = run
    for m in metrics:
        for phase in OTHER_PHASES:
            assert m[f"memory/{phase}/reward_params_bytes"] == 0, phase


def test_the_memory_timeline_draws_the_reward_phase(run):
    from mindspeed_rl.memory.timeline import build_timeline

    _, metrics, _, _, _ = run
    timeline = build_timeline(metrics, last_iterations=ITERATIONS)
    rewards = [i for i, label in enumerate(timeline.labels) if label.endswith("\nreward")]
    assert len(rewards) == ITERATIONS
    assert all(timeline.bytes_by_category["reward_params"][i] > 0 for i in rewards)


def test_the_reward_is_the_rule_total_plus_the_weighted_model_score(run):
    _, metrics, _, _, _ = run
    for m in metrics:
        rule = m["arith_acc_rewards/mean"] * 1.0  # rl_config.verifier_weight
        assert m["reward/mean"] == pytest.approx(rule + WEIGHT * m["reward/model_score"], abs=1e-5)


def test_the_evaluation_scores_with_the_reward_model_as_training_does(run):
    *_, evals = run
    assert [e["eval/updates"] for e in evals] == [0, ITERATIONS]
    for e in evals:
        assert e["eval/prompts"] == 24  # the arith task's 25 problems (max_operand 4), as many as 2 DP ranks split evenly
        assert e["eval/reward_model/mean"] != 0.0
        assert e["eval/reward/mean"] == pytest.approx(e["eval/arith_acc/mean"] + WEIGHT * e["eval/reward_model/mean"],
                                                      abs=1e-5)


def test_every_switch_moves_the_minimum_and_the_weights_arrive_exact(run):
    """Train TP2 -> infer TP1 x DP2 beside the reward model: a rank holds half of every tensor Megatron splits
    over TP and receives exactly the other half (the replicated norms stay local); vLLM's log-probs then
    equal Megatron's, which holds only if the inference weights are the training weights."""
    _, metrics, _, actor_file, _ = run
    state = load_file(str(actor_file))
    split = sum(t.numel() * 4 for name, t in state.items() if "norm" not in name)
    for m in metrics:
        assert m["resharding/bytes_received"] == split // 2
        assert m["resharding/ranges_verified"] > 0
        assert m["rollout/logprob_max_abs_diff"] < 1e-4


def test_the_critic_trains_on_the_device_only_in_its_own_phases(run):
    _, metrics, _, _, _ = run
    for record in metrics:
        assert record["critic/vf_loss"] > 0 and record["critic/grad_norm"] > 0 and record["actor/grad_norm"] > 0
        assert record["memory/critic_update/critic_optimizer_states_bytes"] > 0
        assert record["memory/critic_values/critic_params_bytes"] > 0
        for phase in ("generate", "old_logprob", "update"):  # the critic is off the device there ...
            assert record.get(f"memory/{phase}/critic_params_bytes", 0) == 0, phase
        assert record["memory/critic_update/optimizer_states_bytes"] == 0  # ... and the actor's Adam states here
