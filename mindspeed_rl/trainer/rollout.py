"""Rollouts and forward passes as the driver sees them: one generation waited for, the ranks' results assembled
into one prompt-major batch, a forward RPC's per-sample values, the response tokens of a batch. Used by the
training loop and by the evaluation."""
from __future__ import annotations

import torch

from mindspeed_rl.config import GRPOConfig
from mindspeed_rl.protocol import ROUTES_COLUMN, UNRECORDED_ROUTE, RolloutBatch
from mindspeed_rl.workers.actor_group import ActorGroup, merge_metrics, merge_shards


def generate(actor_group: ActorGroup, prompt_batch, config: GRPOConfig, *, iteration: int | None = None,
             n: int | None = None, greedy: bool = False, tool_turns=None) -> tuple[RolloutBatch, dict]:
    """One rollout of `prompt_batch` (`n` samples each, default the config's), waited for; turn by turn with the
    tools of a multi-turn run (`tool_turns`, trainer/multi_turn.ToolTurns)."""
    prompt_ids = [p.token_ids for p in prompt_batch]
    if tool_turns is not None:
        return tool_turns.generate(actor_group, prompt_ids, iteration=iteration, n=n, greedy=greedy)
    actor_group.start_generate(prompt_ids, iteration, n=n, greedy=greedy)
    return rollout_batch(actor_group.finish_generate(), prompt_ids, config)


def generated_samples(results: list) -> tuple[list[tuple], dict]:
    """Every inference rank's (shard of samples, metrics) -> the (prompt index, token ids, log-probs[, routes]) of
    every sample, prompt-major (a prompt's n samples contiguous, in vLLM's order), and the merged metrics."""
    samples = [(shard.start + sample[0], *sample[1:]) for shard in merge_shards([s for s, _ in results])
               for sample in shard.value]
    samples.sort(key=lambda sample: sample[0])  # stable
    return samples, merge_metrics([m for _, m in results])


def rollout_batch(results: list, prompt_ids: list[list[int]], config: GRPOConfig) -> tuple[RolloutBatch, dict]:
    """Every inference rank's (samples, metrics) -> one prompt-major batch and the merged metrics."""
    samples, metrics = generated_samples(results)
    width = config.response_length_limit
    batch = RolloutBatch.from_token_lists([prompt_ids[s[0]] for s in samples], [s[1] for s in samples],
                                          pad_id=0, response_width=width)
    batch.columns["rollout_logprobs"] = padded_rows([s[2] for s in samples], batch.response_logprobs_shape)
    if samples and len(samples[0]) > 3:  # vLLM recorded its routes (routing replay, the ledger's routing share)
        batch.columns[ROUTES_COLUMN] = routes_column([s[3] for s in samples], batch.input_ids.shape[1])
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
