"""A reward model (rewards.<name>.model_path) on the actor's training ranks: its score of each sample."""
from __future__ import annotations

from mindspeed_rl.memory.residency import REWARD, REWARD_PARAMS
import torch

from mindspeed_rl.protocol import RolloutBatch
from mindspeed_rl.workers.dispatch import TRAIN_DP, Dispatch
from mindspeed_rl.workers.parts import MEGATRON, Part
from mindspeed_rl.workers.phase_rpc import phase_rpc


class RewardModelPart(Part):
    NAME = "reward model"
    STATES = frozenset({REWARD_PARAMS})
    STAGE = MEGATRON

    def build(self) -> None:
        from mindspeed_rl.engines.reward_model import register_reward_states
        from mindspeed_rl.workers import engine_builders as build

        ctx = self.context
        self.reward_model = build.build_reward_model(self.config, ctx.accelerator, ctx.model_options(),
                                                     parallel=ctx.groups, progress=ctx.progress)
        register_reward_states(ctx.offloader, self.reward_model)

    @phase_rpc(REWARD, progress="reward model", dispatch=Dispatch(TRAIN_DP, "batch"))
    def compute_reward_scores(self, batch: RolloutBatch) -> tuple[torch.Tensor, dict[str, float]]:
        """The reward model's score of each sample of this rank's share (the last real token's head output); the
        reward params are resident only during this call."""
        in_phase = self.ledger.record(REWARD)
        rl = self.config.rl_config
        scores = self.reward_model.compute_scores(
            batch, micro_batch_size=rl.ref_forward_micro_batch_size or self.config.actor_config.micro_batch_size)
        return scores, in_phase.metrics()
