"""The loop's derived metrics (MindSpeed-RL names and formulas), the TensorBoard sink and the
training-curves plot. Runs where: in-process, no Ray, no engines."""
import json
from pathlib import Path

import pytest
import torch

from mindspeed_rl.trainer.curves import main as curves_main
from mindspeed_rl.trainer.curves import moving_average, plot_training_curves, series_keys
from mindspeed_rl.trainer.metrics import length_stats, phase_timings, rollout_mismatch, throughput
from mindspeed_rl.trainer.sinks import TENSORBOARD_SUBDIR, MetricsSinks
from mindspeed_rl.trainer.trackers import TensorBoardTracker


def test_length_stats_are_mean_min_max():
    assert length_stats("response_length", torch.tensor([2, 4, 9])) == {
        "response_length/mean": 5.0, "response_length/min": 2.0, "response_length/max": 9.0}


def test_throughput_is_mindspeed_rl_formula_with_mean_lengths():
    # (mean response 3 + mean prompt 5) tokens x 4 samples / 2 devices = 16 tokens per device
    got = throughput(prompt_lengths=torch.tensor([5, 5, 4, 6]), response_lengths=torch.tensor([1, 5, 3, 3]),
                     world_size=2, seconds_all=4.0, seconds_rollout=2.0, seconds_update=0.5, use_max_lengths=False)
    assert got == {"e2e_tps": 4.0, "vllm_tps": 8.0, "update_tps": 32.0}


def test_log_max_throughput_uses_the_longest_sample():
    got = throughput(prompt_lengths=torch.tensor([5, 5, 4, 6]), response_lengths=torch.tensor([1, 5, 3, 3]),
                     world_size=2, seconds_all=4.0, seconds_rollout=2.0, seconds_update=0.0, use_max_lengths=True)
    assert got["e2e_tps"] == (6 + 5) * 4 / 2 / 4.0
    assert got["update_tps"] == 0.0, "a phase that took no time reports 0, not a division error"


def test_phase_timings_sum_our_parts_into_mindspeed_rl_names():
    got = phase_timings({"timing/update/total": 1.5, "timing/resharding_enter_infer": 0.25,
                         "timing/resharding_exit_infer": 0.125, "timing/onload_forward": 0.5,
                         "timing/onload_train": 0.25})
    assert got == {"timing/update": 1.5, "timing/resharding_to_infer": 0.375, "timing/resharding_to_train": 0.75}


def test_rollout_mismatch_ignores_padding():
    rollout = torch.tensor([[-1.0, -2.0, 99.0]])
    old = torch.tensor([[-1.5, -2.0, 0.0]])
    got = rollout_mismatch(rollout, old, torch.tensor([[1.0, 1.0, 0.0]]))
    assert got == {"rollout/logprob_max_abs_diff": 0.5, "rollout/logprob_mean_abs_diff": 0.25}


def test_moving_average_grows_its_window_from_the_start():
    assert moving_average([1.0, 3.0, 5.0, 7.0], 2) == [1.0, 2.0, 4.0, 6.0]


def _records(n=30):
    return [{"iteration": i, "reward/mean": i / n, "math_17k_acc_rewards/mean": i / (2 * n),
             "format_rewards/mean": 0.5, "reward/accuracy": i / n, "actor/kl_loss": 1e-3 * i,
             "response_length/mean": 4.0, "response_length/max": 6.0, "e2e_tps": 100.0, "vllm_tps": 300.0,
             "update_tps": 200.0, "actor/lr": 1e-4} for i in range(1, n + 1)]


def test_series_keys_expand_verifier_patterns():
    keys = series_keys(_records(2), ["reward/mean", "*_rewards/mean"])
    assert keys == ["reward/mean", "format_rewards/mean", "math_17k_acc_rewards/mean"]


def test_training_curves_png_draws_every_quantity(tmp_path):
    path = tmp_path / "training_curves.png"
    drawn = plot_training_curves(_records(), path)
    assert {"reward/mean", "math_17k_acc_rewards/mean", "format_rewards/mean", "reward/accuracy", "actor/kl_loss",
            "response_length/mean", "e2e_tps", "actor/lr"} <= set(drawn)
    assert path.stat().st_size > 20_000
    assert not list(tmp_path.glob("*.partial.png"))


def test_training_curves_draw_the_sparse_evaluation_records(tmp_path):
    """An evaluation record of its own before training (no reward/mean), then eval/* in every other record."""
    records = [{"iteration": 0, "eval/pass@1": 0.1, "eval/pass@4": 0.2, "eval/updates": 0}] + _records(4)
    for r in records[2::2]:
        r |= {"eval/pass@1": 0.3, "eval/pass@4": 0.5, "eval/updates": r["iteration"]}
    drawn = plot_training_curves(records, tmp_path / "curves.png")
    assert {"eval/pass@1", "eval/pass@4", "reward/mean"} <= set(drawn)
    assert series_keys(records, ["eval/pass@*"]) == ["eval/pass@1", "eval/pass@4"]


