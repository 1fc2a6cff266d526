"""Megatron dist checkpoints of the actor (model + optimizer + scheduler) on one gloo rank: real Megatron."""

import torch

from mindspeed_rl.checkpoint import begin_save, commit_save, resolve_and_verify
from mindspeed_rl.checkpoint.rng_state import load_rng_state, save_rng_state
from mindspeed_rl.data.tiny_model import create_tiny_qwen2_checkpoint
from mindspeed_rl.engines.megatron_engine import MegatronEngine, OptimizerSettings
from mindspeed_rl.models.checkpoint import load_hf_checkpoint
from mindspeed_rl.parallel import megatron_state
from mindspeed_rl.protocol import RolloutBatch

ADAM = OptimizerSettings(lr=1e-2, min_lr=0.0, weight_decay=0.0, adam_beta1=0.9, adam_beta2=0.95, adam_eps=1e-8,
                         clip_grad=1.0)
PROMPTS = [[5, 9, 6, 11], [7, 9, 8, 11]]
RESPONSES = [[3, 4, 5], [6, 7]]


def _batch() -> RolloutBatch:
    return RolloutBatch.from_token_lists(PROMPTS, RESPONSES, pad_id=0, response_width=4)


def _loss_fn(logprobs, entropy, mb):  # push up the given tokens: a real, visible update
    loss = -(logprobs * mb.response_mask).sum() / 5.0
    return loss, {"loss": loss.item()}


def _step(engine) -> dict:
    return engine.train_step(_batch(), micro_batch_size=2, temperature=1.0, loss_fn=_loss_fn)


def _engine(world, hf_dir) -> MegatronEngine:
    spec, state = load_hf_checkpoint(hf_dir)
    return MegatronEngine(spec=spec, hf_state=state, params_dtype=torch.float32, accelerator=world,
                          parallel=megatron_state.current(), optimizer=ADAM)


def test_resumed_engine_continues_bit_identically(world, tmp_path):
    hf_dir = tmp_path / "hf"
    create_tiny_qwen2_checkpoint(hf_dir, vocab_size=64, hidden_size=64, ffn_hidden_size=128, num_layers=2,
                                 num_attention_heads=4, num_query_groups=2, seed=3)
    original = _engine(world, str(hf_dir))
    for _ in range(2):
        _step(original)
    tmp = begin_save(tmp_path / "save", 2)
    scheduler_state = original.save_sharded(str(tmp), with_optimizer=True)
    save_rng_state(tmp, 0)
    commit_save(tmp, 2, keep_last_n=None)
    expected_stats = _step(original)
    expected_weights = {k: v.clone() for k, v in original.named_weights().items()}

    verified = resolve_and_verify(tmp_path / "save", key="actor_config.load")
    resumed = _engine(world, str(hf_dir))  # starts from the initial HF weights, as a resumed run does
    resumed.load_sharded(str(verified.path), load_optimizer=True, scheduler_state=scheduler_state)
    load_rng_state(verified.path, 0)
    stats = _step(resumed)
    assert stats == expected_stats
    for name, tensor in resumed.named_weights().items():
        assert torch.equal(tensor, expected_weights[name]), name
