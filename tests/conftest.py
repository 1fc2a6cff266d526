import os

# Everything here runs offline and in-process; vLLM must not spawn its engine core.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")


import pytest

from resharding_oracle import free_port


@pytest.fixture(scope="session")
def world():
    """A one-rank world with Megatron's parallel state (TP1/PP1), shared by in-process tests: gloo on
    CPU; `MINDSPEED_RL_TEST_DEVICE=cuda` (make gpu-check) runs the same tests on the GPU over nccl. The engines a
    test builds in it take its groups, `megatron_state.current()`."""
    return one_rank_world()[0]


def one_rank_world():
    """The `world` fixture's accelerator and its groups (RankGroups), for the benchmarks that run in it."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    from mindspeed_rl.accelerator import get_accelerator
    from mindspeed_rl.parallel import megatron_state

    accelerator = get_accelerator(os.environ.get("MINDSPEED_RL_TEST_DEVICE", "cpu"))
    if not dist.is_initialized():
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
        accelerator.set_device(0)
        dist.init_process_group(accelerator.distributed_backend, rank=0, world_size=1)
    if not ps.model_parallel_is_initialized():
        ps.initialize_model_parallel(tensor_model_parallel_size=1, pipeline_model_parallel_size=1)
    accelerator.seed_model_parallel_rng(1)
    return accelerator, megatron_state.current()
