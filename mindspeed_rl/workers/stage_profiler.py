"""A rank's profiler of MindSpeed-RL's stages (`profiler_config.integrated`, config/profiler.py).

The rank builds one in `initialize` when profiling is on; its forwarder (workers/rank_worker.py) enters
`around(rpc)` for every part RPC. Only the RPCs of the chosen stages, on the listed ranks, in the iterations
[profile_step_start, profile_step_end) that the trainer announces (`begin_iteration`) run under torch.profiler; each
such call writes <profile_save_path>/rank<r>/<stage>_iter<k>.json (Chrome trace: Perfetto, chrome://tracing,
TensorBoard's profiler plugin) and <stage>_iter<k>.txt (key_averages table), each atomically.
"""
from __future__ import annotations

import contextlib
import os
from pathlib import Path
from typing import Iterator, Optional

from mindspeed_rl.config.profiler import STAGE_RPCS, IntegratedProfilerConfig
from mindspeed_rl.atomic_files import write_text_atomic

# The table's rows: enough to see where a stage's time goes without a file of every op.
TABLE_ROWS = 40


class StageProfiler:
    def __init__(self, settings: IntegratedProfilerConfig, *, rank: int, device_type: str):
        self.settings, self.rank, self.device_type = settings, rank, device_type
        self.iteration: Optional[int] = None
        # (stage, iteration) -> calls profiled: a stage run twice in one iteration (an evaluation rollout, dynamic
        # sampling's refills) writes <stage>_iter<k>_2 beside the first, not over it.
        self.calls: dict[tuple[str, int], int] = {}
        # rpc name -> stage name, for the stages chosen.
        self.stage_of = {STAGE_RPCS[stage]: stage for stage in settings.stages}
        self.directory = Path(settings.profile_save_path) / f"rank{rank}"

    def begin_iteration(self, iteration: int) -> None:
        self.iteration = iteration

    @contextlib.contextmanager
    def around(self, rpc: str) -> Iterator[None]:
        """The RPC under the profiler when its stage, this rank and the iteration are chosen; else nothing."""
        stage = self.stage_of.get(rpc)
        if stage is None or not self._chosen():
            yield
            return
        with self._profiler() as profiler, self._marker(stage):
            yield
        self._write(profiler, stage)

    def _chosen(self) -> bool:
        """This rank is listed and the iteration is in [profile_step_start, profile_step_end) (None: not told yet)."""
        s, ranks, iteration = self.settings, self.settings.ranks, self.iteration
        return (s.profile and iteration is not None and s.profile_step_start <= iteration < s.profile_step_end
                and (ranks is None or self.rank in ranks))

    def _profiler(self):
        """torch.profiler with the keys' activities and options; torch_npu's own profiler on an NPU (the same API)."""
        import torch

        s = self.settings
        module = torch.profiler
        if self.device_type == "npu":
            import torch_npu  # noqa: F401 -- only an NPU run reaches here

            module = torch_npu.profiler
        activities = [module.ProfilerActivity.CPU] if s.profile_with_cpu else []
        device_activity = {"cuda": "CUDA", "npu": "NPU"}.get(self.device_type)
        if s.profile_with_npu and device_activity is not None:
            activities.append(getattr(module.ProfilerActivity, device_activity))
        # Neither activity asked for: the host's all the same (torch.profiler needs one; the ranges still show).
        return module.profile(activities=activities or [module.ProfilerActivity.CPU],
                              record_shapes=s.profile_record_shapes, profile_memory=s.profile_with_memory,
                              with_stack=s.profile_with_module)

    def _marker(self, stage: str):
        """mstx: a range named by the stage in the trace (and NVTX on CUDA, for Nsight); else none."""
        if not self.settings.mstx:
            return contextlib.nullcontext()
        import torch

        stack = contextlib.ExitStack()
        stack.enter_context(torch.profiler.record_function(f"mstx/{stage}"))
        if self.device_type == "cuda":
            stack.enter_context(torch.cuda.nvtx.range(stage))
        return stack

    def _write(self, profiler, stage: str) -> None:
        """The trace and the table, each through a temporary file renamed into place (a reader never sees half)."""
        self.directory.mkdir(parents=True, exist_ok=True)
        count = self.calls[stage, self.iteration] = self.calls.get((stage, self.iteration), 0) + 1
        stem = self.directory / (f"{stage}_iter{self.iteration}" + (f"_{count}" if count > 1 else ""))
        trace, table = stem.with_suffix(".json"), stem.with_suffix(".txt")
        tmp = trace.with_name(f".{trace.name}.tmp")
        profiler.export_chrome_trace(str(tmp))
        os.replace(tmp, trace)
        sort = "self_cpu_time_total" if self.device_type == "cpu" else "self_device_time_total"
        text = profiler.key_averages(group_by_input_shape=self.settings.profile_record_shapes).table(
            sort_by=sort, row_limit=TABLE_ROWS)
        write_text_atomic(table, text)
        if self.rank == 0:  # rank 0 speaks for all: every profiled rank writes its own rank<r>/ beside it
            print(f"[profiler] {stage} iteration {self.iteration}: {trace} and {table.name}", flush=True)
