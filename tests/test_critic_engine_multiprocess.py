"""PPO's critic (engines/critic.py) on 2 real gloo ranks, at DP2, TP2, TP2 with sequence parallel, PP2 and CP2:
- its values are HF's (the oracle): `Qwen2ForSequenceClassification`'s trunk times its score head at the position
  before each response token, fp32, < 1e-4; from a causal LM checkpoint, the trunk times the fresh seeded head;
- one optimizer step on the clipped value loss lowers the loss and leaves the same values in every layout.

Runs where: 2 spawned processes (torch.multiprocessing), gloo; one spawn covers the three layouts.
"""
import os

import pytest
import torch
import torch.distributed as dist

from mindspeed_rl.data.tiny_model import create_tiny_qwen2_checkpoint
from mindspeed_rl.data.tiny_reward_model import create_tiny_reward_checkpoint
from mindspeed_rl.parallel import megatron_state
from mindspeed_rl.protocol import RolloutBatch
from resharding_oracle import four_sample_batch, free_port
from preloaded import spawn_ranks

VOCAB, PAD = 64, 63
# (TP, PP, SP, CP) on 2 ranks: (1, 1, False, 1) is DP2; under CP2 each value is read where its position lives.
LAYOUTS = ((1, 1, False, 1), (2, 1, False, 1), (2, 1, True, 1), (1, 2, False, 1), (1, 1, False, 2))
ADAM = dict(lr=1e-3, min_lr=0.0, weight_decay=0.0, adam_beta1=0.9, adam_beta2=0.95, adam_eps=1e-8, clip_grad=1.0)


def _at_response_positions(per_position: torch.Tensor, batch: RolloutBatch) -> torch.Tensor:
    """[b, s] -> [b, response_width]: position prompt_length - 1 + j for response token j, 0 on padding."""
    index = batch.prompt_lengths.unsqueeze(1) - 1 + torch.arange(batch.response_mask.shape[1])
    index = index.clamp(max=per_position.shape[1] - 1)
    return torch.gather(per_position, 1, index) * batch.response_mask


def _hf_values(model_dir: str, batch: RolloutBatch, head: torch.Tensor | None = None) -> torch.Tensor:
    from transformers import AutoModel

    trunk = AutoModel.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="eager").eval()
    if head is None:
        head = _score_weight(model_dir)
    with torch.no_grad():
        hidden = trunk(batch.input_ids).last_hidden_state  # right-padded, causal: pads change nothing before them
    return _at_response_positions((hidden @ head.T)[..., 0], batch)


def _score_weight(model_dir: str) -> torch.Tensor:
    from mindspeed_rl.models.checkpoint import load_hf_checkpoint

    return load_hf_checkpoint(model_dir)[1]["score.weight"]


def _critic(model_dir: str, tp: int, pp: int, sp: bool = False, cp: int = 1):
    from megatron.core import parallel_state as ps

    from mindspeed_rl.accelerator import get_accelerator
    from mindspeed_rl.engines.critic import CriticEngine
    from mindspeed_rl.engines.megatron_engine import OptimizerSettings
    from mindspeed_rl.models.checkpoint import load_hf_checkpoint
    from mindspeed_rl.models.qwen2 import ModelOptions

    ps.initialize_model_parallel(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
                                 context_parallel_size=cp)
    accelerator = get_accelerator("cpu")
    accelerator.seed_model_parallel_rng(1)
    spec, state = load_hf_checkpoint(model_dir)
    return CriticEngine(spec=spec, hf_state=state, params_dtype=torch.float32, accelerator=accelerator,
                        parallel=megatron_state.current(),
                        optimizer=OptimizerSettings(**ADAM), head_seed=7, options=ModelOptions(sequence_parallel=sp))