def test_a_ppo_runs_curves_show_the_value_loss_and_the_explained_variance(tmp_path):
    records = [r | {"critic/vf_loss": 1.0 / r["iteration"], "critic/explained_variance": 0.1 * r["iteration"],
                    "critic/vf_clipfrac": 0.05} for r in _records(6)]
    drawn = plot_training_curves(records, tmp_path / "curves.png")
    assert {"critic/vf_loss", "critic/explained_variance", "critic/vf_clipfrac"} <= set(drawn)


def test_training_curves_redraw_from_metrics_jsonl(tmp_path):
    metrics = tmp_path / "metrics.jsonl"
    metrics.write_text("".join(json.dumps(r) + "\n" for r in _records()))
    assert curves_main([str(metrics)]) == 0
    assert (tmp_path / "training_curves.png").stat().st_size > 20_000


def test_curves_cli_rejects_a_missing_file(tmp_path):
    with pytest.raises(SystemExit) as exit_info:
        curves_main([str(tmp_path / "nope.jsonl")])
    assert exit_info.value.code == 2


def test_sinks_write_jsonl_and_tensorboard_events(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    sinks = MetricsSinks(tmp_path, metrics_file="metrics.jsonl", trackers=[TensorBoardTracker(tmp_path)])
    for record in _records(3):
        sinks.write(record)
    sinks.close()
    lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(line)["iteration"] for line in lines] == [1, 2, 3]
    events = EventAccumulator(str(tmp_path / TENSORBOARD_SUBDIR))
    events.Reload()
    scalars = events.Scalars("reward/mean")
    assert [(s.step, round(s.value, 6)) for s in scalars] == [(1, round(1 / 3, 6)), (2, round(2 / 3, 6)), (3, 1.0)]
    assert "iteration" not in events.Tags()["scalars"]


def test_sinks_without_tensorboard_write_no_event_files(tmp_path):
    sinks = MetricsSinks(tmp_path, metrics_file="metrics.jsonl")
    sinks.write({"iteration": 1, "reward/mean": 0.5})
    sinks.close()
    assert not (tmp_path / TENSORBOARD_SUBDIR).exists()


def test_a_wandb_run_offline_holds_each_iterations_scalars(tmp_path, monkeypatch):
    """MindSpeed-RL's use_wandb without a network: the offline run file has every numeric scalar of every record."""
    from wandb_reader import history_rows

    from mindspeed_rl.trainer.trackers import WandbTracker

    monkeypatch.setenv("WANDB_MODE", "offline")
    tracker = WandbTracker(tmp_path, project="mindspeed-rl-test", name="three", save_dir="", config={"a": 1})
    sinks = MetricsSinks(tmp_path, metrics_file="metrics.jsonl", trackers=[tracker])
    records = _records(3)
    for record in records:
        sinks.write(record)
    sinks.close()
    (run_file,) = (tmp_path / "wandb").glob("offline-run-*/run-*.wandb")
    rows = history_rows(run_file)
    assert [row["_step"] for row in rows] == [1, 2, 3]
    for row, record in zip(rows, records):
        for key, value in record.items():
            if key != "iteration" and isinstance(value, (int, float)):
                assert row[key] == pytest.approx(value), key



def _write_and_close(tracker, run_dir: Path, records: list[dict]) -> None:
    sinks = MetricsSinks(run_dir, metrics_file="metrics.jsonl", trackers=[tracker])
    for record in records:
        sinks.write(record)
    sinks.close()


def _assert_every_scalar_at_its_iteration(steps: dict[int, dict[str, float]], records: list[dict]) -> None:
    assert sorted(steps) == [record["iteration"] for record in records]
    for record in records:
        for key, value in record.items():
            if key != "iteration" and isinstance(value, (int, float)):
                assert steps[record["iteration"]][key] == pytest.approx(value), (record["iteration"], key)


@pytest.mark.parametrize("mode", ["offline", "local", "cloud"])
def test_a_swanlab_run_is_written_offline_with_each_iterations_scalars(tmp_path, monkeypatch, caplog, mode):
    """MindSpeed-RL's use_swanlab without a network: offline as asked; local without swanlab's dashboard package
    and cloud without a login fall back to offline, each saying so in one warning line."""
    from tracker_readers import swanlab_scalars

    from mindspeed_rl.trainer.trackers import SwanLabTracker

    monkeypatch.delenv("SWANLAB_API_KEY", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))  # no saved swanlab login
    records = _records(3)
    _write_and_close(SwanLabTracker(tmp_path, mode=mode, project="mindspeed-rl-test", name="three", save_dir="",
                                    config={"a": 1}), tmp_path, records)
    _assert_every_scalar_at_its_iteration(swanlab_scalars(tmp_path / "swanlab"), records)
    warnings = [r.getMessage() for r in caplog.records if r.name == "mindspeed_rl.trainer.trackers"]
    assert len(warnings) == (mode != "offline"), warnings
    assert all("writing the run offline under" in w and "swanlab sync" in w for w in warnings), warnings


