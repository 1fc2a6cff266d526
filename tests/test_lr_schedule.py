"""LR warmup and decay through Megatron's OptimizerParamScheduler, stepped once per optimizer step,
checked against the closed-form schedule; and the schedule's length read from a real config.

Runs where: in the pytest process, a 1-rank gloo world (shared with the other single-rank tests).
"""
import math
from pathlib import Path

import pytest
import torch
from hydra import compose, initialize_config_dir

from mindspeed_rl.config import ConfigError, load_config
from mindspeed_rl.data.tiny_model import create_tiny_qwen2_checkpoint
from mindspeed_rl.engines.megatron_engine import LRSchedule, MegatronEngine, OptimizerSettings
from mindspeed_rl.models.checkpoint import load_hf_checkpoint
from mindspeed_rl.parallel import megatron_state
from mindspeed_rl.protocol import RolloutBatch
from mindspeed_rl.workers.actor_steps import lr_schedule, optimizer_steps_per_iteration

CONFIG_DIR = Path(__file__).resolve().parents[1] / "configs"
MAX_LR, MIN_LR, WARMUP, TOTAL = 1e-2, 1e-3, 3, 10


def expected_lr(step: int) -> float:
    """Linear warmup from 0, then cosine from MAX_LR down to MIN_LR at TOTAL (Megatron's formula)."""
    if step <= WARMUP:
        return MAX_LR * step / WARMUP
    ratio = (step - WARMUP) / (TOTAL - WARMUP)
    return MIN_LR + 0.5 * (math.cos(math.pi * ratio) + 1.0) * (MAX_LR - MIN_LR)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    out = tmp_path_factory.mktemp("tiny_lr") / "model"
    create_tiny_qwen2_checkpoint(out, vocab_size=64, hidden_size=64, ffn_hidden_size=128, num_layers=1,
                                 num_attention_heads=4, num_query_groups=2, seed=21)
    return str(out)


def _batch() -> RolloutBatch:
    g = torch.Generator().manual_seed(4)
    prompts = [torch.randint(1, 64, (3,), generator=g).tolist() for _ in range(4)]
    responses = [torch.randint(1, 64, (4,), generator=g).tolist() for _ in range(4)]
    return RolloutBatch.from_token_lists(prompts, responses, pad_id=0, response_width=4)


def _loss_fn(batch):
    def loss_fn(logprobs, entropy, mb):
        loss = -(logprobs * mb.response_mask).sum() / batch.response_mask.sum()
        return loss, {"loss": loss.item()}
    return loss_fn


def _train(world, checkpoint, steps: int):
    spec, state = load_hf_checkpoint(checkpoint)
    settings = OptimizerSettings(lr=MAX_LR, min_lr=MIN_LR, weight_decay=0.01, adam_beta1=0.9, adam_beta2=0.95,
                                 adam_eps=1e-8, clip_grad=1.0,
                                 schedule=LRSchedule(decay_style="cosine", warmup_steps=WARMUP, decay_steps=TOTAL))
    actor = MegatronEngine(spec=spec, hf_state=state, params_dtype=torch.float32, accelerator=world,
                           parallel=megatron_state.current(), optimizer=settings)
    batch = _batch()
    lrs, changed = [], []
    for _ in range(steps):
        before = [p.detach().clone() for p in actor.module.parameters()]
        lrs.append(actor.train_step(batch, micro_batch_size=4, temperature=1.0, loss_fn=_loss_fn(batch))["actor/lr"])
        changed.append(any(not torch.equal(a, b) for a, b in zip(before, actor.module.parameters())))
    return lrs, changed


def test_logged_lr_follows_warmup_then_cosine(world, checkpoint):
    lrs, _ = _train(world, checkpoint, TOTAL + 2)
    want = [expected_lr(step) if step <= TOTAL else MIN_LR for step in range(TOTAL + 2)]
    assert lrs == pytest.approx(want, rel=1e-12, abs=1e-15)


def test_first_warmup_step_runs_at_lr_zero(world, checkpoint):
    """The optimizer really uses the scheduled rate: at lr 0 Adam (and its decoupled weight decay)
    leaves every weight as it was; the next step moves them."""
    _, changed = _train(world, checkpoint, 2)
    assert changed == [False, True]


def _config(overrides):
    with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base="1.3"):
        return load_config(compose(config_name="grpo_tiny_cpu", overrides=overrides))


def test_schedule_spans_every_optimizer_step_of_the_run():
    # 16 prompts x 16 samples in mini-batches of 8 prompts: 2 steps a pass, 3 passes, 7 iterations.
    cfg = _config(["megatron_training.train_iters=7", "rl_config.epochs=3", "rl_config.mini_batch_size=8",
                   "actor_config.lr_warmup_fraction=0.25", "actor_config.lr_decay_style=linear"])
    assert optimizer_steps_per_iteration(cfg) == 6
    assert lr_schedule(cfg) == LRSchedule(decay_style="linear", warmup_steps=0.25 * 42, decay_steps=42)


def test_wsd_without_its_anneal_length_is_a_config_error():
    with pytest.raises(ConfigError, match="actor_config.lr_decay_style"):
        _config(["actor_config.lr_decay_style=WSD"])


def test_warmup_over_the_whole_run_is_a_config_error():
    with pytest.raises(ConfigError, match="actor_config.lr_warmup_fraction"):
        _config(["actor_config.lr_warmup_fraction=1.0"])
