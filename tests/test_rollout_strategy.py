"""The trainer's rollout and measurement steps against a scripted group: the ranks' generations assembled into one
prompt-major batch, the one strategy a run chooses, a rollout started ahead handed out stale, and the mismatch
ledger's passes (the replayed pass and the re-score) run only where they measure something.
The real groups and engines behind them: test_disaggregated_async_e2e, test_train_ppo_e2e, test_multi_turn_e2e.

Runs where: in the pytest process, no engine; a second.
"""
import numpy as np
import torch

from mindspeed_rl.protocol import ROUTES_COLUMN, Generation, RolloutBatch, Shard
from mindspeed_rl.trainer.mismatch_step import MismatchLedgerStep, NoMeasurement, measurement_step
from mindspeed_rl.trainer.multi_turn import ToolTurns
from mindspeed_rl.trainer.rollout import PlainRollout, rollout_batch
from mindspeed_rl.trainer.rollout_strategy import rollout_strategy
from mindspeed_rl.trainer.rollouts import Rollouts
from tests.test_config import load

PROMPTS = [[5, 6], [7], [8, 9, 10], [11]]


def _generation(index: int, tokens: list[int], routes: bool = False) -> Generation:
    experts = np.full((len(PROMPTS[0]) + len(tokens) - 1, 1, 2), index, dtype=np.int16) if routes else None
    return Generation(prompt_index=index, token_ids=tokens, logprobs=[-0.5] * len(tokens), routed_experts=experts)


def _ranks(routes: bool = False) -> list:
    """Two inference-DP ranks, two prompts each (their indices counted in the share), and a TP peer that reports
    nothing; rank 1 returns its samples out of prompt order."""
    first = [_generation(0, [1, 2], routes), _generation(1, [3], routes)]
    second = [_generation(1, [4, 4, 4], routes), _generation(0, [5], routes)]
    return [(Shard(start=0, stop=2, value=first), {"timing/rollout": 2.0}), (Shard(start=0, stop=2, value=None), {}),
            (Shard(start=2, stop=4, value=second), {"timing/rollout": 3.0})]


def test_the_ranks_generations_become_one_prompt_major_batch():
    batch, metrics = rollout_batch(_ranks(), PROMPTS, load("grpo_tiny_cpu"))
    assert batch.prompt_lengths.tolist() == [2, 1, 3, 1]  # prompts 0 to 3: rank 1's two in prompt order
    assert batch.response_mask.sum(1).tolist() == [2, 1, 1, 3]  # [5] answers prompt 2, [4, 4, 4] prompt 3
    assert batch.columns["rollout_logprobs"][3, :3].tolist() == [-0.5] * 3 and ROUTES_COLUMN not in batch.columns
    # Rank 0 decodes 2 steps for 2 samples (3 tokens of 4 slots), rank 1 three steps for 2 (4 of 6): 7 / 10.
    assert metrics == {"timing/rollout": 2.0, "rollout/decode_occupancy": 0.7}  # the timing rank 0's


def test_recorded_routes_ride_along_as_the_routes_column():
    batch, _ = rollout_batch(_ranks(routes=True), PROMPTS, load("grpo_tiny_cpu"))
    routes = batch.columns[ROUTES_COLUMN]
    assert routes.shape[:2] == batch.input_ids.shape and routes.dtype == torch.int16
    assert routes[0, 0].tolist() == [[0, 0]] and routes[0, -1].tolist() == [[-1, -1]]  # -1: nothing recorded


def test_a_run_chooses_one_strategy_for_training_and_evaluation():
    assert type(rollout_strategy(load("grpo_tiny_cpu"), tokenizer=None)) is PlainRollout
    tool_turns = rollout_strategy(load("dapo_tiny_retool_cpu"), tokenizer=None)
    assert type(tool_turns) is ToolTurns and not tool_turns.runs_ahead


