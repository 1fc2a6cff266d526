"""msprobe_config's dumps of a CLI run (config/msprobe.py, workers/stage_probe.py), checked where a CLI run is made
anyway (tests/test_train_grpo_e2e.py) rather than by a run of its own."""
import json
from pathlib import Path

import numpy as np

M = "msprobe_config"
# The one-rank demo's stages: it generates, scores with its reference and its actor (old log-probs), and updates.
DEMO_STAGES = ("actor_generate_sequences", "reference_compute_log_prob", "actor_compute_log_prob", "actor_update")


def msprobe_overrides(dump: Path) -> tuple[str, ...]:
    """Every dump on, the stage dumps for debugger step 1 only (the second update, iteration 2)."""
    return (f"{M}.msprobe=true", f"{M}.dump_path={dump}", f"{M}.key_data_dump=true", f"{M}.configurations_dump=true",
            f"{M}.actor_train_dump=true", f"{M}.actor_infer_dump=true", f"{M}.reference_dump=true",
            f"{M}.token_range_start=0", f"{M}.token_range_end=3", f"{M}.step_start=1", f"{M}.step_end=1")


def assert_msprobe_dumps(dump: Path, *, train_iters: int) -> None:
    configurations = json.loads((dump / "configurations.json").read_text())
    assert {"actor", "rl", "generate"} <= set(configurations), sorted(configurations)
    assert configurations["msprobe_config"]["dump_path"] == str(dump)
    for stage in DEMO_STAGES:  # the chosen debugger step only, each with its modules' forward statistics
        steps = sorted(p.name for p in (dump / stage).iterdir() if p.is_dir())
        assert steps == ["step1"], (stage, steps)
        dumped = json.loads(next((dump / stage / "step1").rglob("dump.json")).read_text())["data"]
        forward = [name for name in dumped if ".forward." in name]
        assert forward, (stage, list(dumped)[:5])
        stats = next(iter(dumped[forward[0]]["output"]))
        assert {"Max", "Min", "Mean", "Norm"} <= set(stats), stats
    update = json.loads(next((dump / "actor_update" / "step1").rglob("dump.json")).read_text())["data"]
    assert any(".backward." in name for name in update)  # the update's backward too
    _assert_key_data(dump / "data", train_iters)


def _assert_key_data(data: Path, train_iters: int) -> None:
    """Each update micro-batch's six tensors (SingleSave), per step; the first micro-batch of an update is scored by
    the weights that made its old log-probs (bit for bit), later ones after optimizer steps; each file's statistics
    are its values'."""
    assert sorted(p.name for p in data.iterdir()) == sorted(
        ("advantages", "kl_loss", "log_prob", "loss", "old_log_prob", "ref_log_prob"))
    assert sorted(p.name for p in (data / "log_prob").iterdir()) == [f"step{k}" for k in range(train_iters)]
    micro = sorted((data / "log_prob" / "step0" / "rank0").iterdir(), key=lambda m: int(m.name[len("micro_step"):]))
    assert len(micro) > 1 and all(m.name.startswith("micro_step") for m in micro)

    def values(key: str, m: Path):
        return np.load(data / key / "step0" / "rank0" / m.name / f"{key}.npy")

    np.testing.assert_array_equal(values("log_prob", micro[0]), values("old_log_prob", micro[0]))
    assert not np.array_equal(values("log_prob", micro[-1]), values("old_log_prob", micro[-1]))  # the policy moved
    new = values("log_prob", micro[-1])
    stats = json.loads((data / "log_prob" / "step0" / "rank0" / micro[-1].name / "log_prob.json").read_text())["data"]
    assert stats["shape"] == list(new.shape) and np.isclose(stats["max"], new.max(), rtol=1e-6), stats
    assert np.isclose(stats["norm"], np.linalg.norm(new.astype(np.float64)), rtol=1e-5), stats
