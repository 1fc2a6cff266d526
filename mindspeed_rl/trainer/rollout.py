"""Rollouts and forward passes as the driver sees them: the plain rollout (one generate, waited for; the rollout
strategy of every run without tool turns, trainer/rollout_strategy.py), the ranks' generations assembled into one
prompt-major batch, a forward RPC's per-sample values, the response tokens of a batch."""
from __future__ import annotations

from dataclasses import replace

import torch

from mindspeed_rl.config import GRPOConfig
from mindspeed_rl.protocol import ROUTES_COLUMN, UNRECORDED_ROUTE, Generation, RolloutBatch
from mindspeed_rl.workers.actor_group import ActorGroup, merge_metrics, merge_shards


class PlainRollout:
    """One generate per rollout, over the inference ranks. It can run ahead (one-step off-policy): `start` now,
    `finish` later (a checkpoint keeps the ranks' results between the two), `assemble` the batch."""

    runs_ahead = True

    def __init__(self, config: GRPOConfig):
        self.config = config

    def generate(self, actor_group: ActorGroup, prompt_ids: list[list[int]], *, iteration=None, n: int | None = None,
                 greedy: bool = False) -> tuple[RolloutBatch, dict]:
        """`n` samples of each prompt (default rl_config's), waited for: one prompt-major batch and the metrics."""
        self.start(actor_group, prompt_ids, iteration, n=n, greedy=greedy)
        return self.assemble(self.finish(actor_group), prompt_ids)

    def start(self, actor_group: ActorGroup, prompt_ids: list[list[int]], iteration=None, *, n: int | None = None,
              greedy: bool = False) -> None:
        actor_group.start_generate(prompt_ids, iteration, n=n, greedy=greedy)

    def finish(self, actor_group: ActorGroup) -> list:
        """The started rollout's per-rank (Shard of generations, metrics)."""
        return actor_group.finish_generate()

    def assemble(self, results: list, prompt_ids: list[list[int]]) -> tuple[RolloutBatch, dict]:
        return rollout_batch(results, prompt_ids, self.config)


def generate(actor_group: ActorGroup, prompt_batch, config: GRPOConfig, *, iteration: int | None = None,
             n: int | None = None, greedy: bool = False) -> tuple[RolloutBatch, dict]:
    """One plain rollout of the prompt records `prompt_batch`, waited for (scripts and tests driving a group by hand;
    a run's own rollouts go through its strategy)."""
    return PlainRollout(config).generate(actor_group, [p.token_ids for p in prompt_batch], iteration=iteration, n=n,
                                         greedy=greedy)


def generated_samples(results: list) -> tuple[list[Generation], dict]:
    """Every inference rank's (shard of generations, metrics) -> every generation, its prompt index counted in the
    whole rollout, prompt-major (a prompt's n samples contiguous, in vLLM's order), and the merged metrics."""
    samples = [replace(g, prompt_index=shard.start + g.prompt_index)
               for shard in merge_shards([s for s, _ in results]) for g in shard.value]
    samples.sort(key=lambda g: g.prompt_index)  # stable
    return samples, merge_metrics([m for _, m in results])


def decode_occupancy(tokens: int, slots: int) -> float:
    return tokens / slots if slots else 1.0


def decode_slots(results: list) -> tuple[int, int]:
    """(tokens generated, decode slots) of one generate over the inference ranks: each rank decodes its shard for as
    many steps as its longest sample, so its slots are its samples x that length; tokens / slots is the decode
    batch's mean occupancy (1: every sample ran to the end together; the long tail's idle slots lower it)."""
    tokens = slots = 0
    for shard in merge_shards([s for s, _ in results]):
        lengths = [len(g.token_ids) for g in shard.value]
        tokens += sum(lengths)
        slots += len(lengths) * max(lengths, default=0)
    return tokens, slots


def rollout_batch(results: list, prompt_ids: list[list[int]], config: GRPOConfig) -> tuple[RolloutBatch, dict]:
    """Every inference rank's (generations, metrics) -> one prompt-major batch and the merged metrics."""
    samples, metrics = generated_samples(results)
    metrics["rollout/decode_occupancy"] = decode_occupancy(*decode_slots(results))
    width = config.response_length_limit
    batch = RolloutBatch.from_token_lists([prompt_ids[g.prompt_index] for g in samples], [g.token_ids for g in samples],
                                          pad_id=0, response_width=width)
    batch.columns["rollout_logprobs"] = padded_rows([g.logprobs for g in samples], batch.response_logprobs_shape)
    if samples and samples[0].routed_experts is not None:  # vLLM recorded its routes (routing replay, the ledger)
        batch.columns[ROUTES_COLUMN] = routes_column([g.routed_experts for g in samples], batch.input_ids.shape[1])
    return batch, metrics


def padded_rows(rows: list, shape: tuple[int, int]) -> torch.Tensor:
    """Per-sample values of the response tokens (vLLM's log-probs) as [samples, response width] fp32, 0 after each
    sample's last token."""
    out = torch.zeros(shape)
    for row, values in enumerate(rows):
        out[row, : len(values)] = torch.tensor(values)
    return out


def routes_column(routes: list, width: int) -> torch.Tensor:
    """[samples, width, layers, k] int16 aligned with `input_ids`, -1 where vLLM recorded nothing."""
    layers, topk = routes[0].shape[1:]
    column = torch.full((len(routes), width, layers, topk), UNRECORDED_ROUTE, dtype=torch.int16)
    for row, sample in enumerate(routes):
        column[row, : sample.shape[0]] = torch.tensor(sample[:width])
    return column


def forward_logprobs(actor_group: ActorGroup, method: str, batch: RolloutBatch) -> tuple[torch.Tensor, dict]:
    """A forward RPC's per-sample values (log-probs, reward scores), assembled from the reporting ranks."""
    results = actor_group.call(method, batch)
    values = torch.cat([shard.value for shard in merge_shards([s for s, _ in results])])
    return values, merge_metrics([m for _, m in results])


def response_ids(batch: RolloutBatch) -> list[list[int]]:
    tokens, lengths = batch.response_tokens(), batch.response_mask.sum(1).long()
    return [tokens[i, : lengths[i]].tolist() for i in range(len(batch))]


def decode_responses(tokenizer, batch: RolloutBatch) -> list[str]:
    """Each sample's response as text, for the verifiers."""
    return [tokenizer.decode(ids, skip_special_tokens=True) for ids in response_ids(batch)]
