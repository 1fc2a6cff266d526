"""Packed micro-batches at TP2 (with sequence parallel: packed rows rounded to a multiple of TP) and at PP2
(stages exchange each packed micro-batch's shape): log-probs, GRPO loss stats and gradients equal the padded
path's on the same batch and weights. A Qwen3-MoE at PP2 too: packed, its experts run behind Megatron's alltoall
dispatcher (the one variable pipeline shapes allow), padded behind the allgather one, with the same results; and at
TP2 x PP2. With EP > 1 too that dispatcher gathers uneven parts over the expert-TP ranks (their 235B recipe; 8 ranks
here at the least): gloo runs them through CPU patch P8, checked on the TP groups of the 4-rank spawn.
Runs in spawned processes (torch.multiprocessing, gloo): one spawn of 2 ranks for every 2-rank layout, one of 4."""
import os

import torch
import torch.distributed as dist

from mindspeed_rl.data.tiny_model import create_tiny_qwen2_checkpoint
from mindspeed_rl.parallel import megatron_state
from resharding_oracle import free_port
from test_packing import _batch, _rollout_columns
from preloaded import spawn_ranks

STATS = ("actor/pg_loss", "actor/kl_loss", "actor/entropy", "actor/pg_clipfrac", "actor/ppo_kl", "actor/grad_norm")


def _engine(checkpoint, accelerator, *, packed: bool, sequence_parallel: bool):
    from mindspeed_rl.engines.megatron_engine import MegatronEngine, OptimizerSettings
    from mindspeed_rl.models.checkpoint import load_hf_checkpoint
    from mindspeed_rl.models.qwen2 import ModelOptions

    spec, state = load_hf_checkpoint(checkpoint)
    settings = OptimizerSettings(lr=1e-3, min_lr=0.0, weight_decay=0.0, adam_beta1=0.9, adam_beta2=0.95,
                                 adam_eps=1e-8, clip_grad=1.0)
    return MegatronEngine(spec=spec, hf_state=state, params_dtype=torch.float32, accelerator=accelerator,
                          parallel=megatron_state.current(),
                          optimizer=settings,
                          options=ModelOptions(packed_sequences=packed, sequence_parallel=sequence_parallel))


def _check_layout(checkpoint, tp, pp, sequence_parallel):
    from megatron.core import parallel_state as ps

    from mindspeed_rl.accelerator import get_accelerator
    from mindspeed_rl.algorithms.grpo import GRPOLossConfig
    from mindspeed_rl.protocol import Packing
    from mindspeed_rl.workers.actor_steps import train_on_mini_batch

    ps.initialize_model_parallel(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp)
    accelerator = get_accelerator("cpu")
    accelerator.seed_model_parallel_rng(1)
    padded = _engine(checkpoint, accelerator, packed=False, sequence_parallel=sequence_parallel)
    packed = _engine(checkpoint, accelerator, packed=True, sequence_parallel=sequence_parallel)
    batch = _rollout_columns(_batch(5, samples=8), seed=6)

    want = padded.compute_logprobs(batch, micro_batch_size=2, temperature=1.0)
    got = packed.compute_logprobs(batch, micro_batch_size=2, temperature=1.0, packing=Packing(max_tokens=30))
    assert (got - want).abs().max().item() < 2e-5, (tp, pp, (got - want).abs().max().item())

    config = GRPOLossConfig(clip_ratio=0.2, kl_penalty="low_var_kl", kl_coef=0.05, entropy_coeff=0.01,
                            loss_agg_mode="token-mean")
    want_stats = train_on_mini_batch(padded, batch, config, micro_batch_size=2, temperature=1.0)
    got_stats = train_on_mini_batch(packed, batch, config, micro_batch_size=2, temperature=1.0,
                                    packing=Packing(max_tokens=30))
    for key in STATS:
        assert abs(got_stats[key] - want_stats[key]) <= 1e-5 * abs(want_stats[key]) + 1e-6, (tp, pp, key)
    want_grads = {name: p.main_grad for name, p in padded.module.named_parameters()}
    for name, param in packed.module.named_parameters():
        torch.testing.assert_close(param.main_grad, want_grads[name], rtol=1e-4, atol=1e-7)
    ps.destroy_model_parallel()


def _check_uneven_gather():
    """P8: Megatron's all-gather of uneven parts over a TP group, forward and backward, on gloo."""
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel.mappings import gather_from_sequence_parallel_region

    from mindspeed_rl.accelerator.megatron_cpu import megatron_on_cpu

    ps.initialize_model_parallel(tensor_model_parallel_size=2, pipeline_model_parallel_size=2)
    sizes, tp_rank = [2, 3], ps.get_tensor_model_parallel_rank()
    parts = [torch.arange(size * 4, dtype=torch.float32).reshape(size, 4) + 100 * rank for rank, size in enumerate(sizes)]
    mine = parts[tp_rank].clone().requires_grad_()
    weight = torch.arange(20, dtype=torch.float32).reshape(5, 4)
    with megatron_on_cpu():
        gathered = gather_from_sequence_parallel_region(mine, group=ps.get_tensor_model_parallel_group(),
                                                        output_split_sizes=sizes)
        (gathered * weight).sum().backward()
    assert torch.equal(gathered.detach(), torch.cat(parts))
    start = sum(sizes[:tp_rank])  # the backward reduce-scatters the TP ranks' equal output gradients: 2 x weight
    assert torch.equal(mine.grad, 2 * weight[start:start + sizes[tp_rank]])
    ps.destroy_model_parallel()


def _worker(rank, world_size, port, checkpoint, moe_checkpoint):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world_size))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    try:
        if world_size == 4:
            _check_uneven_gather()
            _check_layout(moe_checkpoint, 2, 2, False)
            return
        for tp, pp, sequence_parallel in ((2, 1, False), (2, 1, True), (1, 2, False)):
            _check_layout(checkpoint, tp, pp, sequence_parallel)
        _check_layout(moe_checkpoint, 1, 2, False)
    finally:
        dist.destroy_process_group()


def test_packed_equals_padded_at_tp2_with_sequence_parallel_and_at_pp2_dense_and_moe(tmp_path):
    checkpoint = str(tmp_path / "model")
    create_tiny_qwen2_checkpoint(checkpoint, vocab_size=64, hidden_size=64, ffn_hidden_size=128, num_layers=2,
                                 num_attention_heads=4, num_query_groups=2, seed=3)
    from mindspeed_rl.data.tiny_moe import create_tiny_qwen3_moe_checkpoint

    moe_checkpoint = str(create_tiny_qwen3_moe_checkpoint(tmp_path / "moe", vocab_size=64, seed=3))
    spawn_ranks(_worker, args=(2, free_port(), checkpoint, moe_checkpoint), nprocs=2)


def test_packed_moe_at_tp2_pp2_equals_padded_and_uneven_tp_gathers_run_on_gloo(tmp_path):
    from mindspeed_rl.data.tiny_moe import create_tiny_qwen3_moe_checkpoint

    moe_checkpoint = str(create_tiny_qwen3_moe_checkpoint(tmp_path / "moe", vocab_size=64, seed=3))
    spawn_ranks(_worker, args=(4, free_port(), None, moe_checkpoint), nprocs=4)
