"""MindSpeed's swap optimizer (memory/swap_optimizer.py) on real Megatron-core actors: the optimizer states stay on
the host through every phase and the step brings them in bucket by bucket, yet params, fp32 masters and Adam moments
end identical (torch.equal) to an actor that never swapped - fp32 and bf16, plain and distributed optimizer. The
ledger's optimizer bytes are at most one bucket in the update (two on a device, the next one's copy overlapping the
step), none between phases; the residency table never
brings them in; the buckets are bounded by their share plus the largest param.

Runs where: in the pytest process, a 1-rank gloo world (shared with the other single-rank tests).
"""
import dataclasses

import pytest
import torch

from mindspeed_rl.engines.megatron_engine import MegatronEngine
from mindspeed_rl.memory import Offloader
from mindspeed_rl.memory.megatron_states import optimizer_state_tensors, register_megatron_states
from mindspeed_rl.memory.residency import PHASES, TRAIN_OPTIMIZER, ResidencyPolicy
from mindspeed_rl.memory.swap_optimizer import split_into_buckets
from mindspeed_rl.models.checkpoint import load_hf_checkpoint
from mindspeed_rl.parallel import megatron_state
from tiny_actor import ADAM, response_loss_fn, tiny_checkpoint, token_batch

STEPS = 3
TIMES = 4


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return tiny_checkpoint(tmp_path_factory.mktemp("tiny_swap") / "model", seed=12)


@pytest.mark.parametrize("dtype,distributed", [(torch.float32, False), (torch.bfloat16, False),
                                               (torch.bfloat16, True)], ids=["fp32", "bf16", "bf16-distributed"])
def test_the_swapped_step_is_the_unswapped_step_bit_for_bit(world, checkpoint, dtype, distributed):
    spec, state = load_hf_checkpoint(checkpoint)
    adam = dataclasses.replace(ADAM, use_distributed_optimizer=distributed)
    oracle = MegatronEngine(spec=spec, hf_state=state, params_dtype=dtype, accelerator=world,
                            parallel=megatron_state.current(), optimizer=adam)
    actor = MegatronEngine(spec=spec, hf_state=state, params_dtype=dtype, accelerator=world,
                           parallel=megatron_state.current(), optimizer=adam)
    offloader = Offloader(world)
    register_megatron_states(offloader, actor, swap_optimizer_times=TIMES)
    swapped = offloader.states[TRAIN_OPTIMIZER]
    batch = token_batch(seed=5)
    if dtype == torch.bfloat16:  # the fp32 masters exist from the build: they leave with the first phase change
        assert swapped.resident_bytes() > 0
    offloader.offload(TRAIN_OPTIMIZER)
    peaks = []
    for _ in range(STEPS):
        oracle.train_step(batch, micro_batch_size=4, temperature=1.0, loss_fn=response_loss_fn(batch))
        actor.train_step(batch, micro_batch_size=4, temperature=1.0, loss_fn=response_loss_fn(batch))
        assert swapped.resident_bytes() == 0, "every bucket went back to the host"
        peaks.append(swapped.peak_since_read())

    buckets = swapped.bucket_bytes()
    total = sum(p.numel() * (8 if p.dtype == torch.float32 else 12) for p in actor.module.parameters())
    if distributed:  # the distributed optimizer's states cover its (padded) shard of the buffers
        assert sum(buckets) >= total
    else:
        assert sum(buckets) == total
    assert 1 < swapped.num_buckets <= TIMES and max(peaks) == swapped.step_peak_bytes() < sum(buckets)
    # cpu: one bucket at a time; a device: bucket k+1 arrives on the copy stream while bucket k steps
    assert swapped.buckets_in_flight == (1 if world.is_host else 2)
    if world.is_host:
        assert max(peaks) == max(buckets)
    for (name, got), (_, want) in zip(actor.module.named_parameters(), oracle.module.named_parameters()):
        assert torch.equal(got, want), name
    offloader.reload(TRAIN_OPTIMIZER)  # as a checkpoint save does: every state back
    got, want = list(optimizer_state_tensors(actor.optimizer)), list(optimizer_state_tensors(oracle.optimizer))
    assert len(got) == len(want) > 0
    for index, (a, b) in enumerate(zip(got, want)):
        assert torch.equal(a, b), index


def test_no_phase_brings_the_swapped_states_in():
    policy = ResidencyPolicy.offloading(swap_optimizer=True)
    assert all(TRAIN_OPTIMIZER not in policy.resident(phase) for phase in PHASES)
    pinned = ResidencyPolicy(offload_train_param=False, offload_train_grad=False, offload_train_optimizer=False,
                             swap_optimizer=True)
    assert all(TRAIN_OPTIMIZER not in pinned.resident(phase) for phase in PHASES)


def test_a_bucket_is_at_most_its_share_plus_its_largest_param():
    params = [torch.empty(n) for n in (10, 50, 5, 5, 30, 1, 1, 100, 3)]
    buckets = split_into_buckets(params, 4)
    share = -(-sum(p.numel() for p in params) // 4)
    assert [p for bucket in buckets for p in bucket] == params  # in order, each once
    assert len(buckets) <= 4
    assert all(sum(p.numel() for p in bucket) <= share + max(p.numel() for p in bucket) for bucket in buckets)


def _their_plan(*overrides: str):
    from pathlib import Path

    from hydra import compose, initialize_config_dir

    from mindspeed_rl.config import load_config
    from mindspeed_rl.config.overrides import search_path_override
    from mindspeed_rl.planner.from_config import architecture, plan_config, resolve_hf_config

    repo = Path(__file__).resolve().parents[1]
    with initialize_config_dir(config_dir=str(repo / "tests/data/mindspeed_rl_recipes"), version_base="1.3"):
        cfg = compose(config_name="grpo_deepseek_r1_671b_A3",
                      overrides=[*overrides, search_path_override(str(repo / "configs"))])
    config = load_config(cfg)
    return plan_config(config, architecture(resolve_hf_config(config)), device_memory=64 * 10**9,
                       with_switch=False)[0]


def test_their_swap_recipes_plan_one_bucket_of_optimizer_states_and_fit_their_devices():
    """The plan of MindSpeed-RL's DeepSeek-V3 recipe (swap_optimizer: true, its 256 devices of 64 GB): the optimizer
    states are on the device in no phase but the update, and there two buckets (each 1/16 of them plus at most the
    largest param's: one stepping, the next coming in on the copy stream); FITS, where keeping them on the device all through did not (as `cli/plan.py` plans it)."""
    swapped, kept = _their_plan(), _their_plan("megatron_training.swap_optimizer=false")
    optimizer = {phase: row["optimizer_states"] for phase, row in swapped.table().items()}
    full = kept.table()["update"]["optimizer_states"]
    assert all(value == 0 for phase, value in optimizer.items() if phase != "update"), optimizer
    assert full / 8 <= optimizer["update"] < full / 4  # two buckets: the next one's copy overlaps the step
    assert swapped.fits() is True and kept.fits() is False
