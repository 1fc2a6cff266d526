"""Partial rollout's bookkeeping (trainer/partial_rollout.py) against a scripted generate: the cut at max_tokens // N,
carried samples resumed first from their prefix with the budget left, a group trained only when complete, the age
bound on every token, require_max_age_all_finished, the carried state's round trip; the TOKEN_VERSIONS column of
every rollout; the config's refusals. The real engines: test_partial_rollout_e2e.

Runs where: in the pytest process, no engine; a few seconds.
"""
import json

import pytest
import torch

from mindspeed_rl.checkpoint.trainer_state import CARRIED_SAMPLES_NAME, ResumePoint, saved_carried_samples
from mindspeed_rl.config.partial_rollout import max_token_age
from mindspeed_rl.protocol import TOKEN_VERSIONS, Generation, Shard, checked_token_ages, token_ages
from mindspeed_rl.trainer.metrics import token_age_metrics
from mindspeed_rl.trainer.partial_rollout import PartialRollout
from mindspeed_rl.trainer.rollout import PlainRollout
from mindspeed_rl.trainer.rollout_strategy import rollout_strategy
from mindspeed_rl.trainer.rollouts import Rollouts
from tests.test_config import config_error, load

END = 1  # the scripted group's end token


def _config(split=4, *extra):
    # max_tokens 8, two prompts of two samples per batch
    return load("grpo_tiny_cpu", f"rl_config.partial_rollout_max_split={split}", "rl_config.n_samples_per_prompt=2",
                "megatron_training.global_batch_size=2", "rl_config.mini_batch_size=2",
                "actor_config.micro_batch_size=4",
                "generate_config.sampling_config.max_tokens=8", "megatron_training.train_iters=20", *extra)


class LengthGroup:
    """Generates for each context token 7 until the response's scripted length (by the prompt's first token), then
    END; stops at the budget (vLLM's finish_reason: length). Records each call's contexts and budgets."""

    def __init__(self, lengths: dict[int, int]):
        self.lengths, self.calls = lengths, []

    def start_generate(self, prompt_ids, iteration=None, *, n=None, greedy=False, max_tokens=None, stop=None):
        assert n == 1
        self.calls.append((iteration, [list(p) for p in prompt_ids], list(max_tokens)))

    def finish_generate(self):
        _, contexts, budgets = self.calls[-1]
        out = []
        for i, (context, budget) in enumerate(zip(contexts, budgets)):
            done = len(context) - 1  # every prompt is one token here
            want = self.lengths[context[0]] - done  # tokens to go, the END included
            tokens = [7] * (want - 1) + [END] if want <= budget else [7] * budget
            logprobs = [-0.1 * (done + j) for j in range(len(tokens))]
            out.append(Generation(prompt_index=i, token_ids=tokens, logprobs=logprobs,
                                  stopped=want <= budget))
        return [(Shard(start=0, stop=len(out), value=out), {"timing/rollout": 1.0})]


class Prompts:
    def __init__(self, n):
        self.records = [type("Prompt", (), {"token_ids": [100 + i]})() for i in range(n)]


class CountingSampler:
    def __init__(self, batch=2):
        self.position, self.batch = 0, batch

    def next_indices(self):
        start, self.position = self.position, self.position + self.batch
        return list(range(start, start + self.batch))


def _run(strategy, group, iterations, prompts=Prompts(40), sampler=None):
    sampler = sampler or CountingSampler()
    return [strategy.rollout(group, sampler, prompts.records, i) for i in iterations]


def test_long_samples_are_cut_carried_and_resumed_first_from_their_prefix():
    # prompt 100: 2 tokens (short); 101: 5 tokens (two chunks of 2 and the rest); every later prompt short
    lengths = {100 + i: 2 for i in range(40)} | {101: 5}
    group, strategy = LengthGroup(lengths), PartialRollout(_config(4))
    assert strategy.chunk == 2 and strategy.max_age == 3
    prompts, batch, metrics = strategy.rollout(group, CountingSampler(), Prompts(40).records, 1)
    assert [p.token_ids for p in prompts] == [[100], [102]]  # 101 was cut: 102 (pool's second batch) trains instead
    assert group.calls[0][2] == [2] * 8 and metrics["rollout/resumed_samples"] == 0
    assert [g.prompt_index for g in strategy.carried] == [1, 3] and metrics["rollout/carried_groups"] == 2
    assert batch.columns[TOKEN_VERSIONS][0, :2].tolist() == [0, 0]
    group.calls.clear()
    _, batch, metrics = strategy.rollout(group, CountingSampler(), Prompts(40).records, 2)
    iteration, contexts, budgets = group.calls[0]
    assert iteration == (2, 0) and contexts[0] == [101, 7, 7] and budgets[:2] == [2, 2]  # resumed first, its prefix
    assert metrics["rollout/resumed_samples"] == 2


