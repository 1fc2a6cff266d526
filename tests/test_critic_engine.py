"""The critic on packed micro-batches (rl_config.use_remove_padding) computes what it computes padded: values and one
value-loss step. In the pytest process, one gloo rank."""

import pytest
import torch

from mindspeed_rl.data.tiny_model import create_tiny_qwen2_checkpoint
from mindspeed_rl.parallel import megatron_state
from mindspeed_rl.protocol import Packing, RolloutBatch

ADAM = dict(lr=1e-3, min_lr=0.0, weight_decay=0.0, adam_beta1=0.9, adam_beta2=0.95, adam_eps=1e-8, clip_grad=1.0)


def _critic(world, model_dir: str, packed: bool):
    from mindspeed_rl.engines.critic import CriticEngine
    from mindspeed_rl.engines.megatron_engine import OptimizerSettings
    from mindspeed_rl.models.checkpoint import load_hf_checkpoint
    from mindspeed_rl.models.qwen2 import ModelOptions

    spec, state = load_hf_checkpoint(model_dir)
    return CriticEngine(spec=spec, hf_state=state, params_dtype=torch.float32, accelerator=world,
                        parallel=megatron_state.current(),
                        optimizer=OptimizerSettings(**ADAM), options=ModelOptions(packed_sequences=packed), head_seed=3)


def test_packed_values_and_step_equal_the_padded_ones(world, tmp_path):
    from mindspeed_rl.algorithms.ppo import clipped_value_loss

    model_dir = str(tmp_path / "model")
    create_tiny_qwen2_checkpoint(model_dir, vocab_size=64, hidden_size=64, ffn_hidden_size=128, num_layers=2,
                                 num_attention_heads=4, num_query_groups=2, seed=5)
    generator = torch.Generator().manual_seed(2)
    prompts = [torch.randint(1, 63, (n,), generator=generator).tolist() for n in (3, 6, 2, 4)]
    responses = [torch.randint(1, 63, (n,), generator=generator).tolist() for n in (4, 1, 5, 2)]
    batch = RolloutBatch.from_token_lists(prompts, responses, pad_id=0, response_width=5)
    results = []
    for packing in (None, Packing()):
        critic = _critic(world, model_dir, packed=packing is not None)
        values = critic.compute_values(batch, micro_batch_size=2, packing=packing)
        batch.columns.update(values=values, returns=(values + 1.0) * batch.response_mask)
        stats = critic.train_step(batch, micro_batch_size=2, packing=packing, loss_fn=lambda v, mb: clipped_value_loss(
            v, mb.extras["values"], mb.extras["returns"], mb.response_mask, cliprange_value=10.0,
            loss_agg_mode="token-mean", denominator=float(batch.response_mask.sum()),
            mini_batch_tokens=float(batch.response_mask.sum())))
        results.append((values, stats, critic.compute_values(batch, micro_batch_size=2, packing=packing)))
    (padded, padded_stats, padded_after), (packed, packed_stats, packed_after) = results
    assert (packed - padded).abs().max() < 1e-5
    assert abs(packed_stats["critic/vf_loss"] - 0.5) < 1e-6 and abs(padded_stats["critic/vf_loss"] - 0.5) < 1e-6
    assert abs(packed_stats["critic/grad_norm"] - padded_stats["critic/grad_norm"]) < 1e-4 * padded_stats["critic/grad_norm"]
    assert (packed_after - padded_after).abs().max() < 1e-5 and (padded_after - padded).abs().max() > 1e-3


@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm"])
def test_the_critic_update_takes_every_loss_aggregation_with_its_formula(world, tmp_path, mode):
    """PPO with Dr. GRPO's seq-mean-token-sum-norm crashed at the first critic update (no norm_length); each mode's
    value loss is its formula over the values the critic had before the step, the clip fraction a fraction."""
    from mindspeed_rl.workers.critic_steps import critic_shuffler, update_critic
    from tests.test_config import load

    config = load("ppo_tiny_cpu", f"rl_config.loss_agg_mode={mode}", "megatron_training.global_batch_size=2",
                  "rl_config.n_samples_per_prompt=2", "rl_config.mini_batch_size=2", "critic_config.micro_batch_size=2",
                  "actor_config.micro_batch_size=2")
    model_dir = str(tmp_path / "model")
    create_tiny_qwen2_checkpoint(model_dir, vocab_size=64, hidden_size=64, ffn_hidden_size=128, num_layers=2,
                                 num_attention_heads=4, num_query_groups=2, seed=5)
    critic = _critic(world, model_dir, packed=False)
    batch = RolloutBatch.from_token_lists([[1, 2, 3], [4, 5], [6], [7, 8]], [[9, 10, 11], [12], [13, 14], [15]],
                                          pad_id=0, response_width=config.response_length_limit)
    values = critic.compute_values(batch, micro_batch_size=2)
    mask = batch.response_mask
    old, returns = (values + 0.3) * mask, (values - 1.0) * mask  # the first token of each clipped (c = 0.5)
    old[:, 0] = values[:, 0] + 0.9
    batch.columns.update(values=old, returns=returns)
    metrics = update_critic(critic, config, batch, critic_shuffler(config))

    clipped = torch.clamp(values, old - 0.5, old + 0.5)
    per_token = torch.maximum((values - returns) ** 2, (clipped - returns) ** 2) * mask
    length = config.response_length_limit
    want = 0.5 * {"token-mean": per_token.sum() / mask.sum(),
                  "seq-mean-token-mean": (per_token.sum(1) / mask.sum(1)).mean(),
                  "seq-mean-token-sum": per_token.sum(1).mean(),
                  "seq-mean-token-sum-norm": per_token.sum() / (len(batch) * length)}[mode]
    assert metrics["critic/vf_loss"] == pytest.approx(want.item(), rel=1e-5)
    assert metrics["critic/vf_clipfrac"] == pytest.approx(len(batch) / mask.sum().item())  # the first tokens
