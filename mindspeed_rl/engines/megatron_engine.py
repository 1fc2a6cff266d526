"""Real megatron.core GPTModel + Megatron optimizer, built from an HF checkpoint directory.

The engine computes per-token log-probs of response tokens in micro-batches (forward only) and
runs one optimizer step per mini-batch through Megatron's own pipeline schedules, so PP and TP
go through the same path as on a cluster.
"""
from __future__ import annotations

import contextlib
from collections import ChainMap
from collections.abc import Mapping
from dataclasses import replace
from functools import partial
from typing import TYPE_CHECKING, Callable, Iterator

import torch
import torch.distributed as dist

from mindspeed_rl.accelerator import Accelerator
from mindspeed_rl.engines.optimizer_settings import (  # noqa: F401 (LR_DECAY_STYLES, LRSchedule: API)
    LR_DECAY_STYLES, LRSchedule, OptimizerSettings)
from mindspeed_rl.engines.vocab_parallel import response_logprobs_from_logits, response_topk_from_logits
from mindspeed_rl.models.megatron_build import (  # noqa: F401 (build_gpt_model, load_hf_into_megatron: API)
    build_gpt_model, layout_buffers, load_hf_into_megatron)
from mindspeed_rl.models.context_parallel import cut_padding, model_inputs
from mindspeed_rl.models.lora import MergedWeights, saved_state, with_adapters
from mindspeed_rl.models.qwen2 import ModelOptions, Qwen2Spec
from mindspeed_rl.engines.routing_replay import RoutingReplay, routes_of_this_rank
from mindspeed_rl.models.scored_head import scored_rows_only
from mindspeed_rl.protocol import TEACHER_TOPK_COLUMN, MicroBatch, Packing, RolloutBatch

if TYPE_CHECKING:
    from mindspeed_rl.models.lora import LoRASettings
    from mindspeed_rl.parallel.megatron_state import RankGroups

def _in_batch_order(outputs: list[torch.Tensor], micro_batches: list[MicroBatch]) -> torch.Tensor | None:
    """The micro-batches' rows back in the batch's sample order (token-budget groups are not contiguous);
    None where this pipeline stage computed nothing."""
    if not outputs:
        return None
    order = torch.tensor([i for mb in micro_batches for i in mb.sample_indices], device=outputs[0].device)
    rows = torch.cat(outputs)
    return torch.empty_like(rows).index_copy_(0, order, rows)


# Loss stats that are maxima: reduced by max over micro-batches and DP ranks; every other stat is a share summed.
MAX_REDUCED_STATS = frozenset({"rollout/logprob_max_abs_diff"})


