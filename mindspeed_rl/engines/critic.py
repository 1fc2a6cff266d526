"""PPO's critic: a Megatron value model on the actor's ranks, trained with the clipped value loss.

The model is the reward model's (engines/reward_model.py): the GPTModel trunk with a hidden -> 1 head in place
of the vocabulary-sized output layer, here trainable and wrapped with DDP and Megatron's optimizer like the
actor. It starts from an HF checkpoint: a reward model's (`Qwen2ForSequenceClassification`, its `score` head
is the value head, as MindSpeed-RL and verl initialise their critics) or a causal LM's (the actor's weights)
with a fresh head.

The value of response token j is the head's output at the position before it (prompt length - 1 + j): the
state the token was sampled from, the positions where the actor's log-probs are read (verl: `values[:,
-response_length - 1:-1]`).
"""
from __future__ import annotations

from typing import Callable

import torch

from mindspeed_rl.accelerator import Accelerator
from mindspeed_rl.engines.megatron_engine import MegatronEngine, OptimizerSettings
from mindspeed_rl.engines.reward_model import SCORE_WEIGHT, build_reward_gpt_model, load_reward_weights
from mindspeed_rl.models.qwen2 import ModelOptions, Qwen2Spec
from mindspeed_rl.parallel.megatron_state import RankGroups
from mindspeed_rl.protocol import MicroBatch, Packing, RolloutBatch


def with_value_head(hf_state: dict[str, torch.Tensor], spec: Qwen2Spec, *, seed: int) -> dict[str, torch.Tensor]:
    """The checkpoint's tensors with a value head: its `score.weight` when it has one (a reward model), else a
    fresh one drawn from N(0, 1/(h+1)^2) (OpenRLHF's and TRL's value-head init) by a generator seeded with
    `seed`, so every rank draws the same replicated head."""
    score = hf_state.get(SCORE_WEIGHT)
    if score is not None:
        if tuple(score.shape) != (1, spec.hidden_size):
            raise ValueError(f"critic: {SCORE_WEIGHT} has shape {tuple(score.shape)}, expected (1, {spec.hidden_size})")
        return hf_state
    generator = torch.Generator().manual_seed(seed)
    head = torch.randn(1, spec.hidden_size, generator=generator) / (spec.hidden_size + 1)
    dtype = hf_state["model.embed_tokens.weight"].dtype
    return {**hf_state, SCORE_WEIGHT: head.to(dtype)}


def response_values(output: torch.Tensor, mb: MicroBatch, *, parallel: RankGroups) -> torch.Tensor:
    """[b, response_width] fp32 values of the response tokens from the head's output [b, s, 1] (packed:
    [1, t, 1]; under CP this rank's chunks, each value read where its position lives, `parallel`'s CP group), 0
    where `mb.response_mask` is 0."""
    from mindspeed_rl.models.context_parallel import everywhere, scored_rows

    rows, _, held = scored_rows(mb, parallel=parallel)
    values = everywhere(output.reshape(-1)[rows].float(), held, parallel=parallel)
    out = torch.zeros(mb.response_mask.shape, dtype=torch.float32, device=output.device)
    return out.masked_scatter(mb.response_mask.bool(), values)


class CriticEngine(MegatronEngine):
    """The value model on this rank's shard, with its optimizer. Shares MegatronEngine's schedule, optimizer
    step, last-stage broadcast and dist checkpoints, not its construction (a value head in place of the LM head)."""

    def __init__(self, *, spec: Qwen2Spec, hf_state: dict[str, torch.Tensor], params_dtype: torch.dtype,
                 accelerator: Accelerator, parallel: RankGroups, optimizer: OptimizerSettings,
                 options: ModelOptions = ModelOptions(), head_seed: int = 0):
        """`parallel`: this rank's place in the actor's training layout, from the caller (the critic shares it)."""
        if spec.is_moe:
            raise ValueError("critic: a MoE value model is not supported (dense Qwen2/Qwen3 only)")
        self.spec = spec
        self.accelerator = accelerator
        self.parallel = parallel
        self.tp, self.pp, self.ep, self.cp = parallel.tp, parallel.pp, 1, parallel.cp
        self.logprob_chunk_tokens = options.logprob_chunk_tokens
        self.packed_sequences = options.packed_sequences
        with accelerator.megatron_context():
            module = build_reward_gpt_model(spec, params_dtype=params_dtype, parallel=self.parallel, options=options,
                                            trainable_head=True)
            load_reward_weights(module, with_value_head(hf_state, spec, seed=head_seed), spec, parallel=self.parallel)
            module.to(accelerator.device)
            self.model, self.optimizer, self.scheduler = self._wrap_for_training(module, params_dtype, optimizer)

    @torch.no_grad()
    def compute_values(self, batch: RolloutBatch, *, micro_batch_size: int,
                       packing: Packing | None = None) -> torch.Tensor:
        """[num_samples, response_width] values of the response tokens, on every rank."""
        return self._forward_response_rows(batch, micro_batch_size, packing,
                                           lambda mb, output: response_values(output, mb, parallel=self.parallel))

    def train_step(self, batch: RolloutBatch, *, micro_batch_size: int, loss_fn: Callable,
                   packing: Packing | None = None) -> dict[str, float]:
        """One optimizer step: loss_fn(values, mb) -> (loss, stats), normalised by the whole mini-batch (as the
        actor's). Returns the stats summed over micro-batches and DP ranks, `critic/grad_norm`, `critic/lr`."""
        return self._optimizer_step(batch, micro_batch_size, packing,
                                    lambda mb, output: loss_fn(response_values(output, mb, parallel=self.parallel), mb),
                                    metrics_prefix="critic")



def register_critic_states(offloader, critic: CriticEngine) -> None:
    """The critic's params, grads (dropped when they leave, as the actor's) and Adam states: three state groups,
    resident in the residency table's critic phases only."""
    from mindspeed_rl.memory.megatron_states import grad_buffer_tensors, optimizer_state_tensors, param_tensors
    from mindspeed_rl.memory.residency import CRITIC_GRADS, CRITIC_OPTIMIZER, CRITIC_PARAMS

    offloader.register(CRITIC_PARAMS, lambda: param_tensors(critic.module))
    offloader.register(CRITIC_GRADS, lambda: grad_buffer_tensors(critic.model), keep_contents=False)
    offloader.register(CRITIC_OPTIMIZER, lambda: optimizer_state_tensors(critic.optimizer))
