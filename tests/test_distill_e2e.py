"""End to end: on-policy distillation (cli/train_distill.py) with the settings recipes combine (TP2 over 2 ranks, bf16,
the distributed optimizer, packed sequences) and GKD's forward KL over the teacher's top k (with the tail bucket): a
teacher that is the student's own starting checkpoint scores every sampled token, and its top k, as the student does
at the first update (the k1 gap and the loss are 0 there and not after it), the planner's teacher bytes are the
ledger's, and a run resumed from its checkpoint writes the same iteration; a teacher on devices of its own in a layout of its own (ROLL's teacher role; TP2 beside a TP1 actor) scores
as the student does too; and the demo's teacher is made once by a GRPO run of the demo. Runs where: CLI
subprocesses (Ray; 2 and 3 rank processes); ~2 min on 2 cores."""
import json

from cli_runner import REPO, run_cli
from test_config import load

from mindspeed_rl.trainer import setup

LOSS = "distillation.distillation_loss"


def _student_dir() -> str:
    """The demo's generated student checkpoint (the shared asset cache, data/tiny, made once)."""
    config = load("grpo_tiny_cpu", f"synthetic_data.data_dir={REPO / 'data' / 'tiny'}")
    return setup.resolve_assets(config)[0]


def _distill_tp2(run_dir, *extra: str):
    # One optimizer step per iteration: iteration 1's update forward is the student's start, its teacher's weights.
    done = run_cli(run_dir, "grpo_tiny_cpu_tp2_infer_dp2", "megatron_training.train_iters=2", "rl_config.init_kl_coef=0",
                   "rl_config.mini_batch_size=16",
                   "megatron_training.bf16=true", "megatron_training.use_distributed_optimizer=true",
                   "rl_config.use_remove_padding=true", "distillation.enabled=true",
                   f"distillation.teacher_models.teacher_model.model_path={_student_dir()}",
                   f"{LOSS}.loss_mode=forward_kl_topk_tail", f"{LOSS}.topk=4", f"{LOSS}.use_policy_gradient=false",
                   "megatron_training.save_interval=1", *extra, script="cli/train_distill.py", timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return done


def _stable(run_dir) -> list[dict]:
    """A run's records without what differs between any two runs (times, memory, throughput)."""
    return [{k: v for k, v in json.loads(line).items() if not k.startswith(("timing/", "memory/", "offload/"))
             and not k.endswith(("_tps", "seconds"))} for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_a_teacher_equal_to_the_student_scores_the_first_update_as_the_student(tmp_path):
    done = _distill_tp2(tmp_path, f"actor_config.save={tmp_path / 'save'}")
    assert "[init] Megatron teacher built" in done.stdout and "distill_kl=" in done.stdout
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    first, second = records
    # The same weights in the same layout, packing and dtype: the same log-probs, token for token, and over the
    # teacher's top 4 (taken from its two vocabulary shards) the student's are the teacher's: no KL, the same mass.
    assert abs(first["distill/kl_mean"]) < 1e-6 and abs(first["distill/loss"]) < 1e-6, first
    assert 0 < first["distill/teacher_mass"] <= 1
    assert abs(first["distill/teacher_mass"] - first["distill/student_mass"]) < 1e-6  # two fp32 paths to one value
    assert abs(second["distill/kl_mean"]) > 1e-4 and second["distill/loss"] > 1e-6  # the student moved, its teacher not
    for record in records:
        measured = record["memory/teacher_logprob/teacher_params_bytes"]
        assert measured > 0 and measured == record["memory/teacher_logprob/teacher_params_predicted_bytes"]
        assert record["memory/update/teacher_params_bytes"] == 0  # resident in its own phase only
    # The teacher holds no trained state: a run resumed from iteration 1's checkpoint rebuilds it from its own
    # checkpoint and writes the uninterrupted run's iteration 2.
    resumed = tmp_path / "resumed"
    _distill_tp2(resumed, f"actor_config.load={tmp_path / 'save' / 'iter_0000001'}", "actor_config.finetune=false",
                 f"actor_config.save={resumed / 'save'}")
    assert _stable(resumed / "run") == _stable(tmp_path / "run")[1:]


def test_a_teacher_on_devices_of_its_own_in_its_own_layout_scores_as_the_student(tmp_path):
    # The actor on device 0 (TP1), the teacher on devices 1-2 in TP2: its ranks are a world of their own.
    done = run_cli(tmp_path, "grpo_tiny_cpu", "megatron_training.train_iters=2", "rl_config.init_kl_coef=0",
                   "rl_config.mini_batch_size=16", "distillation.enabled=true",
                   f"distillation.teacher_models.teacher_model.model_path={_student_dir()}",
                   "distillation.teacher_models.teacher_model.inference.tensor_model_parallel_size=2",
                   "teacher.device_mapping=[1,2]", f"{LOSS}.loss_mode=k3", f"{LOSS}.use_policy_gradient=false",
                   script="cli/train_distill.py", timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    lines = done.stdout.splitlines()
    assert "  1,2     teacher" in lines and any(line.startswith("[init] teacher rank 1 ") for line in lines), lines
    first, second = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    # The student's start at TP1 and at TP2: the same log-probs up to the order of fp32 sums.
    assert abs(first["distill/kl_mean"]) < 1e-5 and abs(first["distill/loss"]) < 1e-6, first
    assert abs(second["distill/kl_mean"]) > 1e-4
    for record in (first, second):
        # Its ranks hold half the params each (TP2), in every phase; the actor's ranks none.
        measured = record["memory/teacher_logprob/teacher_params_bytes"]
        assert measured > 0 and measured == record["memory/teacher_logprob/teacher_params_predicted_bytes"]
        assert record["memory/after_teacher_logprob/teacher_params_bytes"] == measured  # it stays there
        assert "memory/update/teacher_params_bytes" not in record  # the actor's ranks have no teacher at all


def test_the_demo_teacher_is_the_demo_policy_after_grpo_made_once(tmp_path, monkeypatch):
    from mindspeed_rl.trainer import teacher

    monkeypatch.setattr(teacher, "DEMO_TEACHER_ITERATIONS", 2)
    config = load("distill_tiny_cpu", f"synthetic_data.data_dir={tmp_path / 'assets'}")
    student = setup.resolve_assets(config)[0]
    made = teacher.ensure_demo_teacher(config, student)
    assert json.loads((made / "config.json").read_text())["architectures"] == ["Qwen2ForCausalLM"]
    runs = [json.loads(line) for line in (made / "teacher_training_metrics.jsonl").read_text().splitlines()]
    assert [r["iteration"] for r in runs] == [1, 2]
    assert teacher.ensure_demo_teacher(config, student) == made  # cached: not trained again