class MegatronEngine:
    """One Megatron model (actor with optimizer, or reference without) on this rank's shard."""

    # No adapters unless the constructor adds them (the critic and the reward model build themselves).
    lora: "LoRASettings | None" = None
    lora_filter = False
    # Context parallelism is the actor's and the reference's (config/context_parallel.check_context_parallel): the
    # critic and the reward model build themselves without it.
    cp = 1
    # Routing replay (engines/routing_replay.py), the actor's when the run records vLLM's routes; None: routers route.
    routing_replay: RoutingReplay | None = None
    _scored_logits = False  # see _logits_of_scored_rows

    def __init__(self, *, spec: Qwen2Spec, hf_state: dict[str, torch.Tensor], params_dtype: torch.dtype,
                 accelerator: Accelerator, parallel: RankGroups, optimizer: OptimizerSettings | None,
                 options: ModelOptions = ModelOptions(), lora: LoRASettings | None = None,
                 lora_filter: bool = False, routing_replay: bool | None = None):
        """`parallel`: this rank's place in the training layout and its groups, from the caller (the rank's
        init_distributed; Megatron's state was set from the same layout). `lora`: adapters on the loaded weights,
        which are then frozen (models/lora.py); `lora_filter`: checkpoints hold the adapters only (the backbone is
        the HF checkpoint's). `routing_replay` (engines/routing_replay.py): None, the routers route on their own;
        False, they are fed vLLM's recorded routes to measure against; True, those routes are also forced."""
        self.spec = spec
        self.accelerator = accelerator
        self.parallel = parallel
        self.tp, self.pp, self.ep, self.cp = parallel.tp, parallel.pp, parallel.ep, parallel.cp
        self.logprob_chunk_tokens = options.logprob_chunk_tokens
        self.packed_sequences = options.packed_sequences
        self.lora, self.lora_filter = lora, lora_filter
        with accelerator.megatron_context():
            module = build_gpt_model(spec, params_dtype=params_dtype, parallel=parallel, options=options)
            load_hf_into_megatron(module, hf_state, spec, parallel=parallel)
            with_adapters(module, lora, parallel=parallel)
            module.to(accelerator.device)
            self.optimizer = None
            self.scheduler = None
            if optimizer is None:
                self.model = module
            else:
                self.model, self.optimizer, self.scheduler = self._wrap_for_training(
                    module, params_dtype, optimizer)
        if routing_replay is not None:
            self.routing_replay = RoutingReplay(module, forcing=routing_replay)

    def _wrap_for_training(self, module, params_dtype, settings: OptimizerSettings):
        from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads
        from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
        from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

        config = module.config
        distributed = settings.use_distributed_optimizer
        ddp = DistributedDataParallel(
            config, DistributedDataParallelConfig(grad_reduce_in_fp32=True, use_distributed_optimizer=distributed),
            module,
        )
        optimizer = get_megatron_optimizer(
            OptimizerConfig(
                optimizer="adam", lr=settings.lr, min_lr=settings.min_lr, weight_decay=settings.weight_decay,
                adam_beta1=settings.adam_beta1, adam_beta2=settings.adam_beta2, adam_eps=settings.adam_eps,
                clip_grad=settings.clip_grad, bf16=params_dtype == torch.bfloat16, params_dtype=params_dtype,
                use_distributed_optimizer=distributed,
            ),
            [ddp],
        )
        schedule = settings.schedule
        # Megatron-LM's defaults: warmup starts from lr 0 (lr_warmup_init), weight decay constant.
        scheduler = OptimizerParamScheduler(
            optimizer, init_lr=0.0, max_lr=settings.lr, min_lr=settings.min_lr,
            lr_warmup_steps=schedule.warmup_steps, lr_decay_steps=schedule.decay_steps,
            lr_decay_style=schedule.decay_style, start_wd=settings.weight_decay, end_wd=settings.weight_decay,
            wd_incr_steps=schedule.decay_steps, wd_incr_style="constant",
        )
        config.finalize_model_grads_func = finalize_model_grads
        config.no_sync_func = ddp.no_sync
        config.grad_scale_func = optimizer.scale_loss
        return ddp, optimizer, scheduler

    @property
    def module(self) -> torch.nn.Module:
        """The GPTModel itself, without the DDP wrapper."""
        return self.model.module if self.optimizer is not None else self.model

    # -- forward / backward through megatron's schedule ------------------------------------------
    def _run_schedule(self, micro_batches: list[MicroBatch], loss_func: Callable, forward_only: bool,
                      collect_non_loss_data: bool) -> list:
        from megatron.core.pipeline_parallel import get_forward_backward_func

        packed = micro_batches[0].packed
        # Padded: sequence parallel (MoE with TP > 1) splits the sequence over TP ranks and context parallelism
        # into 2 CP chunks; tokens appended after the last one change no earlier logit (causal), so pad and cut
        # the logits back. Packed rows come padded to the multiple already, and the stages exchange each one's
        # shape (variable_seq_lengths).
        width = max(mb.input_ids.shape[1] for mb in micro_batches)
        seq_length = self.parallel.layout.padded_length(
            width, sequence_parallel=self.module.config.sequence_parallel and not packed)

        def forward_step(data_iterator: Iterator[MicroBatch], model):
            mb = next(data_iterator)
            return self._forward(model, mb, seq_length, width), partial(loss_func, mb)

        assert packed or all(mb.input_ids.shape[1] == width for mb in micro_batches), "pipeline p2p needs one shape"
        # Stages receive every micro-batch in the first one's shape: a smaller last one would be read wrongly.
        assert packed or self.pp == 1 or len({mb.input_ids.shape[0] for mb in micro_batches}) == 1, (
            f"pipeline parallelism needs micro-batches of one size: {len(micro_batches)} micro-batches of "
            f"{[mb.input_ids.shape[0] for mb in micro_batches]} samples")
        return get_forward_backward_func()(
            forward_step_func=forward_step,
            data_iterator=iter(micro_batches),
            model=[self.model],
            num_microbatches=len(micro_batches),
            seq_length=seq_length,
            micro_batch_size=micro_batches[0].input_ids.shape[0],
            forward_only=forward_only,
            collect_non_loss_data=collect_non_loss_data,
        )

    def _forward(self, model, mb: MicroBatch, seq_length: int, width: int) -> torch.Tensor:
        """The model's output for `mb` on this rank: padded rows padded to `seq_length` and the logits cut back to
        `width`; under context parallelism this rank's chunks, whose logits stay local."""
        packed_seq_params = self._packed_seq_params(mb) if mb.packed else None
        ids, positions = (mb.input_ids, mb.position_ids) if mb.packed else mb.padded_to(seq_length)
        if self.routing_replay is not None:
            self.routing_replay.set_micro_batch(routes_of_this_rank(
                mb, seq_length, parallel=self.parallel, sequence_parallel=self.module.config.sequence_parallel))
        scored = self._scored_logits and self.parallel.last_stage
        with (scored_rows_only(self.module.output_layer, mb, parallel=self.parallel) if scored
              else contextlib.nullcontext()):
            output = model(*model_inputs(mb, ids, positions, parallel=self.parallel), None,
                           packed_seq_params=packed_seq_params)
        return cut_padding(output, mb, width) if self.parallel.last_stage and not scored else output

    @contextlib.contextmanager
    def _logits_of_scored_rows(self):
        """The model's logits for the rows that score a response token only, while the context lasts
        (models/scored_head.py): the actor's and the reference's log-prob passes and the update."""
        self._scored_logits = True
        try:
            yield
        finally:
            self._scored_logits = False

    @staticmethod
    def _packed_seq_params(mb: MicroBatch):
        from megatron.core.packed_seq_params import PackedSeqParams

        return PackedSeqParams(qkv_format="thd", cu_seqlens_q=mb.cu_seqlens, cu_seqlens_kv=mb.cu_seqlens,
                               max_seqlen_q=mb.max_seqlen, max_seqlen_kv=mb.max_seqlen)

    @torch.no_grad()
    def compute_logprobs(self, batch: RolloutBatch, *, micro_batch_size: int, temperature: float,
                         packing: Packing | None = None) -> torch.Tensor:
        """[num_samples, response_width] log-probs of the response tokens, on every rank."""

        def logprobs(mb: MicroBatch, logits: torch.Tensor) -> torch.Tensor:
            return self._scored_logprobs(logits, mb, temperature, with_entropy=False)[0]

        with self._logits_of_scored_rows():
            return self._forward_response_rows(batch, micro_batch_size, packing, logprobs)

    @torch.no_grad()
    def compute_topk_logprobs(self, batch: RolloutBatch, *, k: int, micro_batch_size: int, temperature: float,
                              packing: Packing | None = None) -> torch.Tensor:
        """[num_samples, response_width, 1 + 2k] on every rank: each response token's log-prob, the k most likely
        tokens' log-probs and their ids there (vocab_parallel.response_topk_from_logits; a distillation teacher)."""

        def topk(mb: MicroBatch, logits: torch.Tensor) -> torch.Tensor:
            return response_topk_from_logits(logits, mb, k, temperature, self.logprob_chunk_tokens,
                                             parallel=self.parallel, rows_selected=True)

        with self._logits_of_scored_rows():
            return self._forward_response_rows(batch, micro_batch_size, packing, topk, per_token=1 + 2 * k)

    def _scored_logprobs(self, logits: torch.Tensor, mb: MicroBatch, temperature: float, *, with_entropy: bool,
                         grad_into_logits: bool = False, topk_ids: torch.Tensor | None = None):
        """Log-probs (and entropy) of the response rows the output layer scored (`_logits_of_scored_rows`); with
        `topk_ids` also those of the given ids at each response position (a third value)."""
        return response_logprobs_from_logits(logits, mb, temperature, with_entropy=with_entropy,
                                             parallel=self.parallel,
                                             chunk_tokens=self.logprob_chunk_tokens, rows_selected=True,
                                             chunk_bytes=self.accelerator.chunk_bytes_in_cache,
                                             grad_into_logits=grad_into_logits, topk_ids=topk_ids)

    def _forward_response_rows(self, batch: RolloutBatch, micro_batch_size: int, packing: Packing | None,
                               per_micro_batch: Callable, per_token: int | None = None) -> torch.Tensor:
        """Forward only: per_micro_batch(mb, model output) -> [b, response_width] on the last stage, assembled in
        the batch's sample order and broadcast to every rank (the actor's log-probs, the critic's values)."""

        def collect(mb: MicroBatch, output: torch.Tensor, non_loss_data: bool = True):
            return per_micro_batch(mb, output)

        self.model.eval()
        micro_batches = self._micro_batches(batch, micro_batch_size, packing)
        with self.accelerator.megatron_context():
            outputs = self._run_schedule(micro_batches, collect, forward_only=True, collect_non_loss_data=True)
        shape = (*batch.response_logprobs_shape, *((per_token,) if per_token else ()))
        return self._from_last_stage(_in_batch_order(outputs, micro_batches), shape)

    def train_step(self, batch: RolloutBatch, *, micro_batch_size: int, temperature: float,
                   loss_fn: Callable, packing: Packing | None = None) -> dict[str, float]:
        """One optimizer step on `batch` (this DP rank's part of one mini-batch), then one LR step.

        loss_fn(logprobs, entropy, mb) -> (loss, stats) must already be normalised by the whole
        mini-batch's token count, so the micro-batch losses (and stats) of all DP ranks add up to
        the mini-batch's. The returned stats are those sums, the same on every rank, plus
        `actor/grad_norm` and `actor/lr` (the learning rate this step used).
        """

        def loss_from_output(mb: MicroBatch, logits: torch.Tensor):
            # The head's output is read once: its gradient may take its storage. A distillation teacher's top-k ids
            # (the batch's TEACHER_TOPK_COLUMN) are scored by the same pass: the loss gets their log-probs too.
            teacher = mb.extras.get(TEACHER_TOPK_COLUMN)
            if teacher is None:
                return loss_fn(*self._scored_logprobs(logits, mb, temperature, with_entropy=True,
                                                      grad_into_logits=True), mb)
            k = (teacher.shape[-1] - 1) // 2
            logprobs, entropy, student_topk = self._scored_logprobs(
                logits, mb, temperature, with_entropy=True, grad_into_logits=True, topk_ids=teacher[..., 1 + k:].long())
            return loss_fn(logprobs, entropy, mb, student_topk_logprobs=student_topk)

        with self._logits_of_scored_rows():
            return self._optimizer_step(batch, micro_batch_size, packing, loss_from_output)

    def _optimizer_step(self, batch: RolloutBatch, micro_batch_size: int, packing: Packing | None,
                        loss_from_output: Callable, metrics_prefix: str = "actor") -> dict[str, float]:
        """The step behind `train_step`: loss_from_output(mb, model output) -> (loss, stats) per micro-batch."""
        from megatron.core.optimizer_param_scheduler import get_canonical_lr_for_logging

        assert self.optimizer is not None, "train_step on a model built without optimizer"
        micro_batches = self._micro_batches(batch, micro_batch_size, packing)
        num_micro_batches = len(micro_batches)
        dp_size = self.parallel.dp

        def loss_func(mb: MicroBatch, output: torch.Tensor):
            loss, stats = loss_from_output(mb, output)
            # The schedule divides by the number of micro-batches and DDP averages over DP ranks;
            # our loss is already a mini-batch token mean, so undo both.
            return loss * num_micro_batches * dp_size, stats

        self.model.train()
        with self.accelerator.megatron_context():
            self.model.zero_grad_buffer()
            self.optimizer.zero_grad()
            stats_per_mb = self._run_schedule(micro_batches, loss_func, forward_only=False, collect_non_loss_data=False)
            lr = get_canonical_lr_for_logging(self.optimizer.param_groups)
            update_successful, grad_norm, _ = self.optimizer.step()
            self.scheduler.step(increment=1)
        assert update_successful, "fp32/bf16 optimizer steps never skip"
        stats = {k: (max if k in MAX_REDUCED_STATS else sum)(s[k] for s in stats_per_mb)
                 for k in stats_per_mb[0]} if stats_per_mb else {}
        stats = self._sum_over_data_parallel(self._stats_from_last_stage(stats))
        stats[f"{metrics_prefix}/grad_norm"] = float(grad_norm) if grad_norm is not None else 0.0
        stats[f"{metrics_prefix}/lr"] = float(lr)
        return stats

    def _micro_batches(self, batch: RolloutBatch, micro_batch_size: int, packing: Packing | None) -> list[MicroBatch]:
        if packing is not None:
            if not self.packed_sequences:
                raise ValueError("packed micro-batches need the model built with ModelOptions(packed_sequences=True)")
            # With sequence parallel every packed row splits evenly over the TP ranks; with context parallelism
            # every sample into 2 CP chunks, and a rank's part of the row again over its TP ranks.
            tp_multiple = self.tp if self.module.config.sequence_parallel else 1
            sample_multiple = self.parallel.layout.sequence_chunks
            packing = replace(packing, multiple=tp_multiple * sample_multiple, sample_multiple=sample_multiple)
        return batch.micro_batches(micro_batch_size, self.accelerator.device, packing)

    # -- pipeline helpers ----------------------------------------------------------------------
    def _from_last_stage(self, tensor: torch.Tensor | None, shape: tuple[int, int]) -> torch.Tensor:
        if self.pp == 1:
            return tensor.cpu()
        buffer = tensor if tensor is not None else torch.empty(shape, dtype=torch.float32, device=self.accelerator.device)
        dist.broadcast(buffer, src=self.parallel.pp_last_rank, group=self.parallel.pp_group)
        return buffer.cpu()

    def _stats_from_last_stage(self, stats: dict[str, float]) -> dict[str, float]:
        if self.pp == 1:
            return stats
        box = [stats if self.parallel.last_stage else None]
        dist.broadcast_object_list(box, src=self.parallel.pp_last_rank, group=self.parallel.pp_group)
        return box[0]

    def over_data_parallel(self, count: float) -> float:
        """`count` over this rank's share of a mini-batch, summed over the DP ranks: the whole mini-batch's (the
        loss's denominator; exact for counts below 2^53)."""
        return self._sum_over_data_parallel({"count": count})["count"]

    def _sum_over_data_parallel(self, stats: dict[str, float]) -> dict[str, float]:
        """Each DP rank holds its share of the mini-batch's loss stats (its tokens over the whole
        mini-batch's count); their sum over the DP group is the mini-batch value. Summed here,
        where the DP split is known (the loss itself undoes DDP's averaging above), so every rank
        returns the true value; a driver-side merge cannot tell DP replicas from TP/PP copies."""
        if self.parallel.dp == 1 or not stats:
            return stats
        out = {}
        for op, keys in ((dist.ReduceOp.SUM, sorted(k for k in stats if k not in MAX_REDUCED_STATS)),
                         (dist.ReduceOp.MAX, sorted(k for k in stats if k in MAX_REDUCED_STATS))):
            if keys:
                values = torch.tensor([stats[k] for k in keys], dtype=torch.float64, device=self.accelerator.device)
                dist.all_reduce(values, op=op, group=self.parallel.dp_group)
                out |= dict(zip(keys, values.tolist()))
        return out

    # -- weights -------------------------------------------------------------------------------
    def named_weights(self) -> Mapping[str, torch.Tensor]:
        """This rank's Megatron shards, by `named_parameters()` name (the resharding sources), and the buffers the
        layouts move; with LoRA the backbone's names, each adapted weight merged with its adapter when read."""
        return ChainMap(layout_buffers(self.module), MergedWeights(self.module))

    @contextlib.contextmanager
    def adapters_disabled(self):
        """The backbone without the adapters while the context lasts (LoRA's shared-backbone reference; its routers
        route on their own: the reference is not the policy that sampled)."""
        from mindspeed_rl.models.lora import adapters_disabled

        with adapters_disabled(self.module), (self.routing_replay.paused() if self.routing_replay is not None
                                              else contextlib.nullcontext()):
            yield

    def routing_metrics(self) -> dict[str, float]:
        """The forwards' routing since the last call against vLLM's recorded routes (RoutingReplay.metrics)."""
        if self.routing_replay is None:
            return {}
        return self.routing_replay.metrics(self.parallel, sequence_parallel=self.module.config.sequence_parallel,
                                           device=self.accelerator.device)

    def sharded_state_dict(self) -> dict:
        """The module's Megatron sharded state dict in the checkpoints' format (engines/dist_checkpoint.py); with
        MindSpeed-RL's lora_ckpt_filter, the adapters only."""
        from mindspeed_rl.engines.dist_checkpoint import model_sharded_state_dict

        return saved_state(model_sharded_state_dict(self.module), adapters_only=self.lora_filter)

    # -- distributed checkpoints (mindspeed_rl/checkpoint/FORMAT.md) ------------------------------
    def save_sharded(self, checkpoint_dir: str, *, with_optimizer: bool) -> dict | None:
        """Collective: the model (and optimizer) under `checkpoint_dir` (model/, optimizer/), loadable at any
        TP/PP/EP/CP/DP layout. Returns the scheduler's state_dict (for trainer_state.json) or None."""
        from mindspeed_rl.engines.dist_checkpoint import save_engine

        with self.accelerator.megatron_context():
            save_engine(self, checkpoint_dir, with_optimizer=with_optimizer)
        return self.scheduler.state_dict() if self.scheduler is not None else None

    def load_sharded(self, checkpoint_dir: str, *, load_optimizer: bool, scheduler_state: dict | None) -> None:
        """Collective: the inverse of `save_sharded`, into this rank's layout."""
        from mindspeed_rl.engines.dist_checkpoint import load_engine

        with self.accelerator.megatron_context():
            load_engine(self, checkpoint_dir, load_optimizer=load_optimizer)
            if scheduler_state is not None and self.scheduler is not None:
                self.scheduler.load_state_dict(scheduler_state)
