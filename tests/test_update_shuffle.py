"""The mini-batch order of `update`: seeded once per worker, so it changes from one iteration to
the next and replays from megatron_training.seed.

Runs where: in the pytest process; pure torch, no distributed world.
"""
import torch

from mindspeed_rl.workers.actor_steps import MiniBatchShuffler

SAMPLES, ITERATIONS = 64, 5


def _orders(shuffler: MiniBatchShuffler) -> list[list[int]]:
    return [shuffler.order(SAMPLES).tolist() for _ in range(ITERATIONS)]


def test_each_iteration_gets_a_new_permutation():
    orders = _orders(MiniBatchShuffler(seed=1234, shuffle=True))
    assert all(sorted(order) == list(range(SAMPLES)) for order in orders), "each order is a permutation"
    assert len({tuple(order) for order in orders}) == ITERATIONS


def test_permutations_replay_from_the_seed():
    assert _orders(MiniBatchShuffler(seed=1234, shuffle=True)) == _orders(MiniBatchShuffler(seed=1234, shuffle=True))


def test_another_seed_gives_other_permutations():
    assert _orders(MiniBatchShuffler(seed=1234, shuffle=True)) != _orders(MiniBatchShuffler(seed=1235, shuffle=True))


def test_without_shuffle_the_order_is_the_batch_order():
    assert _orders(MiniBatchShuffler(seed=1234, shuffle=False)) == [list(range(SAMPLES))] * ITERATIONS


def test_the_stream_matches_torch_randperm_from_the_seed():
    """The oracle: one generator seeded once, drawn from once per iteration."""
    generator = torch.Generator().manual_seed(7)
    expected = [torch.randperm(SAMPLES, generator=generator).tolist() for _ in range(ITERATIONS)]
    assert _orders(MiniBatchShuffler(seed=7, shuffle=True)) == expected
