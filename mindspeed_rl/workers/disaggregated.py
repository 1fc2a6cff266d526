"""Disaggregated actor: actor_train and actor_infer on their own devices (ROLL's disaggregated layout).

Training ranks (Megatron actor and reference, taking turns on their devices as in the colocated mode)
and inference ranks (vLLM, weights and KV cache always resident) are two Ray groups, each with its
own torch.distributed world. After a call that changes the training weights (its declaration says so:
`changes_weights`), the next rollout asks the training ranks for the `switch` phase and tells the inference ranks
their weights changed: both sharding managers then run their end of the push (resharding/weight_push.py over the
bridge), planned between the two rank sets: an inference rank receives exactly its shard, and nothing is
gathered whole. The driver sees one `ActorGroup`, so the GRPO loop is the same in both modes.
"""
from __future__ import annotations

import time
from typing import Any

from mindspeed_rl.workers.actor_group import GRACEFUL_SHUTDOWN_SECONDS, CompositeGroup, merge_metrics
from mindspeed_rl.workers.group import RayActorGroup, wait_all



class DisaggregatedActor(CompositeGroup):
    """`ActorGroup` over the training group and the inference group."""

    def __init__(self, *, config, device: str, env_vars: dict[str, str], model_dir: str, ref_model_dir: str,
                 train_worker_class: type, infer_worker_class: type):
        self.config = config
        common = dict(config=config, device=device, env_vars=env_vars, model_dir=model_dir, ref_model_dir=ref_model_dir)
        self.train = RayActorGroup(worker_class=train_worker_class, world_size=config.world_size, **common)
        try:
            self.infer = RayActorGroup(worker_class=infer_worker_class, world_size=config.infer_world_size, **common)
        except BaseException:
            self.train.kill()
            raise
        self.addresses = self.train.addresses + self.infer.addresses
        self.member_groups = (self.train, self.infer)
        self._weights_stale = True
        self._pending = None  # (each inference rank's generate_sequences refs, the training ranks' switch refs)
        self._pending_score = None  # alike for score_sequences

    def initialize(self) -> list[dict[str, float]]:
        """Both groups build their engines at once, then join the bridge and plan the push."""
        train_metrics, infer_metrics = wait_all([(group, "initialize", group.call("initialize", blocking=False))
                                                 for group in (self.train, self.infer)])
        for group in (self.train, self.infer):
            group.note_ranks()
        single_host = len({(a.host, a.ip) for a in self.addresses}) == 1
        # The bridge listens at the first training rank: a port free on its node.
        host, port = ("127.0.0.1" if single_host else self.train.addresses[0].ip), self.train.rank0_free_port()
        sizes = dict(train_world_size=self.config.world_size, infer_world_size=self.config.infer_world_size)
        dtypes = self.infer.call("inference_dtypes")[0]
        wait_all([(self.train, "connect_bridge",
                   self.train.call("connect_bridge", host, port, infer_dtypes=dtypes, **sizes, blocking=False)),
                  (self.infer, "connect_bridge", self.infer.call("connect_bridge", host, port, **sizes, blocking=False))])
        return train_metrics + infer_metrics

    def call(self, method: str, *args: Any, blocking: bool = True, **kwargs: Any) -> list[Any]:
        """Every call but the rollout runs on the training ranks (`start_generate` runs it on the others)."""
        results = self.train.call(method, *args, blocking=blocking, **kwargs)
        if getattr(self.train.declared(method), "changes_weights", False):
            self._weights_stale = True
        return results

    def wait(self, method: str, refs: list) -> list[Any]:
        return self.train.wait(method, refs)

    def start_generate(self, prompt_token_ids: list[list[int]], iteration: int | tuple[int, ...] | None = None, *,
                       n: int | None = None, greedy: bool = False, max_tokens: list[int] | None = None,
                       stop=None) -> None:
        """generate_sequences on the inference ranks, not waited for: the training ranks stay free, so the
        next rollout can run during this update (async_generation_ratio: 1). Where the weights changed, the
        training ranks enter the switch meanwhile and the inference ranks go through it before generating (the
        push); finish_generate collects both."""
        assert self._pending is None, "a rollout is already running; finish_generate first"
        self._pending = self._after_the_push("generate_sequences", prompt_token_ids, iteration, n, greedy, max_tokens,
                                             stop)

    def start_score(self, prompt_token_ids: list[list[int]], response_token_ids: list[list[int]]) -> None:
        """score_sequences on the inference ranks, not waited for, under the training ranks' weights (pushed first
        where they changed, as for a rollout): the mismatch ledger's re-score of a one-step off-policy rollout."""
        assert self._pending_score is None, "a re-score is already running; finish_score first"
        self._pending_score = self._after_the_push("score_sequences", prompt_token_ids, response_token_ids)

    def finish_score(self) -> list[Any]:
        """The started re-score's per-rank (Shard, metrics)."""
        pending, self._pending_score = self._pending_score, None
        return self._wait_with_the_push("score_sequences", pending)[0]

    def _after_the_push(self, method: str, *args: Any) -> tuple[list, list | None]:
        """`method` on the inference ranks, not waited for; where the weights changed, the training ranks enter the
        switch meanwhile and the inference ranks go through it first (the push). (its refs, the switch's refs)"""
        switching = self.train.call("switch", blocking=False) if self._weights_stale else None
        refs = self.infer.call(method, *args, meta_info={"weights_changed": self._weights_stale}, blocking=False)
        self._weights_stale = False
        return refs, switching

    def _wait_with_the_push(self, method: str, pending: tuple[list, list | None]) -> list:
        """[each inference rank's results] + [each training rank's switch metrics] where it pushed."""
        refs, switching = pending
        return wait_all([(self.infer, method, refs)] + ([(self.train, "switch", switching)] if switching else []))

    def finish_generate(self) -> list[Any]:
        """The started rollout's results (each inference rank's), with the push's and the wait's metrics."""
        assert self._pending is not None, "no rollout was started"
        pending, self._pending = self._pending, None
        started = time.perf_counter()
        results, *sent = self._wait_with_the_push("generate_sequences", pending)
        shard, metrics = results[0]
        # rank 0's metrics are the iteration's (merge_metrics); the push's sums over both rank sets.
        results[0] = (shard, {**metrics, **(_push_totals([m for _, m in results], sent[0]) if sent else {}),
                              "timing/rollout_wait": time.perf_counter() - started})
        return results

    def _close_ranks(self) -> None:
        """Both groups close at once: they leave the bridge together."""
        groups = (self.train, self.infer)
        for group in groups:
            group.deadlines.base["shutdown"] = GRACEFUL_SHUTDOWN_SECONDS
        wait_all([(group, "shutdown", group.call("shutdown", blocking=False)) for group in groups])

    def kill(self) -> None:
        try:
            self.train.kill()
        finally:
            self.infer.kill()


def _push_totals(received: list[dict[str, float]], sent: list[dict[str, float]]) -> dict[str, float]:
    """The push's figures over every rank: bytes received and planned (inference ranks), sent (training ranks), and
    the largest memory figure of either group."""
    totals = {key + "_all_ranks": sum(m[key] for m in received)
              for key in ("resharding/bytes_received", "resharding/planned_bytes_received")}
    totals["resharding/bytes_sent_all_ranks"] = sum(m["resharding/bytes_sent"] for m in sent)
    return totals | {k: v for k, v in merge_metrics(sent + received).items() if k.startswith("memory/")}

