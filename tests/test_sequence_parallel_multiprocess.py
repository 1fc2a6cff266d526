"""`sequence_parallel: true` on a dense Qwen2 at train TP2: the same log-probs as TP2 without it,
and the same gradients for every weight (the SP norms' grads are all-reduced over TP). Gradients,
not the weights after an Adam step: Adam's first step is lr * g / (|g| + eps), which flips with
rounding wherever g is near 0.

Runs where: 2 spawned processes (torch.multiprocessing), gloo, fp32; one spawn covers both runs.
"""
import os

import torch
import torch.distributed as dist

from mindspeed_rl.data.tiny_model import create_tiny_qwen2_checkpoint
from mindspeed_rl.parallel import megatron_state
from mindspeed_rl.protocol import RolloutBatch
from resharding_oracle import free_port
from preloaded import spawn_ranks

TOLERANCE = 1e-5


def _batch() -> RolloutBatch:
    # Odd total lengths: the engine pads the sequence to a multiple of TP for the SP split.
    g = torch.Generator().manual_seed(2)
    prompts = [torch.randint(1, 64, (5,), generator=g).tolist() for _ in range(4)]
    responses = [torch.randint(1, 64, (int(n),), generator=g).tolist() for n in torch.randint(2, 7, (4,), generator=g)]
    return RolloutBatch.from_token_lists(prompts, responses, pad_id=0, response_width=6)


def _run(checkpoint: str, sequence_parallel: bool, batch: RolloutBatch):
    from megatron.core import parallel_state as ps

    from mindspeed_rl.accelerator import get_accelerator
    from mindspeed_rl.engines.megatron_engine import MegatronEngine, OptimizerSettings
    from mindspeed_rl.models.checkpoint import load_hf_checkpoint
    from mindspeed_rl.models.qwen2 import ModelOptions

    acc = get_accelerator("cpu")
    spec, state = load_hf_checkpoint(checkpoint)
    settings = OptimizerSettings(lr=1e-2, min_lr=0.0, weight_decay=0.0, adam_beta1=0.9, adam_beta2=0.95,
                                 adam_eps=1e-8, clip_grad=0.0)
    engine = MegatronEngine(spec=spec, hf_state=state, params_dtype=torch.float32, accelerator=acc,
                            parallel=megatron_state.current(), optimizer=settings,
                            options=ModelOptions(sequence_parallel=sequence_parallel))
    assert engine.module.config.sequence_parallel is sequence_parallel
    logprobs = engine.compute_logprobs(batch, micro_batch_size=2, temperature=1.0)

    def loss_fn(lp, entropy, mb):
        loss = -(lp * mb.response_mask).sum() / batch.response_mask.sum()
        return loss, {"loss": loss.item()}

    stats = engine.train_step(batch, micro_batch_size=2, temperature=1.0, loss_fn=loss_fn)
    # DDP accumulates into main_grad (views of its grad buffer); the next step zeroes them.
    grads = {name: p.main_grad.clone() for name, p in engine.module.named_parameters()}
    assert ps.get_tensor_model_parallel_world_size() == 2
    return logprobs, stats, grads


def _worker(rank, world_size, port, checkpoint):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world_size))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    try:
        from megatron.core import parallel_state as ps

        from mindspeed_rl.accelerator import get_accelerator

        ps.initialize_model_parallel(tensor_model_parallel_size=2, pipeline_model_parallel_size=1)
        get_accelerator("cpu").seed_model_parallel_rng(1)
        batch = _batch()
        plain_logprobs, plain_stats, plain_grads = _run(checkpoint, False, batch)
        sp_logprobs, sp_stats, sp_grads = _run(checkpoint, True, batch)
        assert (sp_logprobs - plain_logprobs).abs().max().item() < TOLERANCE
        assert plain_logprobs.abs().sum() > 0
        assert abs(sp_stats["actor/grad_norm"] - plain_stats["actor/grad_norm"]) < TOLERANCE * plain_stats["actor/grad_norm"]
        for name, want in plain_grads.items():
            assert want.abs().max() > 0, name
            assert (sp_grads[name] - want).abs().max().item() < TOLERANCE * max(1.0, want.abs().max().item()), name
        ps.destroy_model_parallel()
    finally:
        dist.destroy_process_group()


def test_tp2_with_sequence_parallel_equals_without(tmp_path):
    checkpoint = str(tmp_path / "model")
    create_tiny_qwen2_checkpoint(checkpoint, vocab_size=64, hidden_size=64, ffn_hidden_size=128, num_layers=2,
                                 num_attention_heads=4, num_query_groups=2, seed=8)
    spawn_ranks(_worker, args=(2, free_port(), checkpoint), nprocs=2)