def test_an_mlflow_run_holds_each_iterations_scalars_and_an_unreachable_server_falls_back(tmp_path, monkeypatch,
                                                                                           caplog):
    from tracker_readers import mlflow_scalars

    from mindspeed_rl.trainer.trackers import MLflowTracker

    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_TIMEOUT", "5")
    records = _records(3)
    for directory, uri in ((tmp_path / "default", ""), (tmp_path / "down", "http://127.0.0.1:9")):
        directory.mkdir()
        _write_and_close(MLflowTracker(directory, tracking_uri=uri, project="mindspeed-rl-test", name="three",
                                       config={"a": 1}), directory, records)
        steps = mlflow_scalars(f"sqlite:///{directory / 'mlflow.db'}", experiment="mindspeed-rl-test",
                               run_name="three")
        _assert_every_scalar_at_its_iteration(steps, records)
        # The config beside the run, in the run dir (not MLflow's default ./mlartifacts)
        assert json.loads(next((directory / "mlartifacts").glob("*/artifacts/config.json")).read_text()) == {"a": 1}
    (warning,) = [r.getMessage() for r in caplog.records if r.name == "mindspeed_rl.trainer.trackers"]
    assert warning.startswith("mlflow could not reach http://127.0.0.1:9 ("), warning


@pytest.mark.parametrize(("keys", "error"), [
    ({"use_swanlab": True, "swanlab_mode": "offline", "swanlab_exp_name": "e"},
     "rl_config.swanlab_project: must name the SwanLab project and experiment with use_swanlab true"),
    ({"use_swanlab": True, "swanlab_mode": "offline", "swanlab_project": "p"},
     "rl_config.swanlab_exp_name: must name the SwanLab project and experiment with use_swanlab true"),
    ({"use_swanlab": True, "swanlab_project": "p", "swanlab_exp_name": "e"},
     "rl_config.swanlab_mode: must be one of cloud, local, offline, disabled, got ''"),
    ({"use_swanlab": True, "swanlab_mode": "online", "swanlab_project": "p", "swanlab_exp_name": "e"},
     "rl_config.swanlab_mode: must be one of cloud, local, offline, disabled, got 'online'"),
    ({"use_mlflow": True, "mlflow_exp_name": "e"},
     "rl_config.mlflow_project: must name the MLflow experiment and run with use_mlflow true"),
    ({"use_mlflow": True, "mlflow_project": "p"},
     "rl_config.mlflow_exp_name: must name the MLflow experiment and run with use_mlflow true"),
    ({"use_wandb": True, "wandb_project": "p"},
     "rl_config.wandb_exp_name: must name the wandb project and run with use_wandb true"),
])
def test_a_tracker_turned_on_needs_its_names_and_a_valid_mode(keys, error):
    from mindspeed_rl.config import ConfigError
    from mindspeed_rl.config.rl import RLConfig

    verifiers = {"verifier_function": ["base_acc"], "verifier_weight": [1.0]}
    with pytest.raises(ConfigError) as info:
        RLConfig(**verifiers, **keys)
    assert str(info.value) == error
    # Off, the keys are not checked (MindSpeed-RL's recipes leave them empty).
    RLConfig(**verifiers, **{key: value for key, value in keys.items() if not key.startswith("use_")})


def test_the_end_of_run_summary_averages_phases_and_the_ends():
    from mindspeed_rl.trainer.summary import summary_lines

    history = [{"iteration": i, "timing/all": 2.0, "timing/update/total": float(i), "memory/update/total_bytes": i << 20,
                "reward/mean": i / 20} for i in range(1, 21)]
    lines = summary_lines(history, run_dir=Path("/run"), artefacts=["metrics.jsonl"])
    assert lines[0] == "[summary] 20 iterations, 40.0 s (2.00 s each)"
    assert lines[2].split() == ["update", "10.500", "20.0"]  # mean seconds 1..20, peak 20 MiB
    assert lines[3] == "  reward: 0.275 -> 0.775 (mean of the first -> last 10 iterations)"
    assert lines[-1] == "  files: /run\n    metrics.jsonl"
    assert summary_lines([], run_dir=Path("/run"), artefacts=[]) == []
