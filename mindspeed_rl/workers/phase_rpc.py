"""A worker RPC declares its phase of the residency table, and nothing else (ROLL's automatic mode).

    @phase_rpc("ref_logprob")
    def compute_ref_log_prob(self, batch): ...

enters the phase before the call (the sharding manager brings exactly the phase's row onto the device)
and leaves it after (what the next phase of the iteration needs too stays, memory/residency.py `after`).
Per call, `batch.meta_info["is_offload_states"] = False` (or a `meta_info=` keyword for calls without a
batch) skips the leave: the states stay on the device until the next call moves them; `weights_changed: True`
tells an inference rank whose training weights live elsewhere that its generate goes through the switch first.
"""
from __future__ import annotations

import contextlib
import functools
import inspect
from typing import Callable

from mindspeed_rl.memory.capacity import out_of_memory
from mindspeed_rl.memory.context_managers import state_offload_manager
from mindspeed_rl.workers.dispatch import Dispatch
from mindspeed_rl.workers.sharding_manager import PhaseStates


def _meta_info(args: tuple, explicit: dict | None) -> dict:
    info: dict = {}
    for arg in args:
        info.update(getattr(arg, "meta_info", None) or {})
    info.update(explicit or {})
    return info


def _attach(result, metrics: dict[str, float]):
    """Add `metrics` to an RPC's result: a metrics dict, or a tuple whose last item is one."""
    if isinstance(result, dict):
        return {**result, **metrics}
    if isinstance(result, tuple) and result and isinstance(result[-1], dict):
        return (*result[:-1], {**result[-1], **metrics})
    raise TypeError(f"a phase RPC must return metrics or (value, metrics), got {type(result).__name__}")


def phase_rpc(phase: str, *, label: str | None = None, progress: str | None = None,
              changes_weights: bool = False, dispatch: Dispatch | None = None) -> Callable:
    """Decorate a worker method (the worker has `sharding_manager` and `ledger`). `label` names the call in
    its metrics where it is not the phase itself (a checkpoint save runs in the update row); `progress` is what the
    console calls it while the driver waits (trainer/phase_progress.py; default: the method's name);
    `changes_weights`: after it the inference weights are stale (a disaggregated actor pushes before its next
    generate); `dispatch`: the group splits its inputs over the data-parallel ranks and gathers its results
    (workers/dispatch.py; None: every rank gets the same call).

    Records `timing/<label>/{onload,execute,offload,total}`, the bytes copied each way, the sharding
    manager's timings and push figures, and the ledger after the call as `memory/after_<label>/...`.
    """
    label = label or phase

    def decorate(method: Callable) -> Callable:
        @functools.wraps(method)
        def rpc(self, *args, meta_info: dict | None = None, **kwargs):
            info = _meta_info(args, meta_info)
            is_offload_states = bool(info.get("is_offload_states", True))
            if info.get("weights_changed"):
                self.sharding_manager.weights_changed = True
            metrics: dict[str, float] = {}
            with _device_out_of_memory_named(phase), state_offload_manager(
                    PhaseStates(self.sharding_manager, phase), metrics, label, is_offload_states=is_offload_states):
                result = method(self, *args, **kwargs)
            metrics.update(self.sharding_manager.pop_metrics())
            metrics.update(self.ledger.record(f"after_{label}").metrics())
            return _attach(result, metrics)
        # Ray unwraps methods and checks every call against the signature it finds: show it the
        # wrapper's own, which accepts `meta_info`.
        rpc.__signature__ = _with_meta_info(inspect.signature(method))
        del rpc.__wrapped__
        rpc.phase, rpc.progress, rpc.changes_weights, rpc.dispatch = phase, progress, changes_weights, dispatch
        return rpc
    return decorate


@contextlib.contextmanager
def _device_out_of_memory_named(phase: str):
    """A device allocator's own out-of-memory error (CUDA's, NPU's) as the capacity's: one line naming the phase."""
    import torch

    try:
        yield
    except torch.OutOfMemoryError as error:
        raise out_of_memory(phase, str(error).strip().splitlines()[0]) from None


def _with_meta_info(signature: inspect.Signature) -> inspect.Signature:
    params = [p for p in signature.parameters.values() if p.kind != p.VAR_KEYWORD]
    extra = [p for p in signature.parameters.values() if p.kind == p.VAR_KEYWORD]
    meta_info = inspect.Parameter("meta_info", inspect.Parameter.KEYWORD_ONLY, default=None)
    return signature.replace(parameters=[*params, meta_info, *extra])
