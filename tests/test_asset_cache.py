"""Generated demo assets are content-addressed: one directory per parameter set, made once under an
exclusive flock, renamed into place whole, never modified afterwards.

The concurrency tests start real processes (subprocesses, as two `train_grpo.py` runs would be) that wait
on a shared start signal, so their generations overlap.
"""
import fcntl
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from mindspeed_rl.config import ConfigError
from mindspeed_rl.data.asset_cache import LOCK_FILE, MANIFEST_FILE, asset_dir_name, ensure_generated

REPO = Path(__file__).resolve().parents[1]
# Small enough to generate in well under a second once imported.
DEMO = dict(vocab_size=16, hidden_size=32, ffn_hidden_size=64, num_layers=1, num_attention_heads=4,
            num_query_groups=2, max_position_embeddings=32, num_prompts=8, max_operand=4)


class Recorder:
    """A generator that writes `out.txt` from the params and counts its calls."""

    def __init__(self):
        self.calls = []

    def __call__(self, root: Path, params: dict) -> None:
        self.calls.append(dict(params))
        (root / "out.txt").write_text(json.dumps(params, sort_keys=True))


def _lock_is_free(data_dir: Path) -> bool:
    fd = os.open(data_dir / LOCK_FILE, os.O_RDWR)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return True
    except BlockingIOError:
        return False
    finally:
        os.close(fd)


def _entries(data_dir: Path) -> list[str]:
    return sorted(p.name for p in data_dir.iterdir())


# --- in one process --------------------------------------------------------------------------------


def test_directory_name_is_the_task_and_a_digest_of_the_parameters():
    name = asset_dir_name("arith", {"seed": 1, "num_prompts": 8})
    assert re.fullmatch(r"arith-[0-9a-f]{12}", name)
    assert asset_dir_name("arith", {"num_prompts": 8, "seed": 1}) == name  # key order does not matter
    others = {asset_dir_name("arith", {"seed": 2, "num_prompts": 8}), asset_dir_name("math_word", {"seed": 1, "num_prompts": 8}),
              asset_dir_name("arith", {"seed": 1, "num_prompts": 8, "vocab_size": None})}
    assert name not in others and len(others) == 3


def test_each_parameter_set_gets_its_own_directory_and_a_complete_one_is_reused_untouched(tmp_path):
    generate = Recorder()
    first = ensure_generated(tmp_path, "t", {"seed": 1}, required=["out.txt"], generate=generate)
    assert first.parent == tmp_path and first.name == asset_dir_name("t", {"seed": 1})
    before = (first / "out.txt").stat().st_mtime_ns, (first / "out.txt").read_text()
    assert json.loads((first / MANIFEST_FILE).read_text()) == {"task": "t", "seed": 1}

    second = ensure_generated(tmp_path, "t", {"seed": 2}, required=["out.txt"], generate=generate)
    assert second != first and json.loads((second / "out.txt").read_text()) == {"seed": 2}
    assert ensure_generated(tmp_path, "t", {"seed": 1}, required=["out.txt"], generate=generate) == first
    assert [call["seed"] for call in generate.calls] == [1, 2]  # the reuse generated nothing
    assert ((first / "out.txt").stat().st_mtime_ns, (first / "out.txt").read_text()) == before
    assert _entries(tmp_path) == sorted([LOCK_FILE, first.name, second.name])  # no staging left
    assert _lock_is_free(tmp_path)


def test_the_lock_is_held_while_generating_and_released_after(tmp_path):
    seen = []

    def generate(root, params):
        seen.append(_lock_is_free(tmp_path))
        (root / "out.txt").write_text("x")

    ensure_generated(tmp_path, "t", {"seed": 1}, required=["out.txt"], generate=generate)
    assert seen == [False] and _lock_is_free(tmp_path)


def test_a_failed_generation_leaves_no_directory_and_no_held_lock(tmp_path):
    def broken(root, params):
        (root / "half.txt").write_text("x")
        raise OSError("disk full")

    with pytest.raises(OSError, match="disk full"):
        ensure_generated(tmp_path, "t", {"seed": 1}, required=["out.txt"], generate=broken)
    assert _entries(tmp_path) == [LOCK_FILE] and _lock_is_free(tmp_path)
    with pytest.raises(RuntimeError, match="did not write out.txt"):
        ensure_generated(tmp_path, "t", {"seed": 1}, required=["out.txt"], generate=lambda root, params: None)
    assert _entries(tmp_path) == [LOCK_FILE]
    done = ensure_generated(tmp_path, "t", {"seed": 1}, required=["out.txt"], generate=Recorder())
    assert (done / "out.txt").is_file()


def test_a_complete_directory_changed_afterwards_is_refused_not_regenerated(tmp_path):
    generate = Recorder()
    done = ensure_generated(tmp_path, "t", {"seed": 1}, required=["out.txt"], generate=generate)
    (done / "out.txt").unlink()
    with pytest.raises(ConfigError) as info:
        ensure_generated(tmp_path, "t", {"seed": 1}, required=["out.txt"], generate=generate)
    assert info.value.key == "synthetic_data.data_dir"
    assert str(done) in info.value.message and "out.txt missing" in info.value.message
    assert len(generate.calls) == 1 and not (done / "out.txt").exists()


_KILLED_GENERATOR = """
import sys, time
from pathlib import Path
from mindspeed_rl.data.asset_cache import ensure_generated

def stuck(root, params):
    (root / "half.txt").write_text("x")
    Path(sys.argv[2]).write_text("generating")
    time.sleep(600)

ensure_generated(sys.argv[1], "t", {"seed": 1}, required=["out.txt"], generate=stuck)
"""


