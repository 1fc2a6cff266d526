"""The bench venv: benchmarks/.trl-venv with requirements-bench.txt, seeing .venv's packages.

Made once (a stamp file holds the hash of requirements-bench.txt; a change remakes it). The venv is created
from the interpreter .venv was made from, and a .pth file appends .venv's site-packages to its path, so TRL
runs on exactly our torch/transformers/datasets and only trl, accelerate and py-spy (about 15 MB) are
installed into it.
"""
from __future__ import annotations

import hashlib
import subprocess
import sys
import sysconfig
from pathlib import Path

BENCH_DIR = Path(__file__).resolve().parent
REPO = BENCH_DIR.parent
VENV = BENCH_DIR / ".trl-venv"
REQUIREMENTS = BENCH_DIR / "requirements-bench.txt"
STAMP = VENV / ".installed"


def bench_python() -> Path:
    return VENV / "bin" / "python"


def py_spy() -> Path:
    return VENV / "bin" / "py-spy"


def ensure_bench_venv() -> Path:
    digest = hashlib.sha256(REQUIREMENTS.read_bytes()).hexdigest()
    if STAMP.is_file() and STAMP.read_text().strip() == digest and bench_python().exists():
        return bench_python()
    base = getattr(sys, "_base_executable", sys.executable)
    print(f"[bench] creating {VENV} from {base} with {REQUIREMENTS.name}", flush=True)
    subprocess.run([base, "-m", "venv", "--clear", str(VENV)], check=True)
    purelib = Path(subprocess.run([bench_python(), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                                  check=True, capture_output=True, text=True).stdout.strip())
    ours = sysconfig.get_paths()["purelib"]  # this interpreter is .venv's (make runs it)
    (purelib / "zz_mindspeed_venv.pth").write_text(ours + "\n")
    subprocess.run([bench_python(), "-m", "pip", "install", "-q", "-r", str(REQUIREMENTS)], check=True)
    STAMP.write_text(digest + "\n")
    return bench_python()


if __name__ == "__main__":
    print(ensure_bench_venv())
