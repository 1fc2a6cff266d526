"""This DP rank's share of a batch, as the rank group hands it to a rank (workers/dispatch.py), for tests that drive
engines on gloo ranks without a group."""
from mindspeed_rl.workers.dispatch import TRAIN_DP, DataParallelPlace, share


def dp_share(batch):
    from mindspeed_rl.parallel import megatron_state

    parallel = megatron_state.current()
    start, stop = share(DataParallelPlace(dp_rank=parallel.dp_rank, dp_size=parallel.dp, collected=True), len(batch),
                        TRAIN_DP)
    return batch.select(slice(start, stop))