def test_a_generator_killed_midway_blocks_nobody_and_its_staging_is_cleared(tmp_path):
    data_dir, marker = tmp_path / "assets", tmp_path / "generating"
    child = subprocess.Popen([sys.executable, "-c", _KILLED_GENERATOR, str(data_dir), str(marker)], cwd=REPO)
    try:
        _wait_for(lambda: marker.exists(), child)
        assert not _lock_is_free(data_dir)
        staging = [name for name in _entries(data_dir) if name.startswith(".t-")]
        assert len(staging) == 1 and (data_dir / staging[0] / "half.txt").is_file()
    finally:
        child.send_signal(signal.SIGKILL)
        child.wait()
    # The lock file stays, but a flock dies with its process.
    assert (data_dir / LOCK_FILE).exists() and _lock_is_free(data_dir)
    done = ensure_generated(data_dir, "t", {"seed": 1}, required=["out.txt"], generate=Recorder())
    assert _entries(data_dir) == sorted([LOCK_FILE, done.name])
    assert not (done / "half.txt").exists()


# --- two processes at once -------------------------------------------------------------------------

# argv: go-file, ready-file, then the call. Waits for the go signal after its imports, so that both
# processes reach the generator within milliseconds of each other.
_AT_ONCE = """
import json, os, sys, time
from pathlib import Path
go, ready, kind, data_dir, arg = sys.argv[1:6]
if kind == "demo":
    from mindspeed_rl.data.arith_task import ensure_demo_assets
    call = lambda: [str(p) for p in ensure_demo_assets(data_dir, **json.loads(arg))]
else:
    from mindspeed_rl.data.asset_cache import ensure_generated

    def slow(root, params):
        with open(arg, "a") as log:
            log.write(f"{os.getpid()}\\n")
        time.sleep(1.0)  # a wide window for the other process to arrive
        (root / "out.txt").write_text("done")

    call = lambda: str(ensure_generated(data_dir, "t", {"seed": 1}, required=["out.txt"], generate=slow))
Path(ready).touch()
deadline = time.monotonic() + 300
while not Path(go).exists():
    if time.monotonic() > deadline:
        sys.exit("no go signal")
    time.sleep(0.005)
print(json.dumps(call()))
"""


def _run_at_once(tmp_path: Path, calls: list[tuple[str, str, str]]) -> list:
    go = tmp_path / "go"
    children = []
    for index, (kind, data_dir, arg) in enumerate(calls):
        ready = tmp_path / f"ready-{index}"
        children.append((ready, subprocess.Popen(
            [sys.executable, "-c", _AT_ONCE, str(go), str(ready), kind, data_dir, arg], cwd=REPO,
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)))
    try:
        for ready, child in children:
            _wait_for(ready.exists, child)
        go.touch()
        results = []
        for _, child in children:
            out, err = child.communicate(timeout=300)
            assert child.returncode == 0, err[-3000:]
            results.append(json.loads(out.strip().splitlines()[-1]))
        return results
    finally:
        for _, child in children:
            if child.poll() is None:
                child.kill()
                child.wait()


def test_same_parameters_at_once_are_generated_once_and_shared(tmp_path):
    data_dir, log = tmp_path / "assets", tmp_path / "calls.log"
    first, second = _run_at_once(tmp_path, [("same", str(data_dir), str(log))] * 2)
    assert first == second == str(data_dir / asset_dir_name("t", {"seed": 1}))
    assert len(log.read_text().splitlines()) == 1
    assert (Path(first) / "out.txt").read_text() == "done"
    assert _entries(data_dir) == sorted([LOCK_FILE, Path(first).name])


def test_different_seeds_at_once_each_get_their_own_assets_equal_to_a_lone_generation(tmp_path):
    from safetensors.torch import load_file

    from mindspeed_rl.data.arith_task import ensure_demo_assets

    shared = tmp_path / "shared"
    results = _run_at_once(tmp_path, [("demo", str(shared), json.dumps(dict(DEMO, seed=seed))) for seed in (1, 2)])
    dirs = [Path(model).parent for model, _ in results]
    assert dirs[0] != dirs[1] and {d.parent for d in dirs} == {shared}
    assert _entries(shared) == sorted([LOCK_FILE, dirs[0].name, dirs[1].name])
    prompts = []
    for seed, got in zip((1, 2), dirs):
        model, prompts_path = ensure_demo_assets(tmp_path / f"alone_{seed}", **DEMO, seed=seed)
        alone = model.parent
        assert got.name == alone.name
        assert sorted(p.name for p in (got / "model").iterdir()) == sorted(p.name for p in (alone / "model").iterdir())
        for name in ("tokenizer.json", "config.json"):
            assert (got / "model" / name).read_bytes() == (alone / "model" / name).read_bytes()
        weights, reference = load_file(got / "model" / "model.safetensors"), load_file(model / "model.safetensors")
        assert weights.keys() == reference.keys()
        assert all(weights[name].equal(reference[name]) for name in weights)
        assert (got / "prompts.jsonl").read_bytes() == prompts_path.read_bytes()
        prompts.append(prompts_path.read_text())
    assert prompts[0] != prompts[1]  # the seeds really differ


def _wait_for(condition, child: subprocess.Popen, timeout: float = 300.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if child.poll() is not None:
            raise AssertionError(f"the child exited with {child.returncode} before the condition held")
        if time.monotonic() > deadline:
            raise AssertionError("timed out waiting for the child")
        time.sleep(0.01)
