"""DAPO's dynamic sampling (trainer/dynamic_sampling.py): prompt groups whose metric is the same for all their
samples are dropped, further rollouts fill the train batch, the surplus is dropped, the rollout limit stops the
run. Runs in-process; the rollouts and scores are scripted here (the generation and the verifiers are the real
ones in test_train_grpo_e2e's dynamic-sampling run)."""
import pytest
import torch

from mindspeed_rl.config import load_config
from mindspeed_rl.data.rewards import RuleRewards
from mindspeed_rl.protocol import ROUTES_COLUMN, UNRECORDED_ROUTE, RolloutBatch
from mindspeed_rl.trainer.dynamic_sampling import DynamicSamplingExhausted, ScoredRollouts, groups_with_spread
from test_config import compose_cfg

N = 2  # samples per prompt


def test_groups_with_spread_keeps_the_groups_whose_samples_differ():
    values = torch.tensor([1.0, 1.0, 0.0, 1.0, 0.0, 0.0, 0.5, 0.25])
    assert groups_with_spread(values, 2) == [1, 3]


def test_a_group_of_one_sample_is_kept():
    """n_samples_per_prompt 1 (REINFORCE++ without groups): every rollout would be filtered and, with no rollout limit
    (filter_groups_max_batches <= 0, as their recipes set), the run would draw forever."""
    assert groups_with_spread(torch.tensor([1.0, 1.0, 0.0]), 1) == [0, 1, 2]


def test_concat_pads_to_the_widest_batch_and_keeps_columns():
    a = RolloutBatch.from_token_lists([[1, 2]], [[3]], pad_id=0, response_width=2)
    b = RolloutBatch.from_token_lists([[4, 5, 6, 7]], [[8, 9]], pad_id=0, response_width=2)
    a.columns["x"], b.columns["x"] = torch.tensor([1.0]), torch.tensor([2.0])
    both = RolloutBatch.concat([a, b])
    assert both.input_ids.tolist() == [[1, 2, 3, 0, 0, 0], [4, 5, 6, 7, 8, 9]]
    assert both.response_tokens().tolist() == [[3, 0], [8, 9]]
    assert both.columns["x"].tolist() == [1.0, 2.0]


def test_concat_pads_the_recorded_routes_as_unrecorded():
    """Routing replay's column is aligned with input_ids: a narrower batch's routes are padded with -1 (the trainer's
    own routing there), not cut or left ragged."""
    a = RolloutBatch.from_token_lists([[1, 2]], [[3]], pad_id=0, response_width=2)
    b = RolloutBatch.from_token_lists([[4, 5, 6, 7]], [[8, 9]], pad_id=0, response_width=2)
    a.columns[ROUTES_COLUMN] = torch.full((1, 4, 2, 1), 3, dtype=torch.int16)
    b.columns[ROUTES_COLUMN] = torch.full((1, 6, 2, 1), 5, dtype=torch.int16)
    routes = RolloutBatch.concat([a, b]).columns[ROUTES_COLUMN]
    assert routes.shape == (2, 6, 2, 1)
    assert routes[0, :4].eq(3).all() and routes[0, 4:].eq(UNRECORDED_ROUTE).all() and routes[1].eq(5).all()


class _Prompt:
    def __init__(self, label):
        self.label, self.token_ids = label, [label]


class ScriptedRollouts:
    """Rollout r of the script: one prompt per entry, its N samples scoring the entry's pair."""

    def __init__(self, script):
        self.script, self.calls = script, []

    def next(self, iteration, *, refill=0):
        self.calls.append((iteration, refill))
        pairs = self.script[len(self.calls) - 1]
        prompts = [_Prompt(100 * len(self.calls) + i) for i in range(len(pairs))]
        batch = RolloutBatch.from_token_lists([p.token_ids for p in prompts for _ in range(N)],
                                              [[1]] * (N * len(pairs)), pad_id=0, response_width=1)
        batch.columns["score"] = torch.tensor([v for pair in pairs for v in pair])
        return prompts, batch, {"timing/rollout": 1.0}


class ColumnScoring:
    def score(self, prompts, batch):
        values = batch.columns["score"].float()
        return RuleRewards(total=values, per_verifier={"arith_acc": values}), values > 0.5, {}


def _config(*overrides):
    return load_config(compose_cfg("grpo_tiny_cpu", ["rl_config.n_samples_per_prompt=2", "rl_config.mini_batch_size=1",
                                                     "actor_config.micro_batch_size=2",
                                                     "rl_config.filter_groups_enable=true", *overrides]))


def test_refills_until_the_train_batch_is_full_and_drops_the_surplus():
    script = [[(1, 1), (0, 1), (0, 0)], [(1, 1), (1, 0)], [(0, 1), (1, 0), (0.9, 0.1)]]
    rollouts = ScriptedRollouts(script)
    config = _config("rl_config.filter_groups_train_batch_size=3", "rl_config.filter_groups_max_batches=-1",
                     "rl_config.filter_groups_metric=acc")
    scored = ScoredRollouts(rollouts, ColumnScoring(), config).next(7)
    # kept: rollout 1's prompt 1, rollout 2's prompt 1, rollout 3's prompt 0; rollout 3's other two are surplus
    assert [p.label for p in scored.prompts] == [101, 201, 300]
    assert scored.batch.columns["score"].tolist() == [0, 1, 1, 0, 0, 1]
    assert rollouts.calls == [(7, 0), (7, 1), (7, 2)]  # each refill its own sampling stream
    assert scored.metrics["dynamic_sampling/generated_prompts"] == 8
    assert scored.metrics["dynamic_sampling/kept_prompts"] == 3
    assert scored.metrics["dynamic_sampling/dropped_prompts"] == 5
    assert scored.metrics["dynamic_sampling/uniform_prompts"] == 3  # the other 2 dropped are surplus
    assert scored.metrics["dynamic_sampling/rollouts"] == 3
    assert scored.metrics["timing/rollout"] == 3.0


def test_the_metric_decides_what_counts_as_the_same():
    script = [[(0.9, 0.6), (0.2, 0.1)]]  # both samples of prompt 0 are "correct" (> 0.5), their rewards differ
    config = _config("rl_config.filter_groups_train_batch_size=2", "rl_config.filter_groups_metric=reward")
    assert len(ScoredRollouts(ScriptedRollouts(script), ColumnScoring(), config).next(1).prompts) == 2
    config = _config("rl_config.filter_groups_train_batch_size=1", "rl_config.filter_groups_metric=acc")
    with pytest.raises(DynamicSamplingExhausted):
        ScoredRollouts(ScriptedRollouts(script), ColumnScoring(), config).next(1)


def test_the_rollout_limit_stops_with_the_keys_named():
    script = [[(1, 1), (0, 1)], [(0, 0), (1, 1)]]
    config = _config("rl_config.filter_groups_train_batch_size=2", "rl_config.filter_groups_max_batches=2")
    with pytest.raises(DynamicSamplingExhausted) as caught:
        ScoredRollouts(ScriptedRollouts(script), ColumnScoring(), config).next(4)
    assert str(caught.value).startswith("rl_config.filter_groups_max_batches: iteration 4: 2 rollout(s) kept 1 of "
                                        "the filter_groups_train_batch_size=2 prompts")
