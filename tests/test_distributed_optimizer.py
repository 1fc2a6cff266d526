"""`use_distributed_optimizer: true`: Megatron's DistributedOptimizer (params in DDP's contiguous
param buffer, fp32 masters and Adam moments as DP shards) trains with every state offloaded and
reloaded between steps and ends torch.equal to a never-offloaded run, in fp32 and bf16. (Its DP=2
run is in test_metrics_dp_multiprocess.py: same stats and weights as one rank.)

Runs where: in the pytest process, a 1-rank gloo world (shared with the other single-rank tests).
"""
import dataclasses

import pytest
import torch

from mindspeed_rl.engines.megatron_engine import MegatronEngine
from mindspeed_rl.memory import Offloader
from mindspeed_rl.memory.megatron_states import TRAIN_OPTIMIZER, optimizer_state_tensors, register_megatron_states
from mindspeed_rl.models.checkpoint import load_hf_checkpoint
from mindspeed_rl.parallel import megatron_state
from tiny_actor import ADAM, response_loss_fn, tiny_checkpoint, token_batch

SETTINGS = dataclasses.replace(ADAM, use_distributed_optimizer=True)
STEPS = 3


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return tiny_checkpoint(tmp_path_factory.mktemp("tiny_distopt") / "model", seed=17)


def _train(actor: MegatronEngine, offloader: Offloader | None) -> None:
    batch = token_batch(seed=5)
    loss_fn = response_loss_fn(batch)
    for _ in range(STEPS):
        actor.train_step(batch, micro_batch_size=4, temperature=1.0, loss_fn=loss_fn)
        if offloader is not None:
            offloader.offload_all()
            assert sum(offloader.resident_bytes().values()) == 0
            offloader.reload_all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_distributed_optimizer_offload_round_trip_is_bit_exact(world, checkpoint, dtype):
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    spec, state = load_hf_checkpoint(checkpoint)
    oracle = MegatronEngine(spec=spec, hf_state=state, params_dtype=dtype, accelerator=world,
                            parallel=megatron_state.current(), optimizer=SETTINGS)
    actor = MegatronEngine(spec=spec, hf_state=state, params_dtype=dtype, accelerator=world,
                           parallel=megatron_state.current(), optimizer=SETTINGS)
    leaves = getattr(actor.optimizer, "chained_optimizers", [actor.optimizer])
    assert all(isinstance(leaf, DistributedOptimizer) for leaf in leaves)
    offloader = Offloader(world)
    register_megatron_states(offloader, actor)

    _train(oracle, offloader=None)
    _train(actor, offloader=offloader)

    # At DP=1 the shards are whole: two fp32 moments per parameter, plus an fp32 master per bf16 one.
    expected = sum(p.numel() * (8 if p.dtype == torch.float32 else 12) for p in actor.module.parameters())
    assert offloader.resident_bytes()[TRAIN_OPTIMIZER] == expected
    for (name, got), (_, want) in zip(actor.module.named_parameters(), oracle.module.named_parameters()):
        assert torch.equal(got, want), name
    got_states = list(optimizer_state_tensors(actor.optimizer))
    want_states = list(optimizer_state_tensors(oracle.optimizer))
    assert len(got_states) == len(want_states) > 0
    assert all(torch.equal(a, b) for a, b in zip(got_states, want_states))
    assert any(s.abs().sum() > 0 for s in got_states), "the moments moved: the comparison is not vacuous"
    start = MegatronEngine(spec=spec, hf_state=state, params_dtype=dtype, accelerator=world,
                           parallel=megatron_state.current(), optimizer=None)
    assert any(not torch.equal(a, b) for a, b in zip(actor.module.parameters(), start.module.parameters()))
