"""The Megatron reward model scores what HF transformers' Qwen2ForSequenceClassification scores (the oracle):
the head's output at the last non-pad token, on the same right-padded batch, fp32, < 1e-4.

Runs where: single rank in the pytest process (gloo world of 1), and TP2 / PP2 / CP2 on 2 spawned gloo processes
(under CP each score is read on the rank holding the sample's last token).
"""
import os

import pytest
import torch
import torch.distributed as dist

from mindspeed_rl.data.tiny_model import create_tiny_qwen2_checkpoint
from mindspeed_rl.data.tiny_reward_model import create_tiny_reward_checkpoint
from mindspeed_rl.parallel import megatron_state
from mindspeed_rl.protocol import RolloutBatch
from resharding_oracle import free_port
from preloaded import spawn_ranks

VOCAB, PAD = 64, 63  # the pad id appears in no sequence, so HF's "last non-pad token" is the last real one
TOLERANCE = 1e-4


@pytest.fixture(scope="module")
def reward_dir(tmp_path_factory):
    root = tmp_path_factory.mktemp("reward_model")
    create_tiny_qwen2_checkpoint(root / "actor", vocab_size=VOCAB, hidden_size=128, ffn_hidden_size=256,
                                 num_layers=2, num_attention_heads=4, num_query_groups=2, seed=5)
    return str(create_tiny_reward_checkpoint(root / "reward", base_model_dir=root / "actor", seed=11))


def _batch() -> RolloutBatch:
    """Prompts and responses of different lengths (one response empty), right-padded with PAD."""
    generator = torch.Generator().manual_seed(3)
    prompt_lengths, response_lengths = [3, 5, 2, 4, 6, 3], [4, 1, 6, 0, 2, 5]
    prompts = [torch.randint(0, PAD, (n,), generator=generator).tolist() for n in prompt_lengths]
    responses = [torch.randint(0, PAD, (n,), generator=generator).tolist() for n in response_lengths]
    return RolloutBatch.from_token_lists(prompts, responses, pad_id=PAD, response_width=6)


def _hf_scores(reward_dir: str, batch: RolloutBatch) -> torch.Tensor:
    from transformers import Qwen2ForSequenceClassification

    hf = Qwen2ForSequenceClassification.from_pretrained(reward_dir, dtype=torch.float32,
                                                        attn_implementation="eager").eval()
    hf.config.pad_token_id = PAD
    with torch.no_grad():
        return hf(batch.input_ids, attention_mask=(batch.input_ids != PAD).long()).logits[:, 0]


def _engine(reward_dir: str, accelerator, dtype=torch.float32):
    from mindspeed_rl.engines.reward_model import RewardModelEngine
    from mindspeed_rl.models.checkpoint import load_hf_checkpoint

    spec, state = load_hf_checkpoint(reward_dir)
    return RewardModelEngine(spec=spec, hf_state=state, params_dtype=dtype, accelerator=accelerator,
                             parallel=megatron_state.current())


def test_single_rank_scores_equal_hf_sequence_classification(world, reward_dir):
    batch = _batch()
    got = _engine(reward_dir, world).compute_scores(batch, micro_batch_size=4)
    expected = _hf_scores(reward_dir, batch)
    assert got.shape == (len(batch),)
    assert (got - expected).abs().max().item() < TOLERANCE
    assert expected.std() > 1e-3  # the samples score differently: a wrong position would show


def test_no_vocabulary_sized_head_is_kept(world, reward_dir):
    engine = _engine(reward_dir, world)
    shapes = {name: tuple(p.shape) for name, p in engine.module.named_parameters()}
    assert shapes["output_layer.weight"] == (1, 128)
    assert sum(1 for shape in shapes.values() if VOCAB in shape) == 1  # the embedding only


def _worker(rank, port, reward_dir, batch, expected):
    from megatron.core import parallel_state as ps

    from mindspeed_rl.accelerator import get_accelerator

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE="2")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=2)
    try:
        for tp, pp, cp in ((2, 1, 1), (1, 2, 1), (1, 1, 2)):
            ps.initialize_model_parallel(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
                                         context_parallel_size=cp)
            accelerator = get_accelerator("cpu")
            accelerator.seed_model_parallel_rng(1)
            got = _engine(reward_dir, accelerator).compute_scores(batch, micro_batch_size=3)
            error = (got - expected).abs().max().item()
            assert error < TOLERANCE, (tp, pp, cp, error)
            ps.destroy_model_parallel()
    finally:
        dist.destroy_process_group()


def test_tp2_pp2_and_cp2_scores_equal_hf(reward_dir):
    batch = _batch()
    spawn_ranks(_worker, args=(free_port(), reward_dir, batch, _hf_scores(reward_dir, batch)), nprocs=2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_the_planner_counts_the_reward_models_bytes_on_a_rank(world, reward_dir, dtype):
    import json
    from pathlib import Path

    from mindspeed_rl.planner.arch import from_hf_config
    from mindspeed_rl.planner.params import reward_model_bytes

    engine = _engine(reward_dir, world, dtype)
    measured = sum(p.numel() * p.element_size() for p in engine.module.parameters())
    arch = from_hf_config(json.loads((Path(reward_dir) / "config.json").read_text()), where="test")
    assert reward_model_bytes(arch, tp=1, pp=1, pp_rank=0, bf16=dtype == torch.bfloat16) == measured
