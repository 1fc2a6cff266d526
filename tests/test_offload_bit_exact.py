"""Offloading is invisible to training: real Megatron-core actors (fp32, and bf16 with fp32 master
copies) train k steps while every state is offloaded and reloaded between steps, and end with
params, fp32 masters and Adam moments identical (torch.equal) to an actor that never offloaded.
The same for the reference model's params and log-probs, and for kept grads.

Runs where: in the pytest process, a 1-rank gloo world (shared with the other single-rank tests).
"""

import pytest
import torch

from mindspeed_rl.engines.megatron_engine import MegatronEngine
from mindspeed_rl.memory import Offloader
from mindspeed_rl.memory.megatron_states import REF_PARAMS, TRAIN_GRADS, register_megatron_states
from mindspeed_rl.protocol import RolloutBatch
from mindspeed_rl.models.checkpoint import load_hf_checkpoint
from mindspeed_rl.parallel import megatron_state
from tiny_actor import ADAM, response_loss_fn, tiny_checkpoint, token_batch

STEPS = 3


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return tiny_checkpoint(tmp_path_factory.mktemp("tiny_offload") / "model", seed=11)


def _batch() -> RolloutBatch:
    return token_batch(seed=3)


def _optimizer_tensors(actor: MegatronEngine) -> list[torch.Tensor]:
    from mindspeed_rl.memory.megatron_states import optimizer_state_tensors

    return [t.clone() for t in optimizer_state_tensors(actor.optimizer)]


def _train(actor: MegatronEngine, batch: RolloutBatch, offloader: Offloader | None) -> None:
    for _ in range(STEPS):
        actor.train_step(batch, micro_batch_size=4, temperature=1.0, loss_fn=response_loss_fn(batch))
        if offloader is not None:
            offloader.offload_all()
            assert sum(offloader.resident_bytes().values()) == 0
            offloader.reload_all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_training_with_offload_between_steps_is_bit_exact(world, checkpoint, dtype):
    spec, state = load_hf_checkpoint(checkpoint)
    oracle = MegatronEngine(spec=spec, hf_state=state, params_dtype=dtype, accelerator=world,
                            parallel=megatron_state.current(), optimizer=ADAM)
    actor = MegatronEngine(spec=spec, hf_state=state, params_dtype=dtype, accelerator=world,
                           parallel=megatron_state.current(), optimizer=ADAM)
    reference = MegatronEngine(spec=spec, hf_state=state, params_dtype=dtype, accelerator=world,
                               parallel=megatron_state.current(), optimizer=None)
    offloader = Offloader(world)
    register_megatron_states(offloader, actor, reference)
    batch = _batch()

    _train(oracle, batch, offloader=None)
    _train(actor, batch, offloader=offloader)

    # Two fp32 Adam moments per parameter, plus an fp32 master copy for each bf16 one (in a bf16 model every
    # parameter, the norms too).
    expected = sum(p.numel() * (8 if p.dtype == torch.float32 else 12) for p in actor.module.parameters())
    assert offloader.resident_bytes()["optimizer_states"] == expected, "every moment and master is offloaded"
    for (name, got), (_, want) in zip(actor.module.named_parameters(), oracle.module.named_parameters()):
        assert torch.equal(got, want), name
    got_states, want_states = _optimizer_tensors(actor), _optimizer_tensors(oracle)
    assert len(got_states) == len(want_states) > 0
    assert all(torch.equal(a, b) for a, b in zip(got_states, want_states))
    assert any(s.abs().sum() > 0 for s in got_states), "the moments moved: the comparison is not vacuous"
    for got, start in zip(actor.module.parameters(), reference.module.parameters()):
        assert not torch.equal(got, start) or got.numel() < 8, "training changed the weights"


def test_reference_model_and_kept_grads_round_trip(world, checkpoint):
    spec, state = load_hf_checkpoint(checkpoint)
    actor = MegatronEngine(spec=spec, hf_state=state, params_dtype=torch.float32, accelerator=world,
                           parallel=megatron_state.current(), optimizer=ADAM)
    reference = MegatronEngine(spec=spec, hf_state=state, params_dtype=torch.float32, accelerator=world,
                               parallel=megatron_state.current(), optimizer=None)
    offloader = Offloader(world)
    register_megatron_states(offloader, actor, reference, keep_grads=True)
    batch = _batch()

    before = reference.compute_logprobs(batch, micro_batch_size=4, temperature=1.0)
    params = [p.detach().clone() for p in reference.module.parameters()]
    offloader.offload(REF_PARAMS)
    assert offloader.resident_bytes()[REF_PARAMS] == 0
    assert all(p.untyped_storage().nbytes() == 0 for p in reference.module.parameters())
    offloader.reload(REF_PARAMS)
    assert all(torch.equal(a, b) for a, b in zip(reference.module.parameters(), params))
    assert torch.equal(reference.compute_logprobs(batch, micro_batch_size=4, temperature=1.0), before)

    actor.train_step(batch, micro_batch_size=4, temperature=1.0, loss_fn=response_loss_fn(batch))
    grads = [b.grad_data.clone() for b in actor.model.buffers]
    assert any(g.abs().sum() > 0 for g in grads)
    assert offloader.offload(TRAIN_GRADS) == sum(g.nbytes for g in grads)
    offloader.reload(TRAIN_GRADS)
    assert all(torch.equal(b.grad_data, g) for b, g in zip(actor.model.buffers, grads))
