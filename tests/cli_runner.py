"""Runs `python cli/train_grpo.py` (or another entry point) the way a user does, in a subprocess, for the
end-to-end tests."""
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def run_cli(tmp_path, config_name: str, *overrides: str, timeout: int = 600, env: dict[str, str] | None = None,
            script: str = "cli/train_grpo.py") -> subprocess.CompletedProcess:
    cmd = [sys.executable, script, "--config-name", config_name, *overrides,
           f"hydra.run.dir={tmp_path / 'run'}"]
    return subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, "RAY_ACCEL_ENV_VAR_OVERRIDE_ON_ZERO": "0", **(env or {})})
