"""The rank group: what the driver holds of the actor's ranks, one protocol for every placement.

* `LocalActorGroup` (workers/local_group.py): one rank, in the driver's own process, no Ray;
* `RayActorGroup` (workers/group.py): the ranks as Ray actors, packed on one set of devices (colocated);
* `DisaggregatedActor` (workers/disaggregated.py): a training group and an inference group of their own.

The trainer sees only `ActorGroup`: SPMD calls, a rollout that can run in the background, ROLL's
cluster-level state control and the two endings. `workers/start.py` builds the right one.
"""
from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

from mindspeed_rl.workers.supervision import WorkerAddress, WorkerFailure

GRACEFUL_SHUTDOWN_SECONDS = 30.0


@runtime_checkable
class ActorGroup(Protocol):
    addresses: list[WorkerAddress]

    def initialize(self) -> list[dict[str, float]]:
        """Every rank builds its engines; returns each rank's metrics."""

    def call(self, method: str, *args: Any, blocking: bool = True, **kwargs: Any) -> list[Any]:
        """Run `method` on every rank (SPMD): each rank's result, or with blocking=False what `wait` takes."""

    def wait(self, method: str, refs: list) -> list[Any]:
        """The results of a `call(method, ..., blocking=False)`, each rank's."""

    def start_generate(self, prompt_token_ids: list[list[int]], iteration: int | tuple[int, ...] | None = None, *,
                       n: int | None = None, greedy: bool = False, max_tokens: list[int] | None = None,
                       stop=None) -> None:
        """Start the rollout of `prompt_token_ids` (`n` samples each, default rl_config's; `greedy` for
        evaluation; `max_tokens` per prompt, default sampling_config.max_tokens; `stop`, a run-ahead rollout's
        engines/group_stop.GroupStop: stopped once a global batch of groups is complete); it may run while other
        calls do (disaggregated)."""

    def finish_generate(self) -> list[Any]:
        """The started rollout's per-rank (Shard, metrics)."""

    def start_score(self, prompt_token_ids: list[list[int]], response_token_ids: list[list[int]]) -> None:
        """Start vLLM's log-prob of each response token under the weights it generates with next (pushed first where
        the training weights changed): the mismatch ledger's re-score of a rollout sampled ahead."""

    def finish_score(self) -> list[Any]:
        """The started re-score's per-rank (Shard, metrics)."""

    def begin_iteration(self, iteration: int) -> None:
        """Tell every rank of every member the trainer's iteration (profiler_config's step range)."""

    def offload_states(self, include: list[str] | None = None, *, keep_contents: bool | None = None,
                       blocking: bool = True) -> list[Any]:
        """ROLL's `actor.offload_states(blocking=True)`, on every rank."""

    def reload_states(self, include: list[str] | None = None, *, blocking: bool = True) -> list[Any]:
        """ROLL's `actor.reload_states()`, on every rank."""

    def shutdown(self) -> None:
        """After a successful run: the ranks close their engines, then every process ends."""

    def kill(self) -> None:
        """End every rank now, whatever it is doing, and remove what the ranks leave behind."""


