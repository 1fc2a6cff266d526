"""A checkpoint saved at TP2 loads at PP2 with uneven stages (2 + 1 layers, actor_config.num_layer_list) with equal
weights (2 spawned processes, gloo, real Megatron dist-checkpointing: the layers' global numbers follow the stages).

The TP2 engine takes one real optimizer step first so the saved weights differ from the initial HF ones;
the PP2 engine starts from the initial weights and must end with the TP2 engine's full HF tensors."""

import os

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from mindspeed_rl.data.tiny_model import create_tiny_qwen2_checkpoint
from resharding_oracle import free_port

ADAM = dict(lr=1e-2, min_lr=0.0, weight_decay=0.0, adam_beta1=0.9, adam_beta2=0.95, adam_eps=1e-8, clip_grad=1.0)


def _engine(hf_dir, tp, pp, stages=None):
    from dataclasses import replace

    from megatron.core import parallel_state as ps

    from mindspeed_rl.accelerator import get_accelerator
    from mindspeed_rl.engines.megatron_engine import MegatronEngine, OptimizerSettings
    from mindspeed_rl.models.checkpoint import load_hf_checkpoint

    ps.initialize_model_parallel(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp)
    acc = get_accelerator("cpu")
    acc.seed_model_parallel_rng(1)
    spec, state = load_hf_checkpoint(hf_dir)
    return MegatronEngine(spec=replace(spec, pipeline_stage_layers=stages), hf_state=state, params_dtype=torch.float32, accelerator=acc,
                          optimizer=OptimizerSettings(**ADAM))


def _worker(rank, world_size, port, hf_dir, save_dir, out_dir):
    from megatron.core import parallel_state as ps

    from mindspeed_rl.protocol import RolloutBatch

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world_size))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    try:
        saver = _engine(hf_dir, tp=2, pp=1)
        batch = RolloutBatch.from_token_lists([[5, 9, 6, 11], [7, 9, 8, 11]], [[3, 4, 5], [6, 7]], pad_id=0,
                                              response_width=4)

        def loss_fn(logprobs, entropy, mb):
            loss = -(logprobs * mb.response_mask).sum() / 5.0
            return loss, {"loss": loss.item()}

        saver.train_step(batch, micro_batch_size=2, temperature=1.0, loss_fn=loss_fn)
        saver.save_sharded(save_dir, with_optimizer=False)
        from mindspeed_rl.checkpoint.hf_export import hf_weights_from_megatron

        expected = hf_weights_from_megatron(saver.named_weights(), saver.spec)
        ps.destroy_model_parallel()

        loader = _engine(hf_dir, tp=1, pp=2, stages=(2, 1))
        loader.load_sharded(save_dir, load_optimizer=False, scheduler_state=None)
        got = hf_weights_from_megatron(loader.named_weights(), loader.spec)
        ps.destroy_model_parallel()
        if rank == 0:
            torch.save({"expected": expected, "got": got}, os.path.join(out_dir, "weights.pt"))
    finally:
        dist.destroy_process_group()


def test_saved_at_tp2_loads_at_uneven_pp2_with_equal_weights(tmp_path):
    hf_dir = str(tmp_path / "model")
    create_tiny_qwen2_checkpoint(hf_dir, vocab_size=64, hidden_size=64, ffn_hidden_size=128, num_layers=3,
                                 num_attention_heads=4, num_query_groups=2, seed=5)
    save_dir = tmp_path / "ckpt"
    save_dir.mkdir()
    mp.spawn(_worker, args=(2, free_port(), hf_dir, str(save_dir), str(tmp_path)), nprocs=2, join=True)
    weights = torch.load(tmp_path / "weights.pt")
    from mindspeed_rl.models.checkpoint import load_hf_checkpoint

    _, initial = load_hf_checkpoint(hf_dir)
    assert set(weights["got"]) == set(weights["expected"])
    assert any(not torch.equal(weights["expected"][k], initial[k]) for k in initial), "the step must move weights"
    for name, tensor in weights["expected"].items():
        assert torch.equal(weights["got"][name], tensor), name