def test_the_decode_occupancy_counts_the_slots_a_short_sample_leaves_idle():
    # 4 groups of 2 samples cut at 2 tokens: prompt 100's samples end after 1, the others use both slots: 14 of 16
    lengths = {100 + i: 2 for i in range(40)} | {100: 1}
    group, strategy = LengthGroup(lengths), PartialRollout(_config(4))
    _, _, metrics = strategy.rollout(group, CountingSampler(), Prompts(40).records, 1)
    assert len(group.calls) == 1 and metrics["rollout/decode_occupancy"] == 14 / 16


def test_a_group_trains_once_all_its_samples_are_done_and_tokens_keep_their_versions_and_logprobs():
    lengths = {100 + i: 2 for i in range(40)} | {101: 5}
    group, strategy = LengthGroup(lengths), PartialRollout(_config(4))
    sampler, records = CountingSampler(), Prompts(40).records
    trained = [strategy.rollout(group, sampler, records, i) for i in (1, 2, 3)]
    names = [[p.token_ids[0] for p in prompts] for prompts, _, _ in trained]
    assert names[0] == [100, 102] and 101 in names[2]  # 101 needs 3 chunks: cut twice, trained in iteration 3
    prompts, batch, _ = trained[2]
    row = 2 * [p.token_ids[0] for p in prompts].index(101)
    assert batch.response_mask[row].sum() == 5
    assert batch.columns[TOKEN_VERSIONS][row, :5].tolist() == [0, 0, 1, 1, 2]  # iterations 1, 2, 3 sampled them
    assert torch.allclose(batch.columns["rollout_logprobs"][row, :5], torch.tensor([-0.0, -0.1, -0.2, -0.3, -0.4]))
    ages = token_ages(batch, policy_version=2)
    assert ages[row, :5].tolist() == [2, 2, 1, 1, 0] and int(ages.max()) <= strategy.max_age


def test_the_age_bound_holds_on_every_token_and_the_longest_finishes_within_n_iterations():
    lengths = {100 + i: 8 if i % 2 else 2 for i in range(80)}  # odd prompts need all four chunks
    group, strategy = LengthGroup(lengths), PartialRollout(_config(4))
    sampler, records, oldest = CountingSampler(), Prompts(80).records, 0
    for iteration in range(1, 12):
        _, batch, _ = strategy.rollout(group, sampler, records, iteration)
        oldest = max(oldest, int(checked_token_ages(batch, iteration - 1, bound=3).max()))
        assert all(iteration + 1 - g.started <= 3 for g in strategy.carried)
    assert oldest > 0  # some trained tokens were sampled by older weights


def test_require_max_age_all_finished_generates_a_sample_at_the_max_age_to_its_end():
    # max_tokens 8 // 3 = 2-token chunks: three chunks reach 6 tokens, not 8; one prompt in four needs all 8
    lengths = {100 + i: 8 if i % 4 == 1 else 2 for i in range(80)}
    forced = PartialRollout(_config(3))
    assert forced.max_age == 2 and max_token_age(forced.config) == 2
    group = LengthGroup(lengths)
    _run(forced, group, range(1, 4), Prompts(80))
    assert group.calls[-1][0] == (3, 0) and group.calls[-1][2][:2] == [4, 4]  # age 2: the rest, 8 - 2 x 2
    lax = PartialRollout(_config(3, "rl_config.require_max_age_all_finished=false"))
    assert lax.max_age == 3  # four 2-token chunks reach max_tokens: the bound is what the chunks give
    group = LengthGroup(lengths)
    for iteration, (_, batch, _) in enumerate(_run(lax, group, range(1, 8), Prompts(80)), start=1):
        checked_token_ages(batch, iteration - 1, bound=3)
    assert max(max(budgets) for _, _, budgets in group.calls) == 2


