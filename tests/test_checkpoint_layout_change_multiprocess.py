"""Checkpoints with the settings every MindSpeed-RL recipe uses (bf16, the distributed optimizer, weight decay): saved
at one layout, they resume exactly at the same one and load at any other (2 spawned processes, gloo, real Megatron
dist-checkpointing, engines/dist_checkpoint.py).

Oracles: the uninterrupted engine (a resume at DP2 continues it bit for bit), and the checkpoint itself (an engine
at TP2, at PP2 with uneven stages 2 + 1, at CP2, loads it with its optimizer and saves again: every tensor, weights,
fp32 masters and both Adam moments, comes back equal bit for bit); the same for a Qwen3-MoE at EP2 (its experts in
an optimizer of their own; EP1 keeps them with the rest, which trainer_state.check_optimizer_split tells a user
moving between the two). Before the fix the save itself failed ("ShardedTensor.flattened_range is not supported"; without the
distributed optimizer "Optimizer shape does not match model shape", the bf16 model's norms being fp32)."""

import os
from dataclasses import replace

import torch
import torch.distributed as dist

from mindspeed_rl.data.tiny_model import create_tiny_qwen2_checkpoint
from mindspeed_rl.parallel import megatron_state
from resharding_oracle import free_port
from preloaded import spawn_ranks

ADAM = dict(lr=1e-2, min_lr=0.0, weight_decay=0.1, adam_beta1=0.9, adam_beta2=0.95, adam_eps=1e-8, clip_grad=1.0,
            use_distributed_optimizer=True)
LAYOUTS = {"tp2": dict(tensor_model_parallel_size=2), "pp2": dict(pipeline_model_parallel_size=2),
           "cp2": dict(context_parallel_size=2)}


def _engine(hf_dir, *, stages=None, **layout):
    from megatron.core import parallel_state as ps

    from mindspeed_rl.accelerator import get_accelerator
    from mindspeed_rl.engines.megatron_engine import MegatronEngine, OptimizerSettings
    from mindspeed_rl.models.checkpoint import load_hf_checkpoint

    ps.initialize_model_parallel(**layout)
    acc = get_accelerator("cpu")
    acc.seed_model_parallel_rng(1)
    spec, state = load_hf_checkpoint(hf_dir)
    return MegatronEngine(spec=replace(spec, pipeline_stage_layers=stages), hf_state=state,
                          params_dtype=torch.bfloat16, accelerator=acc,
                          parallel=megatron_state.current(), optimizer=OptimizerSettings(**ADAM))


def _step(engine, rank: int) -> dict:
    """One optimizer step on this DP rank's own samples."""
    from mindspeed_rl.protocol import RolloutBatch

    g = torch.Generator().manual_seed(rank)
    prompts = [torch.randint(1, 60, (4,), generator=g).tolist() for _ in range(2)]
    batch = RolloutBatch.from_token_lists(prompts, [[3, 4, 5], [6, 7]], pad_id=0, response_width=4)

    def loss_fn(logprobs, entropy, mb):
        loss = -(logprobs * mb.response_mask).sum() / 10.0
        return loss, {"loss": loss.item()}

    return engine.train_step(batch, micro_batch_size=2, temperature=1.0, loss_fn=loss_fn)


def _weights(engine) -> dict[str, torch.Tensor]:
    return {name: tensor.clone() for name, tensor in engine.module.named_parameters()}


def _dense(rank, root):
    from megatron.core import parallel_state as ps

    saver = _engine(root + "/hf")
    _step(saver, rank)
    scheduler_state = saver.save_sharded(root + "/saved", with_optimizer=True)
    expected_stats, expected_weights = _step(saver, rank), _weights(saver)
    ps.destroy_model_parallel()

    resumed = _engine(root + "/hf")
    resumed.load_sharded(root + "/saved", load_optimizer=True, scheduler_state=scheduler_state)
    assert _step(resumed, rank) == expected_stats
    for name, tensor in _weights(resumed).items():
        assert torch.equal(tensor, expected_weights[name]), name
    ps.destroy_model_parallel()

    for name, layout in LAYOUTS.items():
        loader = _engine(root + "/hf", stages=(2, 1) if name == "pp2" else None, **layout)
        loader.load_sharded(root + "/saved", load_optimizer=True, scheduler_state=scheduler_state)
        loader.save_sharded(f"{root}/{name}", with_optimizer=True)
        ps.destroy_model_parallel()


def _moe(rank, root):
    from megatron.core import parallel_state as ps

    saver = _engine(root + "/moe_hf", expert_model_parallel_size=2)
    _step(saver, rank)
    saver.save_sharded(root + "/moe_saved", with_optimizer=True)
    ps.destroy_model_parallel()
    loader = _engine(root + "/moe_hf", expert_model_parallel_size=2)
    loader.load_sharded(root + "/moe_saved", load_optimizer=True, scheduler_state=None)
    loader.save_sharded(root + "/moe_resaved", with_optimizer=True)
    ps.destroy_model_parallel()


def _worker(rank, world_size, port, root):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world_size))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    try:
        _dense(rank, root)
        _moe(rank, root)
    finally:
        dist.destroy_process_group()


def _plain(path) -> dict[str, torch.Tensor]:
    from megatron.core import dist_checkpointing

    loaded = {**dist_checkpointing.load_plain_tensors(str(path / "model")),
              **dist_checkpointing.load_plain_tensors(str(path / "optimizer"))}
    return {key: value for key, value in loaded.items() if torch.is_tensor(value)}


def _assert_same_tensors(got: dict, want: dict, what: str) -> None:
    assert set(got) == set(want), f"{what}: {sorted(set(got) ^ set(want))[:4]}"
    for key, tensor in want.items():
        assert got[key].dtype == tensor.dtype and torch.equal(got[key], tensor), f"{what}: {key}"


def test_bf16_distributed_optimizer_checkpoints_resume_exactly_and_load_at_every_layout(world, tmp_path):
    from mindspeed_rl.data.tiny_moe import create_tiny_qwen3_moe_checkpoint

    create_tiny_qwen2_checkpoint(tmp_path / "hf", vocab_size=64, hidden_size=64, ffn_hidden_size=128, num_layers=3,
                                 num_attention_heads=4, num_query_groups=2, seed=5)
    create_tiny_qwen3_moe_checkpoint(tmp_path / "moe_hf", seed=3)
    spawn_ranks(_worker, args=(2, free_port(), str(tmp_path)), nprocs=2)

    saved = _plain(tmp_path / "saved")
    keys = set(saved)
    assert {"optimizer.state.exp_avg.decoder.layers.self_attention.linear_qkv.weight",
            "optimizer.state.param.decoder.final_layernorm.weight"} <= keys, sorted(keys)[:8]
    assert saved["decoder.final_layernorm.weight"].dtype == torch.bfloat16  # every weight in the training dtype
    assert saved["optimizer.state.param.decoder.final_layernorm.weight"].dtype == torch.float32  # its master
    assert saved["optimizer.state.exp_avg_sq.embedding.word_embeddings.weight"].abs().sum() > 0
    for name in LAYOUTS:
        _assert_same_tensors(_plain(tmp_path / name), saved, f"saved at DP2, loaded and saved at {name}")
    moe = _plain(tmp_path / "moe_saved")
    assert any(".experts." in key and key.startswith("optimizer.state.exp_avg.") for key in moe)
    _assert_same_tensors(_plain(tmp_path / "moe_resaved"), moe, "MoE saved at EP2, loaded and saved again")
