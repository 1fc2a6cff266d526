"""The inference engine: vLLM in this rank's process and torch.distributed world. Its rollout; the destination end of
the weight push."""
from __future__ import annotations

import time
from dataclasses import replace

import torch

from mindspeed_rl.accelerator.host_memory import return_free_heap
from mindspeed_rl.engines.group_stop import GroupStop
from mindspeed_rl.memory.residency import GENERATE, INFER_WEIGHTS, KV_CACHE
from mindspeed_rl.protocol import Generation
from mindspeed_rl.workers.actor_steps import sampling_seed
from mindspeed_rl.workers.dispatch import INFER_DP, Dispatch
from mindspeed_rl.workers.parts import DESTINATION, VLLM, Part, part_rpc
from mindspeed_rl.workers.phase_rpc import phase_rpc


class InferencePart(Part):
    NAME = "inference engine"
    STATES = frozenset({INFER_WEIGHTS, KV_CACHE})
    STAGE = VLLM
    PUSH_END = DESTINATION

    def build(self) -> None:
        from mindspeed_rl.memory.vllm_states import register_inference_states
        from mindspeed_rl.workers import engine_builders as build

        ctx = self.context
        self.inference_model = build.build_inference_model(self.config, ctx.accelerator, model_dir=ctx.model_dir)
        ctx.progress("vLLM started")
        register_inference_states(ctx.offloader, self.inference_model, ctx.accelerator)

    @part_rpc
    def inference_dtypes(self) -> dict:
        """Parameter name -> dtype of vLLM's parameters: the wire dtypes the training ranks pack in."""
        from mindspeed_rl.resharding.transfer import destination_dtypes

        return destination_dtypes(self.inference_model.named_weights())

    @phase_rpc(GENERATE, progress="generate", dispatch=Dispatch(INFER_DP, "prompt_token_ids", "max_tokens", "stop"))
    def generate_sequences(self, prompt_token_ids: list[list[int]], iteration: int | tuple[int, ...] | None = None,
                           n: int | None = None, greedy: bool = False, max_tokens: list[int] | None = None,
                           stop: GroupStop | None = None) -> tuple[list[Generation], dict[str, float]]:
        """Each inference-DP group samples its share of the prompts (the ranks of a TP x PP block the same: vLLM
        broadcasts the last stage's output): a `Generation` per sample (its prompt index in the share). `n` samples
        per prompt (default rl_config.n_samples_per_prompt), greedily with `greedy` (evaluation), at most
        `max_tokens[i]` tokens for prompt i (default sampling_config.max_tokens; a multi-turn turn's budgets).

        With `iteration`, the sampling RNG is reseeded from f(seed, iteration, DP rank) first (seed:
        sampling_config.seed, else megatron_training.seed), so an iteration samples the same whatever came before
        (exact resume); without, it continues the running generator. vLLM's per-request seeds would do the same, but
        its runner rewinds their offsets after a chunked prefill, which CPU generators cannot do.

        `stop` (a run-ahead rollout, one sample per prompt): the generate stops where it says, collectively over the
        inference ranks (engines/group_stop.py), so every rank steps, its share empty or not."""
        sampling = self.config.generate_config.sampling_config
        in_phase = self.ledger.record(GENERATE)
        if iteration is not None:
            base_seed = sampling.seed if sampling.seed is not None else self.config.megatron_training.seed
            dp_rank = self.context.layout.infer.dp_rank(self.context.rank_info.rank)
            torch.manual_seed(sampling_seed(base_seed, iteration, dp_rank))
        t0 = time.perf_counter()
        generations = [] if not (prompt_token_ids or stop) else self.inference_model.generate(
            prompt_token_ids, n=n or self.config.rl_config.n_samples_per_prompt,
            max_tokens=sampling.max_tokens if max_tokens is None else max_tokens,
            temperature=0.0 if greedy else sampling.temperature, top_p=sampling.top_p, top_k=sampling.top_k,
            min_p=sampling.min_p, logprobs=sampling.logprobs, seed=None, detokenize=sampling.detokenize,
            until=None if stop is None else stop.until(self.inference_model.world_cpu_group),
        )
        metrics = {"timing/rollout": time.perf_counter() - t0, **in_phase.metrics(),
                   # Of the inference weights, the oneDNN-packed copies the CPU GEMMs read (engines/vllm_cpu_linears.py).
                   "memory/generate/inference_weights_packed_bytes": float(self.inference_model.packed_linear_bytes())}
        return_free_heap()  # an inference-only rank (disaggregated) has no update to end its iteration
        # Their prompt_index counts in this rank's share; with routing replay the routes ride along.
        return [replace(g, top_logprobs=None, text=None) for g in generations], metrics

    @phase_rpc(GENERATE, progress="re-score", dispatch=Dispatch(INFER_DP, "prompt_token_ids", "response_token_ids"))
    def score_sequences(self, prompt_token_ids: list[list[int]],
                        response_token_ids: list[list[int]]) -> tuple[list[list[float]], dict[str, float]]:
        """vLLM's log-prob of each response token under the weights it holds now: the mismatch ledger's `L_now` of a
        one-step off-policy rollout, re-scored once the weights that train it are pushed (algorithms/mismatch.py)."""
        t0 = time.perf_counter()
        temperature = self.config.generate_config.sampling_config.temperature
        scores = [] if not prompt_token_ids else self.inference_model.score(prompt_token_ids, response_token_ids,
                                                                             temperature=temperature)
        return scores, {"timing/rescore": time.perf_counter() - t0}

