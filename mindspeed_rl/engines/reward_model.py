"""A reward model on the actor's ranks: a Qwen2 sequence-classification checkpoint run with Megatron.

The checkpoint is HF's `Qwen2ForSequenceClassification` with `num_labels=1` (the trunk `model.*` and a
`score` head without bias, [1, hidden]). It is built like the reference, in the actor's TP/PP layout, as a
GPTModel whose vocabulary-sized output layer is replaced by the score projection before the model
reaches the device: only the trunk's shards and one hidden-sized row live there.

The score of a sample is the head's output at the last real token of prompt + response, the token HF
pools on (the last non-pad one). The batch is right-padded and attention is causal, so the pads after
that token change nothing before it; no attention mask is needed.
"""
from __future__ import annotations

from dataclasses import replace

import torch

from mindspeed_rl.accelerator import Accelerator
from mindspeed_rl.engines.megatron_engine import MegatronEngine
from mindspeed_rl.models.megatron_build import params_to_dtype, qwen_layer_spec
from mindspeed_rl.models.qwen2 import ModelOptions, Qwen2Spec, transformer_config
from mindspeed_rl.parallel.megatron_state import RankGroups
from mindspeed_rl.protocol import MicroBatch, RolloutBatch

SCORE_WEIGHT = "score.weight"


class ScoreHead(torch.nn.Module):
    """hidden -> 1, replicated on every TP rank (it is one row: splitting it would save nothing). Called the
    way GPTModel calls its output layer, and returns what that returns: (output, bias). Trainable for the
    critic. With `sequence_parallel` each TP rank holds a slice of the positions: it scores its slice and the
    [s, b, 1] outputs are gathered (the loss after them is the same on every TP rank, so backward keeps each
    rank's slice), and the head's gradient, a sum over this rank's positions, is summed over TP by Megatron's
    finalize_model_grads (the `sequence_parallel` attribute, as for the norms)."""

    def __init__(self, hidden_size: int, dtype: torch.dtype, *, trainable: bool = False,
                 sequence_parallel: bool = False):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.zeros(1, hidden_size, dtype=dtype), requires_grad=trainable)
        self.sequence_parallel = sequence_parallel
        self.weight.sequence_parallel = sequence_parallel

    def forward(self, hidden_states: torch.Tensor, weight=None, runtime_gather_output=None):
        output = torch.nn.functional.linear(hidden_states, self.weight)
        if self.sequence_parallel:
            from megatron.core.tensor_parallel import gather_from_sequence_parallel_region

            output = gather_from_sequence_parallel_region(output, tensor_parallel_output_grad=False)
        return output, None


def check_reward_checkpoint(spec: Qwen2Spec, hf_state: dict[str, torch.Tensor], model_dir: str) -> None:
    """A sequence-classification checkpoint with one label and a dense Qwen2 trunk, or ValueError saying why."""
    score = hf_state.get(SCORE_WEIGHT)
    if score is None:
        heads = sorted(name for name in hf_state if not name.startswith("model."))
        raise ValueError(f"{model_dir}: no {SCORE_WEIGHT} (a Qwen2ForSequenceClassification checkpoint is expected; "
                         f"found heads {heads[:4]})")
    if tuple(score.shape) != (1, spec.hidden_size):
        raise ValueError(f"{model_dir}: {SCORE_WEIGHT} has shape {tuple(score.shape)}, expected "
                         f"(1, {spec.hidden_size}) (num_labels=1)")
    if "score.bias" in hf_state:
        raise ValueError(f"{model_dir}: score.bias is not supported (Qwen2ForSequenceClassification has none)")
    if spec.is_moe:
        raise ValueError(f"{model_dir}: a MoE reward model is not supported (dense Qwen2 only)")


def build_reward_gpt_model(spec: Qwen2Spec, *, params_dtype: torch.dtype, parallel: RankGroups, options: ModelOptions,
                           trainable_head: bool = False):
    """The GPTModel trunk with the score head as its output layer (on the last stage). The reward model runs
    without sequence parallel whatever the actor uses (a forward-only pass has no activations worth splitting);
    the critic (`trainable_head`) trains with the actor's setting, which splits its activations over TP."""
    from megatron.core.models.gpt import GPTModel

    if not trainable_head:
        options = replace(options, sequence_parallel=False)
    config = transformer_config(spec, params_dtype=params_dtype, tp=parallel.tp, pp=parallel.pp, cp=parallel.cp,
                                options=options)
    # Every parameter is loaded from the checkpoint; without initialisation the vocabulary-sized output
    # layer GPTModel makes (and this function drops) is never written, so its pages are never touched.
    config.perform_initialization = False
    layer_spec = qwen_layer_spec(spec, config, options, parallel)  # the actor's: packed, CP and SP as it is built
    post_process = parallel.last_stage
    model = GPTModel(config=config, transformer_layer_spec=layer_spec, vocab_size=spec.vocab_size,
                     max_sequence_length=spec.max_position_embeddings,
                     pre_process=parallel.first_stage, post_process=post_process,
                     share_embeddings_and_output_weights=False, position_embedding_type="rope",
                     rotary_base=int(spec.rope_theta))
    if post_process:
        model.output_layer = ScoreHead(spec.hidden_size, params_dtype, trainable=trainable_head,
                                       sequence_parallel=config.sequence_parallel)
    mark_tensor_parallel_shards(model)
    params_to_dtype(model, params_dtype)
    return model


