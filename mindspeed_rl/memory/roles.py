"""ROLL semantics on a worker's RPCs: reload the call's states before it, offload them after it.

The hybrid worker plays several of ROLL's roles on one device, so each RPC names the role whose
states it needs. A role's states are its phase's row of the residency table (memory/residency.py)
less the states the `offload_train_*` flags pin on the device, which no RPC moves. Per call,
`batch.meta_info["is_offload_states"] = False` (or a `meta_info=` keyword for calls without a batch)
keeps the states on the device afterwards, e.g. when the very next call needs them again.
"""
from __future__ import annotations

import functools
import inspect
from typing import Callable

from mindspeed_rl.memory.context_managers import StateSet, state_offload_manager
from mindspeed_rl.memory.offload import Offloader
from mindspeed_rl.memory.residency import INFER_WEIGHTS, KV_CACHE, STATE_GROUPS, ResidencyPolicy

ACTOR_INFER, ACTOR_FORWARD, ACTOR_TRAIN, REFERENCE = "actor_infer", "actor_forward", "actor_train", "reference"
REWARD_MODEL = "reward_model"
# The phase of the residency table whose states each role holds.
ROLE_PHASES = {ACTOR_INFER: "generate", ACTOR_FORWARD: "old_logprob", ACTOR_TRAIN: "update", REFERENCE: "ref_logprob",
               REWARD_MODEL: "reward"}


def build_roles(offloader: Offloader, policy: ResidencyPolicy) -> dict[str, StateSet]:
    def states(role: str) -> list[str]:
        row = policy.resident(ROLE_PHASES[role]) - policy.pinned
        return [name for name in STATE_GROUPS if name in row and name in offloader.states]

    infer = states(ACTOR_INFER)
    return {
        # Weights are reloaded before the switch writes into them; their contents may be dropped
        # on the way out because every switch overwrites them. The KV cache is rebuilt by the
        # switch itself, after the train states have left, so the two never peak together.
        ACTOR_INFER: StateSet(offloader, infer, drop_on_offload=[INFER_WEIGHTS],
                              reload_names=[n for n in infer if n != KV_CACHE]),
        ACTOR_FORWARD: StateSet(offloader, states(ACTOR_FORWARD)),
        ACTOR_TRAIN: StateSet(offloader, states(ACTOR_TRAIN)),
        REFERENCE: StateSet(offloader, states(REFERENCE)),
        REWARD_MODEL: StateSet(offloader, states(REWARD_MODEL)),  # empty without a reward model
    }


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
    raise TypeError(f"an offloaded RPC must return metrics or (value, metrics), got {type(result).__name__}")


def offloaded_rpc(phase: str, role: str) -> Callable:
    """Decorate a worker method (the worker has `roles` and `ledger`): ROLL's automatic mode.

    Records `timing/<phase>/{onload,execute,offload,total}`, the bytes copied each way, and the
    ledger after the offload as `memory/after_<phase>/...`.
    """
    def decorate(method: Callable) -> Callable:
        @functools.wraps(method)
        def rpc(self, *args, meta_info: dict | None = None, **kwargs):
            is_offload_states = bool(_meta_info(args, meta_info).get("is_offload_states", True))
            metrics: dict[str, float] = {}
            with state_offload_manager(self.roles[role], metrics, phase, is_offload_states=is_offload_states):
                result = method(self, *args, **kwargs)
            metrics.update(self.ledger.record(f"after_{phase}").metrics())
            return _attach(result, metrics)
        # Ray unwraps methods and checks every call against the signature it finds: show it the
        # wrapper's own, which accepts `meta_info`.
        rpc.__signature__ = _with_meta_info(inspect.signature(method))
        del rpc.__wrapped__
        return rpc
    return decorate


def _with_meta_info(signature: inspect.Signature) -> inspect.Signature:
    params = [p for p in signature.parameters.values() if p.kind != p.VAR_KEYWORD]
    extra = [p for p in signature.parameters.values() if p.kind == p.VAR_KEYWORD]
    meta_info = inspect.Parameter("meta_info", inspect.Parameter.KEYWORD_ONLY, default=None)
    return signature.replace(parameters=[*params, meta_info, *extra])
