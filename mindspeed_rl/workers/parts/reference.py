"""The reference model: its log-probs for the KL term. With LoRA's shared backbone (rl_config.share_backbone) it is the
training engine's backbone with the adapters off, and builds nothing of its own."""
from __future__ import annotations

import contextlib
import time

from mindspeed_rl.memory.residency import REF_LOGPROB, REF_PARAMS
import torch

from mindspeed_rl.protocol import RolloutBatch
from mindspeed_rl.workers.dispatch import TRAIN_DP, Dispatch
from mindspeed_rl.workers.parts import MEGATRON, Part
from mindspeed_rl.workers.parts.training import TrainingPart, forward_logprobs
from mindspeed_rl.workers.phase_rpc import phase_rpc


class ReferencePart(Part):
    NAME = "reference"
    STATES = frozenset({REF_PARAMS})
    STAGE = MEGATRON

    # Under LoRA's shared backbone (rl_config.share_backbone) the reference is the training engine's backbone.
    BORROWS = (TrainingPart.NAME,)

    def build(self) -> None:
        from mindspeed_rl.memory.megatron_states import register_reference_states
        from mindspeed_rl.workers import engine_builders as build

        ctx = self.context
        if self.config.reference_is_backbone:
            self.reference = None
            return
        self.reference = build.build_reference(self.config, ctx.accelerator, ctx.model_options(), parallel=ctx.groups,
                                               checkpoint=ctx.hf_checkpoint(ctx.ref_model_dir), progress=ctx.progress)
        register_reference_states(ctx.offloader, self.reference)

    @phase_rpc(REF_LOGPROB, progress="reference log-probs", dispatch=Dispatch(TRAIN_DP, "batch"))
    def compute_ref_log_prob(self, batch: RolloutBatch) -> tuple[torch.Tensor, dict[str, float]]:
        """The reference model's log-probs of this rank's share; with LoRA's shared backbone, the actor's with its
        adapters off."""
        in_phase = self.ledger.record(REF_LOGPROB)
        engine = self.reference or self.borrowed[TrainingPart.NAME].actor
        with contextlib.nullcontext() if self.reference is not None else engine.adapters_disabled():
            logprobs = forward_logprobs(self, engine, batch, reference=True)
        return logprobs, in_phase.metrics()

    @phase_rpc(REF_LOGPROB, label="load_reference", progress="reference load")
    def load_reference_checkpoint(self, checkpoint_dir: str) -> dict[str, float]:
        """Collective: the reference model's weights from one of our checkpoints (its model/ part), into
        this rank's layout; the reference is resident only while they load."""
        started = time.perf_counter()
        self.reference.load_sharded(checkpoint_dir, load_optimizer=False, scheduler_state=None)
        return {"timing/load_reference": time.perf_counter() - started}
