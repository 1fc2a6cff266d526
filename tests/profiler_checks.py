"""The profiler's files of a CLI run (profiler_config, workers/stage_profiler.py), checked where a CLI run is made
anyway (tests/test_train_grpo_e2e.py) rather than by a run of its own."""
import json
from pathlib import Path

P = "profiler_config.integrated"


def profiling_overrides(save: Path) -> tuple[str, ...]:
    """Stages actor_generate and actor_update, iteration 2 only ([2, 3)), every rank (rank 0 here)."""
    return (f"{P}.profile=true", f"{P}.stage=[actor_generate,actor_update]", f"{P}.profile_step_start=2",
            f"{P}.profile_step_end=3", f"{P}.profile_save_path={save}")


def assert_profiled_iteration_two(save: Path, stdout: str) -> None:
    """Exactly those stages' trace and table of iteration 2, traces naming the stages' work, one line per trace."""
    files = sorted(str(p.relative_to(save)) for p in save.rglob("*") if p.is_file())
    assert files == ["rank0/actor_generate_iter2.json", "rank0/actor_generate_iter2.txt",
                     "rank0/actor_update_iter2.json", "rank0/actor_update_iter2.txt"], files
    for stage in ("actor_generate", "actor_update"):
        names = {e.get("name") for e in json.loads((save / f"rank0/{stage}_iter2.json").read_text())["traceEvents"]}
        assert any(str(name).startswith("aten::") for name in names), stage
        assert f"[profiler] {stage} iteration 2: {save}/rank0/{stage}_iter2.json and {stage}_iter2.txt" \
            in stdout.splitlines()
    trace = json.loads((save / "rank0/actor_update_iter2.json").read_text())
    update_ops = {e.get("name") for e in trace["traceEvents"]}
    assert "aten::mm" in update_ops and any("Backward" in str(name) for name in update_ops)  # the update's backward
