"""PPO's critic: the value model, its values of a rollout, its update and its checkpoints (under <checkpoint>/critic).
On the actor's ranks (colocated or the training ranks of a disaggregated actor) or on ranks of its own
(workers/own_groups.py), where its states stay on the device."""
from __future__ import annotations

import os
import time

from mindspeed_rl.memory.residency import CRITIC_STATES, CRITIC_UPDATE, CRITIC_VALUES
import torch

from mindspeed_rl.protocol import RolloutBatch
from mindspeed_rl.workers import critic_steps
from mindspeed_rl.workers.critic_steps import critic_values, update_critic
from mindspeed_rl.workers.dispatch import TRAIN_DP, Dispatch
from mindspeed_rl.workers.parts import MEGATRON, Checkpointed, Part
from mindspeed_rl.workers.phase_rpc import phase_rpc


class CriticPart(Part):
    NAME = "critic"
    STATES = CRITIC_STATES
    STAGE = MEGATRON
    CHECKPOINT = Checkpointed(save="save_critic_checkpoint", load="load_critic_checkpoint", state_key="critic_scheduler")

    def build(self) -> None:
        from mindspeed_rl.engines.critic import register_critic_states

        ctx = self.context
        self.critic_shuffler = critic_steps.critic_shuffler(self.config)
        alone = ctx.part_names == (self.NAME,)
        self.critic = critic_steps.build_critic(
            self.config, ctx.accelerator, ctx.model_options(), model_dir=ctx.model_dir, parallel=ctx.groups,
            progress=lambda step: ctx.progress(f"critic ranks: {step}" if alone else step))
        register_critic_states(ctx.offloader, self.critic)

    @phase_rpc(CRITIC_VALUES, progress="critic values", dispatch=Dispatch(TRAIN_DP, "batch"))
    def compute_values(self, batch: RolloutBatch) -> tuple[torch.Tensor, dict[str, float]]:
        in_phase = self.ledger.record(CRITIC_VALUES)
        return critic_values(self.critic, self.config, batch), in_phase.metrics()

    @phase_rpc(CRITIC_UPDATE, progress="critic update", dispatch=Dispatch(TRAIN_DP, "batch"))
    def update_critic(self, batch: RolloutBatch) -> dict[str, float]:
        from mindspeed_rl.memory import ActivationMeter

        guard = self.ledger.activation_guard(CRITIC_UPDATE, self.context.offloader.resident_bytes())
        with ActivationMeter(self.context.offloader.storage_keys(), on_grow=guard) as activations:
            metrics = update_critic(self.critic, self.config, batch, self.critic_shuffler)
            in_phase = self.ledger.record(CRITIC_UPDATE, extra={"activations": activations.peak_bytes})
        return {**metrics, **in_phase.metrics()}

    @phase_rpc(CRITIC_UPDATE, label="save_critic", progress="checkpoint save")
    def save_critic_checkpoint(self, checkpoint_dir: str, *, with_optimizer: bool = True,
                               with_rng: bool = True) -> tuple[dict | None, dict[str, float]]:
        """Collective over the critic's ranks: its model, optimizer and mini-batch order under <checkpoint>/critic
        (rng/ per rank); returns its scheduler state."""
        from mindspeed_rl.checkpoint.rng_state import save_rng_state

        started = time.perf_counter()
        critic_dir = os.path.join(checkpoint_dir, "critic")
        state = self.critic.save_sharded(critic_dir, with_optimizer=with_optimizer)
        if with_rng:
            save_rng_state(critic_dir, self.context.rank_info.rank, {"critic_shuffler": self.critic_shuffler.generator})
        return state, {"timing/save_critic": time.perf_counter() - started}

    @phase_rpc(CRITIC_UPDATE, label="load_critic", progress="checkpoint load")
    def load_critic_checkpoint(self, checkpoint_dir: str, *, load_optimizer: bool, load_rng: bool,
                               scheduler_state: dict | None) -> dict[str, float]:
        """The inverse of save_critic_checkpoint. Where the critic shares the actor's ranks, the actor's RNG
        states (loaded before) are the same ones again."""
        from mindspeed_rl.checkpoint.rng_state import load_rng_state

        started = time.perf_counter()
        critic_dir = os.path.join(checkpoint_dir, "critic")
        self.critic.load_sharded(critic_dir, load_optimizer=load_optimizer, scheduler_state=scheduler_state)
        if load_rng:
            load_rng_state(critic_dir, self.context.rank_info.rank, {"critic_shuffler": self.critic_shuffler.generator})
        return {"timing/load_critic": time.perf_counter() - started}