def mark_tensor_parallel_shards(model: torch.nn.Module) -> None:
    """Megatron marks a weight as a TP shard (`tensor_model_parallel`, `partition_dim`) in its weight initialisation,
    which this build skips. Unmarked, the grad norm takes every shard for a replica counted on TP rank 0 only: the
    critic's norm missed the other ranks' shares (4.45 where 4.72 at TP2) and its gradient clipping scaled by it."""
    from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding

    for module in model.modules():
        dim = 0 if isinstance(module, (ColumnParallelLinear, VocabParallelEmbedding)) else (
            1 if isinstance(module, RowParallelLinear) else None)
        weight = getattr(module, "weight", None)
        if dim is None or weight is None or getattr(weight, "tensor_model_parallel", False):
            continue
        weight.tensor_model_parallel, weight.partition_dim, weight.partition_stride = True, dim, 1


def load_reward_weights(model: torch.nn.Module, hf_state: dict[str, torch.Tensor], spec: Qwen2Spec, *,
                        parallel: RankGroups) -> None:
    """The trunk's shard through the engine's layout (as the actor's), the score head whole."""
    from mindspeed_rl.models.layouts import megatron_layout

    params = dict(model.named_parameters())
    expected = set(params)
    untied = replace(spec, tie_word_embeddings=False)  # the layout of the trunk without a tied head
    with torch.no_grad():
        for local in megatron_layout(untied, tp=parallel.tp, tp_rank=parallel.tp_rank, pp=parallel.pp,
                                     pp_rank=parallel.pp_rank):
            if local.name == "output_layer.weight":
                continue  # the language-model head: this model has the score head instead
            target = params[local.name]
            if tuple(target.shape) != tuple(local.shape):
                raise ValueError(f"{local.name}: model {tuple(target.shape)} != layout {tuple(local.shape)}")
            for seg in local.segments:
                target.narrow(local.dim, seg.local_start, seg.length).copy_(
                    hf_state[seg.hf_name].narrow(local.dim, seg.hf_start, seg.length))
            expected.discard(local.name)
        if "output_layer.weight" in params:
            params["output_layer.weight"].copy_(hf_state[SCORE_WEIGHT])
            expected.discard("output_layer.weight")
    if expected:
        raise ValueError(f"reward model: parameters not loaded from the checkpoint: {sorted(expected)[:4]}")


def last_token_index(mb: MicroBatch) -> torch.Tensor:
    """[b] the position of each sample's last real token: prompt length + response length - 1."""
    return mb.prompt_lengths + mb.response_mask.sum(1).long() - 1


class RewardModelEngine(MegatronEngine):
    """The reward model on this rank's shard; forward only. Shares MegatronEngine's pipeline schedule and
    last-stage broadcast, not its construction (no optimizer, a score head)."""

    def __init__(self, *, spec: Qwen2Spec, hf_state: dict[str, torch.Tensor], params_dtype: torch.dtype,
                 accelerator: Accelerator, parallel: RankGroups, options: ModelOptions = ModelOptions(),
                 model_dir: str = ""):
        """`parallel`: this rank's place in the actor's training layout, from the caller."""
        check_reward_checkpoint(spec, hf_state, model_dir or "the reward model")
        self.spec = spec
        self.accelerator = accelerator
        self.parallel = parallel
        self.tp, self.pp, self.ep, self.cp = parallel.tp, parallel.pp, 1, parallel.cp
        self.optimizer = None
        self.scheduler = None
        with accelerator.megatron_context():
            module = build_reward_gpt_model(spec, params_dtype=params_dtype, parallel=self.parallel, options=options)
            load_reward_weights(module, hf_state, spec, parallel=self.parallel)
            self.model = module.to(accelerator.device)

    @torch.no_grad()
    def compute_scores(self, batch: RolloutBatch, *, micro_batch_size: int) -> torch.Tensor:
        """[num_samples] float32 scores, on every rank."""

        def collect(mb: MicroBatch, output: torch.Tensor, non_loss_data: bool = True):
            from mindspeed_rl.models.context_parallel import last_token_scores

            return last_token_scores(output, mb, last_token_index(mb), parallel=self.parallel)

        self.model.eval()
        micro_batches = batch.micro_batches(micro_batch_size, self.accelerator.device)
        with self.accelerator.megatron_context():
            outputs = self._run_schedule(micro_batches, collect, forward_only=True, collect_non_loss_data=True)
        return self._from_last_stage(torch.cat(outputs) if outputs else None, (len(batch),))


def register_reward_states(offloader, engine: RewardModelEngine) -> None:
    """The reward model's params: one state group, resident only in the residency table's `reward` phase."""
    from mindspeed_rl.memory.megatron_states import param_tensors
    from mindspeed_rl.memory.residency import REWARD_PARAMS

    offloader.register(REWARD_PARAMS, lambda: param_tensors(engine.module))
