"""Routing replay (R3, rl_config.routing_replay) on the training side: Megatron's routers use the experts vLLM chose
when it sampled, in the old-log-prob and update forwards; the router's own scores still weigh the chosen experts and
still train (R3: the selection is replayed, the gate is not frozen).

Megatron-core 0.16 has the hook (`TopKRouter.router_replay`, called by `topk_routing_with_score_function` with the
router's own top-k as `default_compute_topk`); its `RouterReplay` leaves to the caller when a call is a forward and
when a recompute, and replays whole tensors. `ReplayedRouter` fills the hook: per micro-batch one target set just
before the forward (`RoutingReplay.set_micro_batch`), handed again, first in first out, to the backward's recompute
of a checkpointed layer (Megatron's checkpoint runs a layer's first forward without grad, its recompute with);
positions vLLM did not record (-1: padding, the last sampled token) keep the router's own choice.

The routes travel as the batch's `routed_experts` column, [samples, positions, layers, k] aligned with `input_ids`;
`routes_of_this_rank` lays a micro-batch's out as this rank's router sees its tokens: padded rows or a packed row,
context parallelism's two chunks per sample, sequence parallelism's [s / TP] share, [s, b] flattened.
"""
from __future__ import annotations

import contextlib
from collections import deque

import torch

from mindspeed_rl.models.context_parallel import split_packed, split_sequence
from mindspeed_rl.protocol import ROUTES_COLUMN, UNRECORDED_ROUTE as UNRECORDED



class ReplayedRouter:
    """The object Megatron's router calls for its top-k (the `RouterReplay` interface)."""

    def __init__(self, router: torch.nn.Module, owner: "RoutingReplay") -> None:
        self._is_training = lambda: router.training
        self._owner = owner
        self.target: torch.Tensor | None = None  # [tokens, k] for the next forward
        self._for_recompute: deque[torch.Tensor | None] = deque()

    def get_replay_topk(self, scores: torch.Tensor, topk: int, num_groups=None, group_topk=None,
                        default_compute_topk=None) -> tuple[torch.Tensor, torch.Tensor]:
        probs, own = default_compute_topk(scores, topk, num_groups=num_groups, group_topk=group_topk)
        recompute = torch.is_grad_enabled() and bool(self._for_recompute)
        target = self._for_recompute.popleft() if recompute else self._take_target()
        if target is None:
            return probs, own
        if target.shape != own.shape:
            raise ValueError(f"routing replay: {tuple(target.shape)} recorded routes for {tuple(own.shape)} router "
                             "outputs (the routes are not laid out as this rank's tokens)")
        recorded = target[:, 0] >= 0
        if not recompute:
            self._owner.count(own, target, recorded)
        if not self._owner.forcing:
            return probs, own
        chosen = torch.where(recorded.unsqueeze(1), target, own)
        return scores.gather(1, chosen), chosen

    def _take_target(self) -> torch.Tensor | None:
        target, self.target = self.target, None
        if target is not None and self._is_training() and not torch.is_grad_enabled():
            self._for_recompute.append(target)  # a checkpointed layer: its recompute in the backward replays it too
        return target


