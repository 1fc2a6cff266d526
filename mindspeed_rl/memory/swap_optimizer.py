"""MindSpeed's swap optimizer (`megatron_training.swap_optimizer`, `swap_optimizer_times`): the optimizer states -
Adam's moments and the fp32 masters of bf16 params - live in host memory through every phase, generate, log-probs
and forward/backward included, and the optimizer step brings them to the device in buckets.

Each leaf optimizer's params are cut, in order, into `swap_optimizer_times` buckets of about equal element count
(a bucket is at most that share plus its largest param). The step runs bucket by bucket: its states come in, Adam
steps that bucket's params (the inner torch optimizer restricted to them), its masters are copied into the model's
params (Megatron's own copy, restricted alike), and its states go back out. Adam and the copy are elementwise, so
the result is the unswapped step's, bit for bit. Megatron's `step()` around it (grad copy, norm, clipping, the
distributed optimizer's param all-gather) is unchanged.

`SwappedOptimizerStates` is the TRAIN_OPTIMIZER state group of such a run: the residency table never brings it
in (memory/residency.py); a checkpoint save or load, or ROLL's `reload_states`, brings all of it through the sharding
manager; the ledger reads the most it held during a phase (`peak_since_read`): one bucket in the update on cpu, two
on a device, where bucket k+1's copy in (on the accelerator's copy stream) overlaps bucket k's step. Like the
other state implementations (memory/offload.py, memory/vllm_states.py), it moves its own storage: the bucketed step
is the one place a bucket moves, below the sharding manager, which sees the group only.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch

from mindspeed_rl.memory.offload import StorageGroup
from mindspeed_rl.memory.residency import TRAIN_OPTIMIZER

# (model params, their main params) group-list attributes of Megatron's mixed-precision optimizers: the copy from
# main to model params zips each pair. Float16OptimizerWithFloat16Params, then DistributedOptimizer.
_MAIN_MODEL_PAIRS = (("float16_groups", "fp32_from_float16_groups"),
                     ("model_float16_groups", "shard_fp32_from_float16_groups"),
                     ("model_fp32_groups", "shard_fp32_groups"))
# Main params that are fp32 copies of bf16 params (optimizer states); the others are the model's own params.
_MASTER_ATTRIBUTES = ("fp32_from_float16_groups", "shard_fp32_from_float16_groups")


@dataclass
class _Bucket:
    members: set[int]       # ids of the inner optimizer's params stepped with this bucket
    states: StorageGroup    # their Adam moments and fp32 masters


def leaf_optimizers(optimizer) -> list:
    return list(getattr(optimizer, "chained_optimizers", [optimizer]))


def split_into_buckets(params: list[torch.Tensor], times: int) -> list[list[torch.Tensor]]:
    """`params` in order, cut into at most `times` runs of about equal element count (each at most the share plus
    its last param)."""
    share = -(-sum(p.numel() for p in params) // max(times, 1))
    buckets: list[list[torch.Tensor]] = [[]]
    filled = 0
    for param in params:
        if filled >= share and buckets[-1]:
            buckets.append([])
            filled = 0
        buckets[-1].append(param)
        filled += param.numel()
    return [bucket for bucket in buckets if bucket]


class SwappedOptimizerStates:
    """The optimizer states as host-resident buckets, and the bucketed step installed on the optimizer."""

    name = TRAIN_OPTIMIZER

    def __init__(self, optimizer, accelerator, *, times: int, overlap_copies: bool = True):
        """`overlap_copies` False: one bucket at a time on a device too (benchmarks/bench_swap_optimizer.py's
        serial side)."""
        self._buckets: list[list[_Bucket]] = []  # per leaf optimizer
        self._peak = 0
        self._stream = accelerator.copy_stream() if overlap_copies else None
        for index, leaf in enumerate(leaf_optimizers(optimizer)):
            masters = {id(p) for attribute in _MASTER_ATTRIBUTES for group in getattr(leaf, attribute, [])
                       for p in group}
            params = [p for group in leaf.optimizer.param_groups for p in group["params"]]
            buckets = [_Bucket({id(p) for p in bucket}, StorageGroup(
                f"{TRAIN_OPTIMIZER}[{index}.{number}]", _collector(leaf.optimizer, bucket, masters), accelerator))
                for number, bucket in enumerate(split_into_buckets(params, times))]
            self._buckets.append(buckets)
            _install_bucketed_step(leaf, buckets, self._held, accelerator, self._stream)

    def _groups(self) -> list[StorageGroup]:
        return [bucket.states for buckets in self._buckets for bucket in buckets]

    def _held(self, nbytes: int) -> None:
        self._peak = max(self._peak, nbytes)

    @property
    def num_buckets(self) -> int:
        return len(self._groups())

    @property
    def resident(self) -> bool:
        return any(group.resident for group in self._groups())

    def resident_bytes(self) -> int:
        return sum(group.resident_bytes() for group in self._groups())

    def peak_since_read(self) -> int:
        """The most these states held on the device since the last call (a step's bucket), or what they hold now."""
        peak, self._peak = max(self._peak, self.resident_bytes()), 0
        return peak

    def bucket_bytes(self) -> list[int]:
        """Each bucket's bytes (resident or mirrored): what one bucket of the step brings in."""
        return [size for sizes in self._bucket_sizes() for size in sizes]

    def _bucket_sizes(self) -> list[list[int]]:
        """Per leaf optimizer, each bucket's bytes in step order."""
        return [[max(b.states.resident_bytes(), b.states.host_bytes()) for b in buckets] for buckets in self._buckets]

    @property
    def buckets_in_flight(self) -> int:
        """Buckets on the device at once in the step: two where the next one's copy overlaps the step, else one."""
        return 1 if self._stream is None else 2

    def step_peak_bytes(self) -> int:
        """The most the step holds at once: the largest run of `buckets_in_flight` consecutive buckets."""
        n = self.buckets_in_flight
        return max((sum(run[i:i + n]) for run in self._bucket_sizes() for i in range(len(run))), default=0)

    def host_bytes(self) -> int:
        return sum(group.host_bytes() for group in self._groups())

    def storage_keys(self) -> set[int]:
        return set().union(*(group.storage_keys() for group in self._groups()))

    def offload(self, *, keep_contents: bool | None = None) -> int:
        return sum(group.offload(keep_contents=keep_contents) for group in self._groups())

    def reload(self) -> int:
        copied = sum(group.reload() for group in self._groups())
        self._held(self.resident_bytes())
        return copied


def _collector(inner, bucket: list[torch.Tensor], masters: set[int]):
    def collect():
        for param in bucket:
            for key, value in inner.state.get(param, {}).items():
                if key != "step" and torch.is_tensor(value):  # `step` stays a host scalar (not capturable)
                    yield value
            if id(param) in masters:
                yield param.data
    return collect


def _install_bucketed_step(leaf, buckets: list[_Bucket], held, accelerator, stream) -> None:
    """The leaf's inner step becomes the bucketed step with each bucket's copy to the model params; Megatron's own
    copy after it then has nothing left to do. With a copy stream (a device), bucket k+1's states come in on it
    while bucket k steps: two buckets on the device at once, the copy hidden behind the step."""
    inner = leaf.optimizer
    # FP32Optimizer steps the model's own params: nothing to copy.
    step, copy = inner.step, getattr(leaf, "_copy_main_params_to_model_params", lambda: None)

    def bucketed_step(closure=None):
        for number, bucket in enumerate(buckets):
            bucket.states.reload(stream=stream)  # nothing left to do when it came in ahead
            accelerator.wait_for(stream)
            if stream is not None and number + 1 < len(buckets):
                buckets[number + 1].states.reload(stream=stream)
            with _only(inner, leaf, bucket.members):
                step()
                copy()
            held(sum(other.states.resident_bytes() for other in buckets))
            bucket.states.offload()  # waits for the device: bucket k+1 has arrived too

    inner.step = bucketed_step
    if hasattr(leaf, "_copy_main_params_to_model_params"):
        leaf._copy_main_params_to_model_params = lambda: None


@contextlib.contextmanager
def _only(inner, leaf, members: set[int]):
    """The inner optimizer's param groups and the leaf's main/model group lists narrowed to `members`."""
    saved_groups = inner.param_groups
    saved_lists = {}
    inner.param_groups = [dict(group, params=[p for p in group["params"] if id(p) in members])
                          for group in saved_groups]
    for model_attribute, main_attribute in _MAIN_MODEL_PAIRS:
        if not hasattr(leaf, main_attribute):
            continue
        models, mains = getattr(leaf, model_attribute), getattr(leaf, main_attribute)
        saved_lists[model_attribute], saved_lists[main_attribute] = models, mains
        pairs = [[(model, main) for model, main in zip(model_group, main_group) if id(main) in members]
                 for model_group, main_group in zip(models, mains)]
        setattr(leaf, model_attribute, [[model for model, _ in group] for group in pairs])
        setattr(leaf, main_attribute, [[main for _, main in group] for group in pairs])
    try:
        yield
    finally:
        inner.param_groups = saved_groups
        for attribute, value in saved_lists.items():
            setattr(leaf, attribute, value)
