"""An exactly on-policy update (one epoch of one mini-batch, sampled by the weights that train) takes its old
log-probs from its own first forward, detached, instead of a separate forward pass (GRPOConfig.old_logprobs_from_update,
as TRL's GRPO does). Oracle: today's path, the old log-probs of a separate pass with the same micro-batches: the loss
stats, every gradient and the weights after the step are bit-equal (torch.equal), padded and packed; the rollout
mismatch the update measures equals trainer/metrics.rollout_mismatch of the separate pass.

Runs where: in the pytest process, a 1-rank gloo world (shared with the other single-rank tests).
"""
import pytest
import torch

from mindspeed_rl.algorithms.grpo import GRPOLossConfig
from mindspeed_rl.data.tiny_model import create_tiny_qwen2_checkpoint
from mindspeed_rl.engines.megatron_engine import MegatronEngine, OptimizerSettings
from mindspeed_rl.models.checkpoint import load_hf_checkpoint
from mindspeed_rl.models.qwen2 import ModelOptions
from mindspeed_rl.parallel import megatron_state
from mindspeed_rl.protocol import Packing, RolloutBatch
from mindspeed_rl.trainer.metrics import rollout_mismatch
from mindspeed_rl.workers.actor_steps import train_on_mini_batch

LOSS = GRPOLossConfig(clip_ratio=0.2, kl_penalty="low_var_kl", kl_coef=0.05, entropy_coeff=0.01, clip_ratio_c=3.0)
ADAM = OptimizerSettings(lr=1e-3, min_lr=0.0, weight_decay=0.01, adam_beta1=0.9, adam_beta2=0.95, adam_eps=1e-8,
                         clip_grad=1.0)
MICRO_BATCH = 3


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    out = tmp_path_factory.mktemp("tiny_on_policy") / "model"
    create_tiny_qwen2_checkpoint(out, vocab_size=64, hidden_size=64, ffn_hidden_size=128, num_layers=2,
                                 num_attention_heads=4, num_query_groups=2, seed=23)
    return str(out)


def _rollout() -> RolloutBatch:
    g = torch.Generator().manual_seed(4)
    prompts = [torch.randint(1, 64, (int(n),), generator=g).tolist() for n in torch.randint(2, 7, (6,), generator=g)]
    responses = [torch.randint(1, 64, (int(n),), generator=g).tolist() for n in torch.randint(1, 7, (6,), generator=g)]
    batch = RolloutBatch.from_token_lists(prompts, responses, pad_id=0, response_width=6)
    mask = batch.response_mask
    batch.columns["ref_logprobs"] = (-1.0 + 0.3 * torch.randn(mask.shape, generator=g)) * mask
    batch.columns["rollout_logprobs"] = (-1.0 + 0.2 * torch.randn(mask.shape, generator=g)) * mask
    batch.columns["advantages"] = torch.randn(len(batch), 1, generator=g).expand_as(mask) * mask
    return batch


def _step(checkpoint, world, batch, packing):
    spec, state = load_hf_checkpoint(checkpoint)
    engine = MegatronEngine(spec=spec, hf_state=state, params_dtype=torch.float32, accelerator=world,
                            parallel=megatron_state.current(), optimizer=ADAM,
                            options=ModelOptions(packed_sequences=packing is not None))
    if "old_logprobs" in batch.columns:  # today's path: a separate pass with the update's micro-batches
        batch.columns["old_logprobs"] = engine.compute_logprobs(batch, micro_batch_size=MICRO_BATCH, temperature=1.0,
                                                                packing=packing)
    stats = train_on_mini_batch(engine, batch, LOSS, micro_batch_size=MICRO_BATCH, temperature=1.0, packing=packing)
    grads = {name: p.main_grad.clone() for name, p in engine.module.named_parameters()}
    weights = {name: p.detach().clone() for name, p in engine.module.named_parameters()}
    return stats, grads, weights


@pytest.mark.parametrize("packing", [None, Packing()], ids=["padded", "packed"])
def test_the_update_gives_the_old_log_probs_bit_equal_to_a_separate_pass(world, checkpoint, packing):
    separate = _rollout()
    separate.columns["old_logprobs"] = torch.zeros_like(separate.response_mask)  # filled by the pass
    want_stats, want_grads, want_weights = _step(checkpoint, world, separate, packing)
    got_stats, got_grads, got_weights = _step(checkpoint, world, _rollout(), packing)
    for key in ("actor/pg_loss", "actor/kl_loss", "actor/entropy", "actor/pg_clipfrac", "actor/ppo_kl",
                "actor/grad_norm"):
        assert got_stats[key] == want_stats[key], key
    assert all(torch.equal(got_grads[name], want_grads[name]) for name in want_grads)
    assert all(torch.equal(got_weights[name], want_weights[name]) for name in want_weights)
    assert any(g.abs().sum() > 0 for g in got_grads.values())
    mismatch = rollout_mismatch(separate.columns["rollout_logprobs"], separate.columns["old_logprobs"],
                                separate.loss_mask())
    assert got_stats["rollout/logprob_max_abs_diff"] == mismatch["rollout/logprob_max_abs_diff"]
    assert got_stats["rollout/logprob_mean_abs_diff"] == pytest.approx(mismatch["rollout/logprob_mean_abs_diff"],
                                                                       rel=1e-6)


@pytest.mark.parametrize("overrides, on_policy", [
    ((), False),  # the demo: 2 mini-batches per iteration
    (("rl_config.mini_batch_size=16",), True),
    (("rl_config.mini_batch_size=16", "rl_config.epochs=2"), False),
    (("rl_config.mini_batch_size=16", "rl_config.old_logprobs_from_update=false"), False),
])
def test_the_separate_pass_is_skipped_only_where_the_update_is_on_policy(overrides, on_policy):
    from mindspeed_rl.memory.residency import OLD_LOGPROB
    from mindspeed_rl.workers.roles import actor_worker
    from tests.test_config import TINY, load

    config = load(TINY, *overrides)
    assert config.old_logprobs_from_update is on_policy
    phases = actor_worker(config).residency_policy_of(config).phases()  # the table the colocated rank runs
    assert (OLD_LOGPROB in phases) is not on_policy


def test_ppo_with_the_kl_in_the_reward_keeps_the_separate_pass():
    """The KL in PPO's reward is read before the update (trainer/critic_step.py)."""
    from tests.test_config import load

    assert load("ppo_tiny_cpu", "rl_config.mini_batch_size=16").old_logprobs_from_update is True
    assert load("ppo_tiny_cpu", "rl_config.mini_batch_size=16",
                "rl_config.use_kl_in_reward=true").old_logprobs_from_update is False
