"""vLLM's engine driven step by step, so that a rollout can stop before every request finished (MindSpeed-RL's
`async_engine`, verl's colocate_async run-ahead: the generate stops once a global batch of prompt groups is complete,
and the unfinished requests are aborted with the tokens they have).

`LLM.generate` runs until every request finished and only returns finished outputs (it forces FINAL_ONLY); here the
requests are added with DELTA outputs, so each step hands back the tokens (and log-probs) it sampled, and `until` is
asked after every step whether to stop. `until` is collective where the rollout spans inference ranks
(engines/group_stop.py): every rank must step and ask equally often, which holds because each rank asks once per
loop and all ranks leave the loop on the same (all-reduced) answer. The tokens sampled before the stop are those
`LLM.generate` would have sampled: the requests, the scheduler and the sampler's generator are the same.
"""
from __future__ import annotations

import itertools
from typing import Callable

from mindspeed_rl.protocol import Generation

_REQUEST_IDS = itertools.count()


def generate_until(llm, prompts: list, params: list, until: Callable[[list[int]], bool]) -> list[Generation]:
    """One sample per prompt (`params[i].n` == 1), stepped until `until(unfinished prompt indices)` says stop (it
    must say so once nothing is unfinished anywhere). Finished samples say why they stopped; the others are aborted and
    come back with their tokens so far, `stopped` False."""
    from vllm.sampling_params import RequestOutputKind

    engine = llm.llm_engine
    request_ids = []
    for prompt, sampling in zip(prompts, params, strict=True):
        assert sampling.n == 1, "a stepped generate samples one completion per prompt"
        sampling.output_kind = RequestOutputKind.DELTA
        request_ids.append(f"stepped-{next(_REQUEST_IDS)}")
        engine.add_request(request_ids[-1], prompt, sampling)
    index = {request_id: i for i, request_id in enumerate(request_ids)}
    tokens: list[list[int]] = [[] for _ in prompts]
    logprobs: list[list[float]] = [[] for _ in prompts]
    stopped: list[bool | None] = [None] * len(prompts)  # None while running
    while True:
        if engine.has_unfinished_requests():  # vLLM's own DP agreement where it has a DP group
            for output in engine.step():
                _take(output, index[output.request_id], tokens, logprobs, stopped)
        unfinished = [i for i, why in enumerate(stopped) if why is None]
        if until(unfinished):
            break
    if unfinished:
        engine.abort_request([request_ids[i] for i in unfinished])
    return [Generation(prompt_index=i, token_ids=tokens[i], logprobs=logprobs[i], stopped=bool(stopped[i]))
            for i in range(len(prompts))]


def _take(output, i: int, tokens: list, logprobs: list, stopped: list) -> None:
    sample = output.outputs[0]
    tokens[i] += sample.token_ids
    logprobs[i] += [step[token].logprob for token, step in zip(sample.token_ids, sample.logprobs)]
    if output.finished:
        stopped[i] = sample.finish_reason == "stop"  # "length": cut at its max_tokens