class RankGroupBase:
    """What the groups share. A subclass gives `call`, `wait`, `kill`; the single-world groups (local, Ray)
    also `worker_class`, `deadlines` and `shm_segments`; a group with more to close than its ranks' `shutdown`,
    `_close_ranks`."""

    _pending: list | None = None  # the started rollout's refs
    _pending_score: list | None = None  # the started re-score's refs
    worker_class: type | None = None
    # Each rank's place in the data-parallel splits (workers/dispatch.py), asked once its engines are built.
    dispatch_places: list[dict] | None = None

    def declared(self, method: str):
        """RPC `method` as this group's ranks declare it (workers/parts/: its phase, console name, whether it changes
        the training weights), or None."""
        if self.worker_class is not None:
            return getattr(self.worker_class, method, None)
        return next((rpc for group in getattr(self, "member_groups", ()) if (rpc := group.declared(method))), None)

    def parts(self) -> tuple:
        """Every part its ranks compose (of every member group), in the roles' order, each once."""
        if self.worker_class is not None:
            return tuple(self.worker_class.PARTS)
        found = [part for group in getattr(self, "member_groups", ()) for part in group.parts()]
        return tuple(dict.fromkeys(found))

    def answers(self, method: str) -> bool:
        """Whether one of this group's parts declares `method` (the rank base's own calls answer everywhere)."""
        from mindspeed_rl.workers.parts import part_declaring

        if self.worker_class is not None:
            return part_declaring(self.worker_class.PARTS, method) is not None
        return any(group.answers(method) for group in getattr(self, "member_groups", ()))

    def initialize(self) -> list[dict[str, float]]:
        """Every rank builds its engines; then what the group needs of them is noted."""
        metrics = self.call("initialize")
        self.note_ranks()
        return metrics

    def note_ranks(self) -> None:
        """After `initialize`: the ranks' shared-memory segments (for the cleanup) and their data-parallel places."""
        self.shm_segments.update(name for names in self.call("shm_segments") for name in names)
        self.dispatch_places = self.call("dispatch_places")

    def split(self, method: str, args: tuple, kwargs: dict, world_size: int) -> list[tuple[tuple, dict]]:
        """Each rank's arguments of a call: its share where `method` declares a dispatch, else the same for all.
        `gathered` then turns the ranks' results into shards of the samples they were given."""
        from mindspeed_rl.workers.dispatch import split_call

        rpc = self.declared(method)
        dispatch = getattr(rpc, "dispatch", None)
        if dispatch is None or self.dispatch_places is None:
            self._dispatched.pop(method, None)
            return [(args, kwargs)] * world_size
        dispatched = split_call(rpc, dispatch, self.dispatch_places, args, kwargs)
        self._dispatched[method] = dispatched
        return dispatched.arguments

    def gathered(self, method: str, results: list) -> list:
        from mindspeed_rl.workers.dispatch import gather

        dispatched = self._dispatched.pop(method, None)
        return results if dispatched is None else gather(results, dispatched, self.dispatch_places)

    @property
    def _dispatched(self) -> dict:
        """The dispatched call of each method whose results are not yet gathered (one per method: SPMD calls)."""
        return self.__dict__.setdefault("_dispatched_calls", {})

    def start_generate(self, prompt_token_ids: list[list[int]], iteration: int | tuple[int, ...] | None = None, *,
                       n: int | None = None, greedy: bool = False, max_tokens: list[int] | None = None,
                       stop=None) -> None:
        assert self._pending is None, "a rollout is already running; finish_generate first"
        self._pending = self.call("generate_sequences", prompt_token_ids, iteration, n, greedy, max_tokens, stop,
                                  blocking=False)

    def finish_generate(self) -> list[Any]:
        assert self._pending is not None, "no rollout was started"
        refs, self._pending = self._pending, None
        return self.wait("generate_sequences", refs)

    def start_score(self, prompt_token_ids: list[list[int]], response_token_ids: list[list[int]]) -> None:
        assert self._pending_score is None, "a re-score is already running; finish_score first"
        self._pending_score = self.call("score_sequences", prompt_token_ids, response_token_ids, blocking=False)

    def finish_score(self) -> list[Any]:
        assert self._pending_score is not None, "no re-score was started"
        refs, self._pending_score = self._pending_score, None
        return self.wait("score_sequences", refs)

    def begin_iteration(self, iteration: int) -> None:
        self.call("begin_iteration", iteration)

    def offload_states(self, include: list[str] | None = None, *, keep_contents: bool | None = None,
                       blocking: bool = True) -> list[Any]:
        return self.call("offload_states", include, keep_contents, blocking=blocking)

    def reload_states(self, include: list[str] | None = None, *, blocking: bool = True) -> list[Any]:
        return self.call("reload_states", include, blocking=blocking)

    def shutdown(self) -> None:
        try:
            self._close_ranks()
        except WorkerFailure as failure:
            print(f"[shutdown] {failure}; ending the ranks", flush=True)
        finally:
            self.kill()

    def _close_ranks(self) -> None:
        self.deadlines.base["shutdown"] = GRACEFUL_SHUTDOWN_SECONDS
        self.call("shutdown")


class CompositeGroup(RankGroupBase):
    """A group made of groups, each with its own world (disaggregated: training and inference ranks; a critic on
    devices of its own beside the actor's): ROLL's cluster-level state control runs on each; a call goes to the member
    whose parts declare it (the first member for the rank base's own calls). A subclass gives `member_groups`."""

    member_groups: tuple = ()

    def member_for(self, method: str):
        return next((group for group in self.member_groups if group.answers(method)), self.member_groups[0])

    # The rollout and the re-score go to the member that holds the inference engine, whichever it is.
    def start_generate(self, prompt_token_ids: list[list[int]], iteration: int | tuple[int, ...] | None = None, *,
                       n: int | None = None, greedy: bool = False, max_tokens: list[int] | None = None,
                       stop=None) -> None:
        self.member_for("generate_sequences").start_generate(prompt_token_ids, iteration, n=n, greedy=greedy,
                                                             max_tokens=max_tokens, stop=stop)

    def finish_generate(self) -> list[Any]:
        return self.member_for("generate_sequences").finish_generate()

    def start_score(self, prompt_token_ids: list[list[int]], response_token_ids: list[list[int]]) -> None:
        self.member_for("score_sequences").start_score(prompt_token_ids, response_token_ids)

    def finish_score(self) -> list[Any]:
        return self.member_for("score_sequences").finish_score()

    def begin_iteration(self, iteration: int) -> None:
        for group in self.member_groups:  # a rank-base call, which `call` would send to the first member only
            group.begin_iteration(iteration)

    def offload_states(self, include: list[str] | None = None, *, keep_contents: bool | None = None,
                       blocking: bool = True) -> list[Any]:
        return [r for g in self.member_groups for r in g.offload_states(include, keep_contents=keep_contents,
                                                                         blocking=blocking)]

    def reload_states(self, include: list[str] | None = None, *, blocking: bool = True) -> list[Any]:
        return [r for g in self.member_groups for r in g.reload_states(include, blocking=blocking)]


def merge_shards(shards: list) -> list:
    """The reporting rank's shard for each sample range, in sample order."""
    reported = {(s.start, s.stop): s for s in shards if s.value is not None}
    return [reported[key] for key in sorted(reported)]


def merge_metrics(per_rank: list[dict[str, float]]) -> dict[str, float]:
    """Rank 0's timings; memory figures as the maximum over ranks (the device that runs out first)."""
    merged = dict(per_rank[0])
    for metrics in per_rank[1:]:
        for key, value in metrics.items():
            if key.startswith("memory/"):
                merged[key] = max(merged.get(key, 0.0), value)
    return merged