class RoutingReplay:
    """The actor engine's routers, fed a micro-batch's recorded routes before each forward. `forcing` False measures
    only (how often the routers disagree with vLLM) and routes as the model would."""

    def __init__(self, module: torch.nn.Module, *, forcing: bool) -> None:
        from megatron.core.transformer.moe.router import TopKRouter

        self.forcing = forcing
        self.routers: dict[int, ReplayedRouter] = {}  # global layer index (0-based) -> its router's hook
        for router in module.modules():
            if isinstance(router, TopKRouter):
                hook = ReplayedRouter(router, self)
                router.router_replay = hook
                self.routers[router.layer_number - 1] = hook
        if not self.routers:
            raise ValueError("rl_config.routing_replay: the model has no MoE router to replay")
        self._paused = False
        self._counts = torch.zeros(3, dtype=torch.float64)  # used != recorded, own != recorded, recorded

    def set_micro_batch(self, routes: torch.Tensor | None) -> None:
        """`routes` [this rank's tokens, layers, k] (routes_of_this_rank) for the forward about to run; None: none."""
        for layer, hook in self.routers.items():
            hook.target = None if routes is None or self._paused else routes[:, layer].long()

    def count(self, own: torch.Tensor, target: torch.Tensor, recorded: torch.Tensor) -> None:
        differs = (own.sort(dim=1).values != target.sort(dim=1).values).any(dim=1) & recorded
        used = 0 if self.forcing else int(differs.sum())
        self._counts += torch.tensor([used, int(differs.sum()), int(recorded.sum())], dtype=torch.float64)

    def take_counts(self) -> torch.Tensor:
        """[used differently, chosen differently, recorded] (token, layer) pairs of the forwards since the last call."""
        counts, self._counts = self._counts, torch.zeros_like(self._counts)
        return counts

    def metrics(self, parallel, *, sequence_parallel: bool, device) -> dict[str, float]:
        """The counts since the last call over every rank's tokens and layers (collective over the training ranks):
        `mismatch/routing_flips` the share of recorded (token, MoE layer) pairs whose experts differ from the
        rollout's (0 when forcing), `mismatch/router_disagreement` the share the routers would have chosen otherwise."""
        counts = self.take_counts().to(device)
        groups = [(parallel.pp_group, parallel.pp), (parallel.cp_group, parallel.cp), (parallel.dp_group, parallel.dp)]
        if sequence_parallel:  # each TP rank routed its own s / TP tokens
            groups.append((parallel.tp_group, parallel.tp))
        for group, size in groups:
            if size > 1:
                torch.distributed.all_reduce(counts, group=group)
        used, chosen, recorded = counts.tolist()
        if recorded == 0:
            return {}
        return {"mismatch/routing_flips": used / recorded, "mismatch/router_disagreement": chosen / recorded}

    @contextlib.contextmanager
    def forced(self, forcing: bool):
        saved, self.forcing = self.forcing, forcing
        try:
            yield
        finally:
            self.forcing = saved

    @contextlib.contextmanager
    def paused(self):
        """The routers' own routing while the context lasts (the LoRA backbone as the reference: not the policy)."""
        saved, self._paused = self._paused, True
        try:
            yield
        finally:
            self._paused = saved


def routes_of_this_rank(mb, seq_length: int, *, parallel, sequence_parallel: bool) -> torch.Tensor | None:
    """Micro-batch `mb`'s recorded routes as this rank's routers see its tokens: [tokens, layers, k], None without."""
    routes = mb.extras.get(ROUTES_COLUMN)
    if routes is None:
        return None
    routes = _packed_routes(mb, routes) if mb.packed else _padded_routes(routes, seq_length)
    if parallel.cp > 1:
        routes = (split_packed(routes, mb.cu_seqlens, cp_rank=parallel.cp_rank, cp=parallel.cp) if mb.packed
                  else split_sequence(routes, dim=1, cp_rank=parallel.cp_rank, cp=parallel.cp))
    routes = routes.transpose(0, 1)  # Megatron's [s, b] token order
    if sequence_parallel and parallel.tp > 1:
        routes = routes.chunk(parallel.tp, dim=0)[parallel.tp_rank]
    return routes.reshape(-1, *routes.shape[2:])


def _padded_routes(routes: torch.Tensor, seq_length: int) -> torch.Tensor:
    extra = seq_length - routes.shape[1]
    if extra <= 0:
        return routes[:, :seq_length]
    return torch.cat([routes, routes.new_full((routes.shape[0], extra, *routes.shape[2:]), UNRECORDED)], dim=1)


def _packed_routes(mb, routes: torch.Tensor) -> torch.Tensor:
    """The packed row's routes: each sample's first segment-length positions, the padding segment unrecorded."""
    bounds = mb.cu_seqlens.tolist()
    parts = []
    for index, (start, stop) in enumerate(zip(bounds[:-1], bounds[1:])):
        length = stop - start
        if index < routes.shape[0]:
            parts.append(_padded_routes(routes[index:index + 1], length)[0])
        else:
            parts.append(routes.new_full((length, *routes.shape[2:]), UNRECORDED))
    return torch.cat(parts).unsqueeze(0)
