"""On-policy distillation's teacher (distillation.teacher_models, config/distillation.py): its log-prob of each token the
student sampled, for the distillation loss (algorithms/distillation.py). A forward-only Megatron model of its own
checkpoint (the student's tokenizer; another size), in the actor's TP/PP layout, resident in its `teacher_logprob`
phase only: the reference's way, with the teacher's weights."""
from __future__ import annotations

import torch

from mindspeed_rl.memory.residency import TEACHER_LOGPROB, TEACHER_PARAMS
from mindspeed_rl.protocol import RolloutBatch
from mindspeed_rl.workers.dispatch import TRAIN_DP, Dispatch
from mindspeed_rl.workers.parts import MEGATRON, Part
from mindspeed_rl.workers.actor_steps import packing_for
from mindspeed_rl.workers.phase_rpc import phase_rpc

# verl forces the teacher's temperature to 1: it scores given tokens, nothing is sampled from it.
TEACHER_TEMPERATURE = 1.0


class TeacherPart(Part):
    NAME = "teacher"
    STATES = frozenset({TEACHER_PARAMS})
    STAGE = MEGATRON

    def build(self) -> None:
        from dataclasses import replace

        from mindspeed_rl.engines.megatron_engine import MegatronEngine
        from mindspeed_rl.memory.megatron_states import register_teacher_states
        from mindspeed_rl.workers.engine_builders import params_dtype

        ctx = self.context
        spec, state = ctx.hf_checkpoint(self.config.distillation.teacher.model_path)
        # Its own layer count: the actor's num_layer_list does not describe it (even stages; checked at start).
        self.teacher = MegatronEngine(spec=replace(spec, pipeline_stage_layers=None), hf_state=state,
                                      params_dtype=params_dtype(self.config), accelerator=ctx.accelerator,
                                      parallel=ctx.groups, optimizer=None, options=ctx.model_options())
        ctx.progress("Megatron teacher built")
        register_teacher_states(ctx.offloader, self.teacher)

    @phase_rpc(TEACHER_LOGPROB, progress="teacher log-probs", dispatch=Dispatch(TRAIN_DP, "batch"))
    def compute_teacher_log_prob(self, batch: RolloutBatch) -> tuple[torch.Tensor, dict[str, float]]:
        """The teacher's log-prob of every response token of this rank's share (at temperature 1); with a top-k loss
        mode also its k most likely tokens' log-probs and ids there (protocol.TEACHER_TOPK_COLUMN's layout)."""
        in_phase = self.ledger.record(TEACHER_LOGPROB)
        rl, loss = self.config.rl_config, self.config.distillation.distillation_loss
        forward = dict(micro_batch_size=rl.ref_forward_micro_batch_size or self.config.actor_config.micro_batch_size,
                       temperature=TEACHER_TEMPERATURE, packing=packing_for(rl, "ref"))
        if loss.uses_topk:  # [n, R, 1 + 2k]: also its k most likely tokens at each position (vocabulary-parallel)
            return self.teacher.compute_topk_logprobs(batch, k=loss.topk, **forward), in_phase.metrics()
        return self.teacher.compute_logprobs(batch, **forward), in_phase.metrics()