def _one_step(critic, batch: RolloutBatch, old_values: torch.Tensor, returns: torch.Tensor) -> dict:
    from megatron.core import parallel_state as ps

    from mindspeed_rl.algorithms.ppo import clipped_value_loss

    tokens = float(batch.response_mask.sum())
    dp, dp_rank = ps.get_data_parallel_world_size(), ps.get_data_parallel_rank()
    rows = slice(dp_rank * len(batch) // dp, (dp_rank + 1) * len(batch) // dp)
    part = batch.select(rows)
    part.columns.update(old_values=old_values[rows], returns=returns[rows])

    def loss_fn(values, mb):
        return clipped_value_loss(values, mb.extras["old_values"], mb.extras["returns"], mb.response_mask,
                                  cliprange_value=10.0, loss_agg_mode="token-mean", denominator=tokens,
                                  mini_batch_tokens=tokens)

    return critic.train_step(part, micro_batch_size=1, loss_fn=loss_fn)


def _worker(rank, port, reward_dir, actor_dir, batch, oracle, fresh_oracle, returns, out_dir):
    from megatron.core import parallel_state as ps

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE="2")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=2)
    results = {}
    try:
        for tp, pp, sp, cp in LAYOUTS:
            critic = _critic(reward_dir, tp, pp, sp, cp)
            values = critic.compute_values(batch, micro_batch_size=2)
            stats = _one_step(critic, batch, values, returns)
            after = critic.compute_values(batch, micro_batch_size=2)
            results[(tp, pp, sp, cp)] = dict(values=values, after=after, stats=stats)
            ps.destroy_model_parallel()
        fresh = _critic(actor_dir, 2, 1)
        results["fresh"] = fresh.compute_values(batch, micro_batch_size=2)
        ps.destroy_model_parallel()
        if rank == 0:
            torch.save(results, os.path.join(out_dir, "critic.pt"))
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def spawned(tmp_path_factory):
    root = tmp_path_factory.mktemp("critic")
    actor_dir = root / "actor"
    create_tiny_qwen2_checkpoint(actor_dir, vocab_size=VOCAB, hidden_size=128, ffn_hidden_size=256, num_layers=2,
                                 num_attention_heads=4, num_query_groups=2, seed=5)
    reward_dir = str(create_tiny_reward_checkpoint(root / "reward", base_model_dir=actor_dir, seed=11))
    batch = four_sample_batch(PAD)
    oracle = _hf_values(reward_dir, batch)
    from mindspeed_rl.engines.critic import with_value_head
    from mindspeed_rl.models.checkpoint import load_hf_checkpoint

    spec, actor_state = load_hf_checkpoint(str(actor_dir))
    fresh_head = with_value_head(actor_state, spec, seed=7)["score.weight"]
    fresh_oracle = _hf_values(str(actor_dir), batch, fresh_head)
    returns = (oracle + 1.0) * batch.response_mask  # a target one above every value: the loss must fall
    spawn_ranks(_worker, args=(free_port(), reward_dir, str(actor_dir), batch, oracle, fresh_oracle, returns, str(root)),
                nprocs=2)
    return torch.load(root / "critic.pt"), oracle, fresh_oracle, batch


def test_values_equal_hf_in_every_layout(spawned):
    results, oracle, _, batch = spawned
    assert oracle.abs().max() > 1e-2  # a wrong position or head would show
    for layout in LAYOUTS:
        error = (results[layout]["values"] - oracle).abs().max().item()
        assert error < 1e-4, (layout, error)


def test_a_fresh_head_on_a_causal_lm_gives_the_trunk_times_the_seeded_head(spawned):
    results, _, fresh_oracle, _ = spawned
    assert (results["fresh"] - fresh_oracle).abs().max().item() < 1e-4


def test_one_step_lowers_the_value_loss_and_agrees_across_layouts(spawned):
    results, oracle, _, batch = spawned
    reference = results[LAYOUTS[0]]
    moved = (reference["after"] - oracle).abs().max().item()
    assert moved > 1e-3, "the step must move the values"
    assert ((reference["after"] - oracle) * batch.response_mask).sum() > 0  # toward the returns (one above)
    for layout in LAYOUTS[1:]:
        difference = (results[layout]["after"] - reference["after"]).abs().max().item()
        assert difference < 1e-2 * moved, (layout, difference, moved)
        assert results[layout]["stats"]["critic/vf_loss"] == pytest.approx(reference["stats"]["critic/vf_loss"],
                                                                          rel=1e-4)
    assert reference["stats"]["critic/vf_loss"] == pytest.approx(0.5, rel=1e-4)  # 0.5 * mean(1^2)
    assert reference["stats"]["critic/grad_norm"] > 0
