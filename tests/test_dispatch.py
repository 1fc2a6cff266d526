"""Dispatch by the group (workers/dispatch.py): each rank's share of a call's inputs and the gathered results, against
the layouts' own coordinates (parallel/layout.py). In-process: pure arithmetic over the places the ranks report."""
import pytest
import torch

from mindspeed_rl.parallel.layout import InferLayout, TrainLayout
from mindspeed_rl.protocol import RolloutBatch
from mindspeed_rl.workers.dispatch import INFER_DP, TRAIN_DP, DataParallelPlace, Dispatch, gather, split_call
from mindspeed_rl.workers.phase_rpc import phase_rpc


class Rank:
    @phase_rpc("old_logprob", dispatch=Dispatch(TRAIN_DP, "batch"))
    def forward(self, batch, temperature: float = 1.0): ...

    @phase_rpc("generate", dispatch=Dispatch(INFER_DP, "prompt_token_ids", "max_tokens"))
    def generate(self, prompt_token_ids, iteration=None, n=None, greedy=False, max_tokens=None): ...


def _train_places(layout: TrainLayout, world: int) -> list[dict]:
    """What each rank reports (RankWorker.dispatch_places) for a training layout."""
    places = []
    for rank in range(world):
        c = layout.of(rank, world)
        collected = c.tp_rank == 0 and c.cp_rank == 0 and c.pp_rank == layout.pp - 1
        places.append({TRAIN_DP: DataParallelPlace(dp_rank=c.dp_rank, dp_size=layout.dp(world), collected=collected)})
    return places


def _batch(samples: int) -> RolloutBatch:
    prompts = [[i + 1] for i in range(samples)]
    return RolloutBatch.from_token_lists(prompts, [[7, i + 1] for i in range(samples)], pad_id=0, response_width=2)


def test_a_train_dp_call_gives_each_rank_its_dp_share_and_a_block_one_object():
    layout, world = TrainLayout(tp=2, cp=2, pp=2), 16  # DP 2
    places = _train_places(layout, world)
    batch = _batch(8)
    dispatched = split_call(Rank.forward, Rank.forward.dispatch, places, (batch,), {"temperature": 0.5})
    for rank, ((args, kwargs), (start, stop)) in enumerate(zip(dispatched.arguments, dispatched.ranges)):
        dp_rank = layout.of(rank, world).dp_rank
        assert (start, stop) == (4 * dp_rank, 4 * dp_rank + 4)
        assert torch.equal(args[0].input_ids, batch.input_ids[start:stop])
        assert kwargs == {"temperature": 0.5} or args[1:] == (0.5,)
    shares = {id(args[0]) for args, _ in dispatched.arguments}
    assert len(shares) == 2  # one object per DP share, whatever the block size


def test_gathering_keeps_the_collected_ranks_values_as_shards_of_their_samples():
    layout, world = TrainLayout(tp=2, pp=2), 8  # DP 2
    places = _train_places(layout, world)
    dispatched = split_call(Rank.forward, Rank.forward.dispatch, places, (_batch(6),), {})
    results = [(torch.full((stop - start,), float(rank)), {"rank": rank})
               for rank, (start, stop) in enumerate(dispatched.ranges)]
    gathered = gather(results, dispatched, places)
    collected = [rank for rank in range(world) if gathered[rank][0].value is not None]
    # TP rank 0 of the last stage of each DP rank: ranks 4 (dp 0) and 6 (dp 1) in tp-cp-ep-dp-pp order.
    assert collected == [4, 6]
    assert [(gathered[r][0].start, gathered[r][0].stop) for r in collected] == [(0, 3), (3, 6)]
    assert all(gathered[r][0].value is results[r][0] for r in collected)
    assert [m for _, m in gathered] == [{"rank": r} for r in range(world)]


def test_an_update_returning_metrics_only_is_handed_back_as_it_is():
    places = _train_places(TrainLayout(), 2)
    dispatched = split_call(Rank.forward, Rank.forward.dispatch, places, (_batch(4),), {})
    assert gather([{"loss": 1.0}, {"loss": 1.0}], dispatched, places) == [{"loss": 1.0}, {"loss": 1.0}]


def test_an_infer_dp_call_splits_the_prompts_and_their_budgets_balanced():
    layout, world = InferLayout(tp=2), 6  # DP 3
    places = [{INFER_DP: DataParallelPlace(dp_rank=layout.dp_rank(rank), dp_size=3, collected=rank % 2 == 0)}
              for rank in range(world)]
    prompts, budgets = [[1], [2], [3], [4]], [5, 6, 7, 8]
    dispatched = split_call(Rank.generate, Rank.generate.dispatch, places, (prompts, 3), {"max_tokens": budgets})
    assert dispatched.ranges == [(0, 1), (0, 1), (1, 2), (1, 2), (2, 4), (2, 4)]
    args, kwargs = dispatched.arguments[4]
    assert args[:2] == ([[3], [4]], 3) and kwargs["max_tokens"] == [7, 8]


def test_dispatched_arguments_of_different_lengths_are_refused():
    places = [{INFER_DP: DataParallelPlace(dp_rank=0, dp_size=1, collected=True)}]
    with pytest.raises(ValueError, match="differ in length"):
        split_call(Rank.generate, Rank.generate.dispatch, places, ([[1], [2]],), {"max_tokens": [1]})