def test_the_carried_samples_round_trip_and_a_resumed_strategy_continues_identically(tmp_path):
    lengths = {100 + i: 3 + i % 5 for i in range(80)}
    records = Prompts(80).records
    whole, sampler = PartialRollout(_config(4)), CountingSampler()
    reference = [whole.rollout(LengthGroup(lengths), sampler, records, i) for i in range(1, 7)]
    first, sampler = PartialRollout(_config(4)), CountingSampler()
    for i in range(1, 4):
        first.rollout(LengthGroup(lengths), sampler, records, i)
    (tmp_path / CARRIED_SAMPLES_NAME).write_text(json.dumps(first.state_dict()))
    saved = saved_carried_samples(ResumePoint(path=tmp_path, iteration=3, state={}))
    resumed = PartialRollout(_config(4))
    resumed.load_state_dict(saved)
    for i in range(4, 7):
        prompts, batch, _ = resumed.rollout(LengthGroup(lengths), sampler, records, i)
        expected_prompts, expected, _ = reference[i - 1]
        assert [p.token_ids for p in prompts] == [p.token_ids for p in expected_prompts]
        for column in ("rollout_logprobs", TOKEN_VERSIONS):
            assert torch.equal(batch.columns[column], expected.columns[column])
        assert torch.equal(batch.input_ids, expected.input_ids)


def test_rollouts_hand_a_partial_strategy_its_sampler_and_keep_its_state():
    config = _config(4)
    rollouts = Rollouts(LengthGroup({100 + i: 2 for i in range(40)}), Prompts(40), CountingSampler(), config,
                        PartialRollout(config))
    prompts, batch, metrics = rollouts.next(1)
    assert len(prompts) == 2 and metrics["rollout/staleness"] == 0
    # the pool's second global batch, complete, waits for the next update (MindSpeed-RL's two batches in flight)
    assert [g["prompt_index"] for g in rollouts.carried_state["groups"]] == [2, 3]
    assert batch.columns[TOKEN_VERSIONS].eq(0).all() and metrics["rollout/carried_groups"] == 2
    assert isinstance(rollout_strategy(config, tokenizer=None), PartialRollout)
    assert isinstance(PartialRollout(config).plain, PlainRollout)  # evaluation: whole samples, the plain path


