"""Runs `python cli/train_grpo.py` (or another entry point) the way a user does, in a process of its own, for the
end-to-end tests (forked from the session's preloaded server: tests/preloaded.py)."""
import os
import subprocess
from pathlib import Path

from preloaded import run_script

REPO = Path(__file__).resolve().parents[1]


# The PNGs a run draws at its end (runtime.training_curves, runtime.memory_timeline): matplotlib and the drawing are
# ~1.5 s of each run here; the tests that check the pictures ask for them (`plots=True`).
NO_PLOTS = ("runtime.training_curves=false", "runtime.memory_timeline=false")


def run_cli(tmp_path, config_name: str, *overrides: str, timeout: int = 600, env: dict[str, str] | None = None,
            script: str = "cli/train_grpo.py", shared_ray: bool = True, plots: bool = False) -> subprocess.CompletedProcess:
    """`shared_ray`: a run that needs Ray joins the session's one-node cluster (Ray's RAY_ADDRESS variable, which
    trainer/setup.py's start_ray honours) instead of starting and ending its own: ~7 s less per 2-rank run here."""
    args = ["--config-name", config_name, *(() if plots else NO_PLOTS), *overrides, f"hydra.run.dir={tmp_path / 'run'}"]
    joins = shared_ray and not any(o.startswith("runtime.ray_address=") for o in overrides)
    ray_env = {"RAY_ADDRESS": shared_ray_address()} if joins else {}
    return run_script(script, args, cwd=REPO, timeout=timeout,
                      env={**os.environ, "RAY_ACCEL_ENV_VAR_OVERRIDE_ON_ZERO": "0", **ray_env, **(env or {})})


_SHARED_RAY: list[str] = []


def shared_ray_address() -> str:
    """The test session's one-node Ray cluster, started on first use and ended when the session's process exits."""
    if not _SHARED_RAY:
        import atexit
        import shutil
        import tempfile

        from two_nodes import one_node

        work_dir = Path(tempfile.mkdtemp(prefix="msrl-shared-ray-"))
        cluster = one_node(work_dir, num_cpus=8)
        _SHARED_RAY.append(cluster.__enter__())

        def end() -> None:
            cluster.__exit__(None, None, None)
            shutil.rmtree(work_dir, ignore_errors=True)

        atexit.register(end)
    return _SHARED_RAY[0]
