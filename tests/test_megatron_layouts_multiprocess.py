"""Megatron TP2, PP2 and uneven PP2 (3 + 1 layers, actor_config.num_layer_list) on 2 real gloo ranks agree with HF
transformers (the unsharded oracle).

Runs where: 2 spawned processes (torch.multiprocessing), gloo; one spawn covers the three layouts.
"""
from dataclasses import replace

import os

import torch
import torch.distributed as dist

from mindspeed_rl.data.tiny_model import create_tiny_qwen2_checkpoint
from mindspeed_rl.parallel import megatron_state
from resharding_oracle import free_port
from preloaded import spawn_ranks


def _hf_reference(checkpoint, ids):
    from transformers import Qwen2ForCausalLM

    hf = Qwen2ForCausalLM.from_pretrained(checkpoint, dtype=torch.float32, attn_implementation="eager").eval()
    with torch.no_grad():
        logits = hf(ids).logits
    return torch.log_softmax(logits, -1), logits


def _check_layout(rank, checkpoint, tp, pp, stages, ids, oracle_logprobs, oracle_logits):
    from megatron.core import parallel_state as ps
    from megatron.core import tensor_parallel

    from mindspeed_rl.accelerator import get_accelerator
    from mindspeed_rl.engines.megatron_engine import MegatronEngine
    from mindspeed_rl.protocol import RolloutBatch
    from mindspeed_rl.models.checkpoint import load_hf_checkpoint

    ps.initialize_model_parallel(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp)
    acc = get_accelerator("cpu")
    acc.seed_model_parallel_rng(1)
    spec, state = load_hf_checkpoint(checkpoint)
    spec = replace(spec, pipeline_stage_layers=stages)
    engine = MegatronEngine(spec=spec, hf_state=state, params_dtype=torch.float32, accelerator=acc,
                            parallel=megatron_state.current(), optimizer=None)
    stage_sizes = stages or (spec.num_layers // pp,) * pp
    assert len(engine.module.decoder.layers) == stage_sizes[ps.get_pipeline_model_parallel_rank()]

    if pp == 1:  # full logits are only visible without a pipeline
        with torch.no_grad(), acc.megatron_context():
            local = engine.module(ids, torch.arange(ids.shape[1]).expand_as(ids), None)
            full = tensor_parallel.gather_from_tensor_model_parallel_region(local)
        assert (full - oracle_logits).abs().max().item() < 1e-4

    # Treat every position after the first 3 tokens as the "response": log-probs on every rank.
    prompts = [row[:3].tolist() for row in ids]
    responses = [row[3:].tolist() for row in ids]
    batch = RolloutBatch.from_token_lists(prompts, responses, pad_id=0, response_width=ids.shape[1] - 3)
    got = engine.compute_logprobs(batch, micro_batch_size=2, temperature=1.0)
    targets = ids[:, 3:]
    expected = torch.gather(oracle_logprobs[:, 2:-1], 2, targets.unsqueeze(-1)).squeeze(-1)
    assert (got - expected).abs().max().item() < 1e-4, (tp, pp, (got - expected).abs().max().item())

    from mindspeed_rl.checkpoint.hf_export import hf_weights_from_megatron

    exported = hf_weights_from_megatron(engine.named_weights(), engine.spec, parallel=engine.parallel)
    assert set(exported) == set(state)
    for name, tensor in state.items():
        assert torch.equal(exported[name], tensor), name
    ps.destroy_model_parallel()


def _worker(rank, world_size, port, checkpoint, ids, oracle_logprobs, oracle_logits):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world_size))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    try:
        for tp, pp, stages in ((2, 1, None), (1, 2, None), (1, 2, (3, 1))):
            _check_layout(rank, checkpoint, tp, pp, stages, ids, oracle_logprobs, oracle_logits)
    finally:
        dist.destroy_process_group()


def test_tp2_pp2_and_uneven_pp2_match_hf(tmp_path):
    checkpoint = str(tmp_path / "model")
    create_tiny_qwen2_checkpoint(checkpoint, vocab_size=64, hidden_size=128, ffn_hidden_size=256, num_layers=4,
                                 num_attention_heads=4, num_query_groups=2, seed=5)
    ids = torch.randint(0, 64, (4, 12), generator=torch.Generator().manual_seed(1))
    oracle_logprobs, oracle_logits = _hf_reference(checkpoint, ids)
    spawn_ranks(_worker, args=(2, free_port(), checkpoint, ids, oracle_logprobs, oracle_logits), nprocs=2)
