"""The memory ledger against the device allocator's own count (`torch.cuda.memory_allocated`): a bf16
Megatron actor with the distributed optimizer and a reference model, after a real update. The bytes the
ledger attributes are what the allocator holds beyond what was there before, and offloading every state
frees exactly the ledger's bytes; reloading takes them back.

Runs where: on a device only (`make gpu-check`, which sets MINDSPEED_RL_TEST_DEVICE=cuda), in the pytest
process's one-rank nccl world. On CPU there is no allocator to compare with, so the suite skips it; the
ledger's arithmetic is tested on CPU in test_memory_ledger.py.
"""
import os

import pytest
import torch

from mindspeed_rl.data.tiny_model import create_tiny_qwen2_checkpoint
from mindspeed_rl.engines.megatron_engine import MegatronEngine, OptimizerSettings
from mindspeed_rl.memory import Offloader
from mindspeed_rl.memory.ledger import MemoryLedger
from mindspeed_rl.memory.megatron_states import register_megatron_states
from mindspeed_rl.models.checkpoint import load_hf_checkpoint
from mindspeed_rl.parallel import megatron_state
from mindspeed_rl.protocol import RolloutBatch

pytestmark = pytest.mark.skipif(os.environ.get("MINDSPEED_RL_TEST_DEVICE", "cpu") == "cpu",
                                reason="compares with a device allocator: make gpu-check")

SETTINGS = OptimizerSettings(lr=1e-3, min_lr=0.0, weight_decay=0.01, adam_beta1=0.9, adam_beta2=0.95, adam_eps=1e-8,
                             clip_grad=1.0, use_distributed_optimizer=True)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    out = tmp_path_factory.mktemp("ledger_device") / "model"
    create_tiny_qwen2_checkpoint(out, vocab_size=8192, hidden_size=512, ffn_hidden_size=1408, num_layers=4,
                                 num_attention_heads=8, num_query_groups=2, seed=5)
    return str(out)


def _one_update(actor: MegatronEngine) -> None:
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(1, 8192, (16,), generator=g).tolist() for _ in range(8)]
    responses = [torch.randint(1, 8192, (32,), generator=g).tolist() for _ in range(8)]
    batch = RolloutBatch.from_token_lists(prompts, responses, pad_id=0, response_width=32)

    def loss_fn(logprobs, entropy, mb):
        loss = -(logprobs * mb.response_mask).sum() / batch.response_mask.sum()
        return loss, {"loss": loss.item()}

    actor.train_step(batch, micro_batch_size=4, temperature=1.0, loss_fn=loss_fn)


def _requested_bytes(world) -> int:
    """The bytes tensors asked the caching allocator for, before its rounding to blocks (a large block keeps
    an unsplit remainder of up to 1 MiB, which `memory_allocated` counts as allocated)."""
    return getattr(torch, world.name).memory_stats()["requested_bytes.all.current"]


def test_the_ledger_accounts_for_what_the_allocator_holds(world, checkpoint, record_property):
    spec, state = load_hf_checkpoint(checkpoint)
    world.synchronize()
    world.empty_cache()
    before = _requested_bytes(world)
    actor = MegatronEngine(spec=spec, hf_state=state, params_dtype=torch.bfloat16, accelerator=world,
                           parallel=megatron_state.current(), optimizer=SETTINGS)
    reference = MegatronEngine(spec=spec, hf_state=state, params_dtype=torch.bfloat16, accelerator=world,
                               parallel=megatron_state.current(), optimizer=None)
    _one_update(actor)
    offloader = Offloader(world)
    register_megatron_states(offloader, actor, reference, keep_grads=True)
    ledger = MemoryLedger(offloader.resident_bytes, world)

    resident, requested_resident = ledger.record("resident"), _requested_bytes(world)
    offloader.offload_all()
    offloaded, requested_offloaded = ledger.record("offloaded"), _requested_bytes(world)
    offloader.reload_all()
    reloaded, requested_reloaded = ledger.record("reloaded"), _requested_bytes(world)

    held, freed = requested_resident - before, requested_resident - requested_offloaded
    for key, value in (("ledger_bytes", resident.total_bytes), ("requested_held_bytes", held),
                       ("offload_freed_bytes", freed),
                       ("allocated_freed_bytes", resident.allocator_bytes - offloaded.allocator_bytes)):
        record_property(key, value)
    assert resident.total_bytes > 100 * 2**20, "a state big enough that a miscount shows"
    assert offloaded.total_bytes == 0
    assert freed == resident.total_bytes, "offload frees exactly the ledger's bytes"
    # Exact in requested bytes; the allocator's block count may differ by the remainders its blocks kept unsplit.
    assert requested_reloaded == requested_resident and reloaded.total_bytes == resident.total_bytes
    # What the ledger does not attribute (rotary caches, the loss scalars' leftovers) is small next to the states.
    assert 0 <= held - resident.total_bytes <= 0.02 * resident.total_bytes