class ScriptedGroup:
    """The group calls the steps make, recorded; the rollouts and re-scores they wait for, scripted."""

    def __init__(self):
        self.calls = []

    def start_generate(self, prompt_ids, iteration=None, *, n=None, greedy=False, max_tokens=None, stop=None):
        self.calls.append(("start_generate", iteration, len(prompt_ids)))
        self._prompts = len(prompt_ids)

    def finish_generate(self):
        self.calls.append(("finish_generate",))
        generations = [Generation(prompt_index=i, token_ids=[1], logprobs=[-1.0]) for i in range(self._prompts)]
        return [(Shard(start=0, stop=self._prompts, value=generations), {})]

    def call(self, method, batch):
        self.calls.append((method,))
        return [(Shard(start=0, stop=len(batch), value=torch.full(batch.response_mask.shape, -2.0)), {"m": 1.0})]

    def start_score(self, prompt_ids, response_ids):
        self.calls.append(("start_score", prompt_ids, response_ids))

    def finish_score(self):
        self.calls.append(("finish_score",))
        return [(Shard(start=0, stop=1, value=[[-3.0]]), {"timing/rescore": 0.5})]


class Dataset:
    def __init__(self, n):
        self.records = [type("Prompt", (), {"token_ids": [i + 2]})() for i in range(n)]


class Sampler:
    def next_indices(self):
        return [0, 1]


def test_a_rollout_started_ahead_is_handed_out_stale_and_only_then():
    config = load("grpo_tiny_cpu_disaggregated", "async_generation_ratio=1", "megatron_training.train_iters=2")
    group = ScriptedGroup()
    rollouts = Rollouts(group, Dataset(2), Sampler(), config, PlainRollout(config))
    _, _, metrics = rollouts.next(1)
    assert metrics["rollout/staleness"] == 0 and not rollouts.stale
    rollouts.start_ahead(2)
    rollouts.start_ahead(3)  # past train_iters: nothing starts
    _, batch, metrics = rollouts.next(2)
    assert metrics["rollout/staleness"] == 1 and rollouts.stale and len(batch) == 2
    assert [c[:2] for c in group.calls] == [("start_generate", (1, 0)), ("finish_generate",),
                                            ("start_generate", 2), ("finish_generate",)]


def _batch() -> RolloutBatch:
    batch = RolloutBatch.from_token_lists([[5, 6]], [[7]], pad_id=0, response_width=2)
    batch.columns[ROUTES_COLUMN] = torch.zeros(1, 3, 1, 2, dtype=torch.int16)
    return batch


def test_the_ledgers_passes_run_only_where_they_measure_something():
    assert type(measurement_step(load("grpo_tiny_cpu"), ScriptedGroup())) is NoMeasurement
    config = load("grpo_tiny_cpu", "rl_config.mismatch_ledger=true")
    group = ScriptedGroup()
    step = measurement_step(config, group)
    assert type(step) is MismatchLedgerStep

    batch = _batch()  # the update would give the old log-probs: the routing share needs them before
    assert step.replay_routes(batch) == {"m": 1.0}
    assert [c[0] for c in group.calls] == ["compute_log_prob", "compute_replayed_log_prob"]
    assert "replayed_logprobs" in batch.columns
    group.calls.clear()
    assert step.replay_routes(batch) == {} and group.calls == [("compute_replayed_log_prob",)]  # old ones there
    group.calls.clear()
    dense = RolloutBatch.from_token_lists([[5, 6]], [[7]], pad_id=0, response_width=2)
    assert step.replay_routes(dense) == {} and group.calls == []  # no routes recorded: nothing to replay

    step.start_rescore(batch, stale=False)  # on-policy: nothing to re-score
    assert step.finish_rescore(batch) == {} and group.calls == []
    step.start_rescore(batch, stale=True)
    assert group.calls == [("start_score", [[5, 6]], [[7]])]
    assert step.finish_rescore(batch) == {"timing/rescore": 0.5}
    assert batch.columns["rescored_logprobs"].tolist() == [[-3.0, 0.0]]
    assert step.finish_rescore(batch) == {}  # once per start
