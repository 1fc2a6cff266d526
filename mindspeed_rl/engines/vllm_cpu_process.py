"""vLLM-cpu's process-wide fixes (engines/vllm_engine.py applies them before its engine starts on CPU) and the
removal of a run's shared-memory segments, which vLLM leaves behind at exit."""
from __future__ import annotations

import contextlib
import os


def prepare_cpu_process() -> None:
    """vLLM-cpu's process-wide fixes, before its engine starts: unique shared-memory names, variable-size collectives
    for expert parallelism, the sampler's eager rank count."""
    from mindspeed_rl.engines.vllm_cpu_moe import add_cpu_variable_size_collectives

    _make_cpu_shm_names_unique()
    add_cpu_variable_size_collectives()
    _eager_logprob_ranks()


def _eager_logprob_ranks() -> None:
    """vLLM's sampler ranks each returned log-prob with a torch.compile'd count (vllm/v1/sample/ops/logprobs.py), which
    on CPU costs every rank process about 3 s at its first generate (dynamo, and inductor probing the C++ toolchain by
    compiling test programs) to save one [sequences x vocab] bool mask that the sampler's own [sequences x vocab]
    log-probs already outweigh four to one. The eager function is the same expression: the counts are equal."""
    from vllm.v1.sample import sampler

    compiled = sampler.batched_count_greater_than
    sampler.batched_count_greater_than = getattr(compiled, "__wrapped__", compiled)


def _make_cpu_shm_names_unique() -> None:
    """Name vLLM's CPU all-reduce shared-memory segments after this run's rendezvous port.

    Under external_launcher vLLM derives the name from the "env://" init method, so every run on
    a machine uses the same names: a segment left by a killed run, or a concurrent run with the
    same TP group, makes `init_shm_manager` fail with EEXIST. MASTER_PORT is shared by the ranks
    of one run and differs between runs.
    """
    from vllm.distributed.device_communicators import cpu_communicator

    shm = cpu_communicator._CPUSHMDistributed
    if getattr(shm, "_mindspeed_unique_names", False):
        return
    original = shm.make_group_name

    def make_group_name(communicator) -> str:
        name = original(communicator)
        rest = name.lstrip("/")
        return f"{name[: len(name) - len(rest)]}msrl{os.environ.get('MASTER_PORT', '0')}{rest}"

    shm.make_group_name = staticmethod(make_group_name)
    shm._mindspeed_unique_names = True


def remove_cpu_shm_segments(master_port: int | None = None) -> None:
    """Unlink this run's vLLM shared-memory segments (vLLM leaves them behind at exit). The run is
    known by its rendezvous port: this process's MASTER_PORT, or the one given (the driver's)."""
    prefix = f"msrl{master_port if master_port is not None else os.environ.get('MASTER_PORT', '0')}"
    shm_dir = "/dev/shm"
    if os.path.isdir(shm_dir):
        for name in os.listdir(shm_dir):
            if name.startswith(prefix) and "cpushm" in name:
                with contextlib.suppress(OSError):
                    os.unlink(os.path.join(shm_dir, name))