class OnePolicyGroup:
    """Every prompt's two samples, three tokens each."""

    def start_generate(self, prompt_ids, iteration=None, *, n=None, greedy=False, max_tokens=None, stop=None):
        self.prompts = len(prompt_ids)

    def finish_generate(self):
        out = [Generation(prompt_index=i // 2, token_ids=[7, 7, END], logprobs=[-1.0] * 3)
               for i in range(2 * self.prompts)]
        return [(Shard(start=0, stop=self.prompts, value=out), {})]


def test_every_plain_rollout_is_tagged_with_the_policy_that_sampled_it_and_is_age_zero():
    config = load("grpo_tiny_cpu", "rl_config.n_samples_per_prompt=2", "megatron_training.global_batch_size=2",
                  "rl_config.mini_batch_size=2", "actor_config.micro_batch_size=4")
    rollouts = Rollouts(OnePolicyGroup(), Prompts(4), CountingSampler(), config,
                        PlainRollout(config))
    _, batch, metrics = rollouts.next(5)
    assert batch.columns[TOKEN_VERSIONS].eq(4).all() and metrics["rollout/resumed_samples"] == 0
    assert token_age_metrics(batch, policy_version=4) == {"rollout/token_age_mean": 0.0, "rollout/token_age_max": 0.0}
    with pytest.raises(AssertionError, match="declared bound"):
        checked_token_ages(batch, policy_version=5, bound=0)  # a version behind: only a bug makes it so


def test_what_partial_rollout_does_not_support_yet_is_refused_at_start():
    assert "must be an integer >= 1" in config_error("grpo_tiny_cpu", "rl_config.partial_rollout_max_split=0")
    assert "at least one" in config_error("grpo_tiny_cpu", "rl_config.partial_rollout_max_split=9",
                                          "generate_config.sampling_config.max_tokens=8")
    message = config_error("grpo_tiny_cpu", "rl_config.partial_rollout_max_split=2", "rl_config.routing_replay=true",
                           "generate_config.enable_prefix_caching=false")
    assert "rl_config.routing_replay" in message and "partial_rollout_max_split > 1" in message
    # the mismatch ledger splits the resumed tokens' staleness by age (test_partial_rollout_e2e)
    assert load("grpo_tiny_cpu", "rl_config.partial_rollout_max_split=2", "rl_config.mismatch_ledger=true")
    # disaggregated inference carries samples alike (one-step off-policy cannot: its rollout starts a batch early)
    assert load("grpo_tiny_cpu_disaggregated", "rl_config.partial_rollout_max_split=2")
    message = config_error("grpo_tiny_cpu_disaggregated", "rl_config.partial_rollout_max_split=2",
                           "async_generation_ratio=1")
    assert message.startswith("async_generation_ratio: is not implemented with")
    assert max_token_age(load("grpo_tiny_cpu_disaggregated", "async_generation_ratio=1")) == 1
    assert max_token_age(load("grpo_tiny_cpu")) == 0


class AheadGroup(OnePolicyGroup):
    def start_generate(self, prompt_ids, iteration=None, *, n=None, greedy=False, max_tokens=None, stop=None):
        self.prompts = len(prompt_ids)


def test_a_rollout_started_ahead_is_tagged_with_the_weights_before_and_is_one_version_old():
    config = load("grpo_tiny_cpu_disaggregated", "async_generation_ratio=1", "megatron_training.train_iters=3",
                  "rl_config.n_samples_per_prompt=2")
    rollouts = Rollouts(AheadGroup(), Prompts(8), CountingSampler(), config, PlainRollout(config))
    _, batch, _ = rollouts.next(1)
    assert batch.columns[TOKEN_VERSIONS].eq(0).all()
    rollouts.start_ahead(2)  # during iteration 1's update: sampled by version 0, trained at version 1
    _, batch, metrics = rollouts.next(2)
    assert metrics["rollout/staleness"] == 1 and batch.columns[TOKEN_VERSIONS].eq(0).all()
    assert token_age_metrics(batch, policy_version=1)["rollout/token_age_max"] == 1.0
    checked_token_ages(batch, policy_version=1, bound=max_token_age(config))


def test_groups_a_checkpoint_carried_past_this_runs_bound_are_dropped_not_trained(capsys):
    lengths = {100 + i: 8 if i % 4 == 1 else 2 for i in range(80)}
    wide, sampler, records = PartialRollout(_config(8)), CountingSampler(), Prompts(80).records
    for i in range(1, 4):
        wide.rollout(LengthGroup(lengths), sampler, records, i)
    assert any(g.started == 1 for g in wide.carried)
    narrow = PartialRollout(_config(2))  # bound 1: groups started in iteration 1 are 3 versions old at iteration 4
    narrow.load_state_dict(wide.state_dict())
    _, batch, _ = narrow.rollout(LengthGroup(lengths), sampler, records, 4)
    checked_token_ages(batch, policy_version=3, bound=1)
    assert "dropped" in capsys.readouterr().out


def test_the_plan_bounds_the_carried_samples_by_one_global_batch_of_groups():
    from mindspeed_rl.config.partial_rollout import CARRIED_BYTES_PER_TOKEN, carried_bound

    # 16 prompts x 16 samples, max_tokens 4 cut in chunks of 1: at most 16 groups carried, 3 tokens each so far
    bound = carried_bound(load("grpo_tiny_cpu", "rl_config.partial_rollout_max_split=4"))
    assert (bound.samples, bound.response_tokens, bound.reprefill_tokens) == (256, 256 * 3, 256 * (8 + 3))
    assert bound.host_bytes == 256 * 3 * CARRIED_BYTES_PER_TOKEN == 256 * 3 * 13
    assert "at most 256 samples carried" in bound.line()
    assert carried_bound(load("grpo_tiny_cpu")) is None


class SteppedLengthGroup(LengthGroup):
    """LengthGroup stepped as vLLM's engine is under a run-ahead stop (engines/vllm_stepped.py): one token per running
    sample per step, the stop asked after each step on this one rank's unfinished samples."""

    def start_generate(self, prompt_ids, iteration=None, *, n=None, greedy=False, max_tokens=None, stop=None):
        assert stop is not None and len(stop) == len(prompt_ids)
        super().start_generate(prompt_ids, iteration, n=n, greedy=greedy, max_tokens=max_tokens)
        self.stop = stop

    def finish_generate(self):
        _, contexts, budgets = self.calls[-1]
        whole = super().finish_generate()[0][0]  # to its end or its budget, as without a stop
        ends = [len(g.token_ids) for g in whole.value]
        until, step = self.stop.until(), 0
        while not until([i for i, end in enumerate(ends) if end > step]):
            step += 1
        out = [Generation(prompt_index=g.prompt_index, token_ids=g.token_ids[:step], logprobs=g.logprobs[:step],
                          stopped=g.stopped and len(g.token_ids) <= step) for g in whole.value]
        return [(Shard(start=0, stop=len(out), value=out), {"timing/rollout": 1.0})]


def _run_ahead_config(split=4, *extra):
    return _config(split, "rl_config.async_engine=true", *extra)


def test_run_ahead_stops_the_generate_once_a_global_batch_of_groups_is_complete():
    # prompts 100-103 in the pool; 100 and 102 need 2 tokens, 101 and 103 need 8: the stop comes after 2 steps
    lengths = {100 + i: 8 if i % 2 else 2 for i in range(80)}
    group, strategy = SteppedLengthGroup(lengths), PartialRollout(_run_ahead_config())
    prompts, batch, metrics = strategy.rollout(group, CountingSampler(), Prompts(80).records, 1)
    assert [p.token_ids[0] for p in prompts] == [100, 102] and metrics["rollout/partial_rounds"] == 1
    assert group.calls[0][2] == [8] * 8  # no chunks: each sample's whole budget, the stop cuts it
    assert [len(s.token_ids) for g in strategy.carried for s in g.samples] == [2] * 4  # aborted at step 2
    assert metrics["rollout/carried_samples_unfinished"] == 4


def test_run_ahead_finishes_a_group_at_the_declared_age_and_keeps_the_bound():
    lengths = {100 + i: 8 if i % 2 else 2 for i in range(80)}
    group, strategy = SteppedLengthGroup(lengths), PartialRollout(_run_ahead_config(3))
    assert strategy.max_age == 2 and max_token_age(strategy.config) == 2
    sampler, records, oldest = CountingSampler(), Prompts(80).records, 0
    for iteration in range(1, 10):
        _, batch, _ = strategy.rollout(group, sampler, records, iteration)
        oldest = max(oldest, int(checked_token_ages(batch, iteration - 1, bound=2).max()))
        assert all(iteration + 1 - g.started <= 2 for g in strategy.carried)
    assert oldest == 2  # the long groups are aborted twice, then generated to their end


def test_group_stop_counts_a_group_complete_only_when_all_its_samples_are_done():
    from mindspeed_rl.engines.group_stop import GroupStop

    stop = GroupStop(sample_groups=(0, 0, 1, 1, 2), groups=4, target_groups=2, must_finish=(2,))
    assert len(stop) == 5 and stop[2:4].sample_groups == (1, 1) and stop[2:4].target_groups == 2
    until = stop.until()
    assert not until([0, 2, 4])  # only group 3 (no sample in this generate) is complete
    assert until([0, 2])  # groups 2 and 3 complete: a global batch of 2
    assert not until([0, 1, 4])  # groups 1 and 3 complete, but group 2 must finish
    assert until([])


def test_async_engine_is_listed_as_having_no_effect_without_partial_rollout():
    assert load("grpo_tiny_cpu", "rl_config.async_engine=true").rl_config.async_engine is False
    assert load("grpo_tiny_cpu", "rl_config.async_engine=true",
                "rl_config.partial_rollout_max_split=2").rl_config.async_engine is True


def test_the_plan_bounds_run_aheads_carried_prefixes_by_max_tokens_minus_one():
    from mindspeed_rl.config.partial_rollout import carried_bound

    # no chunks: an aborted sample may hold all but its last token (max_tokens 4)
    bound = carried_bound(load("grpo_tiny_cpu", "rl_config.partial_rollout_max_split=4", "rl_config.async_engine=true"))
    assert (bound.samples, bound.response_tokens, bound.reprefill_tokens) == (256, 256 * 3, 256 * (8 + 3))
    bound = carried_bound(load("grpo_tiny_cpu", "rl_config.partial_rollout_max_split=2", "rl_config.async_engine=true"))
    assert bound.response_tokens == 256 * 3  # split 2's chunks would leave 2
