"""End to end through the CLI (subprocesses, real Ray + vLLM + Megatron, 1 rank), around one uninterrupted
4-iteration run that saves at iterations 2 and 4 (module fixture):

- a run whose driver is SIGKILLed after its iteration-2 checkpoint resumes from the last checkpoint and reaches
  the uninterrupted run's iterations 3 and 4 bit-exactly (fp32 CPU): metrics, weights and optimizer states. The
  runs use DAPO's dynamic sampling (8 of each rollout's 16 prompts must differ in exact accuracy, more rollouts
  drawn until they do), so the sampler position and the sampling streams are exact through the refills;
- `rl_config.integrated_mode_config.ref_model_load_path` naming one of our checkpoints loads the reference from
  it (not from the initial weights, not from the actor). Oracle: with one optimizer step per iteration (8 prompts
  per update = the mini-batch) the KL of an iteration is computed before its step, between the actor's and the
  reference's log-probs of the same samples. A run whose actor and reference both come from checkpoint S has a KL
  of (numerically) zero at its first iteration; the run that wrote S has a clearly positive one at the next
  iteration, where its actor equals S and its reference is the initial model;
- `megatron_training.save_hf`: at the end the live actor is exported as an HF checkpoint to <run dir>/hf_export,
  bit for bit cli/export_hf.py's conversion of the final checkpoint, and transformers loads it.

Runs where: four CLI runs one after the other; ~2 min on 2 cores."""

import json
import os
import signal

import pytest
import torch

from cli_runner import run_cli
from mindspeed_rl.locks import RUN_LOCK_FILE
from run_watch import launch, session_processes

# Wall-clock and memory figures differ between any two runs; everything else must be equal.
VOLATILE_PREFIXES = ("timing/", "memory/", "offload/")
VOLATILE_SUFFIXES = ("_tps", "seconds")
DYNAMIC_SAMPLING = ("rl_config.filter_groups_enable=true", "rl_config.filter_groups_metric=acc",
                    "rl_config.filter_groups_train_batch_size=8", "rl_config.filter_groups_max_batches=-1")
TRAIN_4 = ("megatron_training.train_iters=4", "megatron_training.save_interval=2", *DYNAMIC_SAMPLING)


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    """Also exports its final actor (megatron_training.save_hf)."""
    full = tmp_path_factory.mktemp("uninterrupted")
    done = run_cli(full, "grpo_tiny_cpu", *TRAIN_4, f"actor_config.save={full / 'save'}", "megatron_training.save_hf=true",
                   f"synthetic_data.data_dir={full / 'assets'}")
    assert done.returncode == 0, done.stderr[-3000:]
    (full / "stdout.txt").write_text(done.stdout)
    return full


def _records(path):
    return [{k: v for k, v in json.loads(line).items()
             if not k.startswith(VOLATILE_PREFIXES) and not k.endswith(VOLATILE_SUFFIXES)}
            for line in path.read_text().splitlines()]


def _plain(directory):
    from megatron.core import dist_checkpointing

    return dist_checkpointing.load_plain_tensors(str(directory))


def _run_killed_after_iteration_2(tmp_path, save):
    """The driver alone gets SIGKILL (the OOM killer, a node losing its job) right after the iteration-2
    save; iteration 3 may be under way. What survives of its session is then cleared by hand."""
    run = launch(tmp_path, "grpo_tiny_cpu", *TRAIN_4, f"actor_config.save={save}")
    run.wait_for(f"[checkpoint] saved {save / 'iter_0000002'}")
    os.kill(run.process.pid, signal.SIGKILL)
    run.finish()
    for pid in session_processes(run.process.pid):
        os.kill(pid, signal.SIGKILL)


def test_resume_after_a_sigkill_matches_the_uninterrupted_run(world, tmp_path, uninterrupted):
    kept = sorted(p.name for p in (uninterrupted / "save").iterdir() if p.name != RUN_LOCK_FILE)
    assert kept == ["iter_0000002", "iter_0000004", "latest"], "no save in progress is left"

    killed = tmp_path / "killed"
    _run_killed_after_iteration_2(killed, killed / "save")
    assert (killed / "save" / "latest").read_text().strip() == "iter_0000002"
    # Resume into the same run directory from the save root: its `latest` names iteration 2.
    done = run_cli(killed, "grpo_tiny_cpu", *TRAIN_4, f"actor_config.load={killed / 'save'}",
                   "actor_config.finetune=false", f"actor_config.save={killed / 'save'}")
    assert done.returncode == 0, done.stderr[-3000:]

    expected = _records(uninterrupted / "run" / "metrics.jsonl")
    got = _records(killed / "run" / "metrics.jsonl")
    assert [r["iteration"] for r in got] == [1, 2, 3, 4]
    assert any(r["dynamic_sampling/rollouts"] > 1 for r in expected[2:]), expected  # a refill after the resume
    assert got == expected
    for part in ("model", "optimizer"):
        want = _plain(uninterrupted / "save" / "iter_0000004" / part)
        have = _plain(killed / "save" / "iter_0000004" / part)
        assert sorted(want) == sorted(have)
        for key in want:
            if isinstance(want[key], torch.Tensor):
                assert torch.equal(want[key], have[key]), f"{part}: {key}"


def _kl(run_dir) -> list[float]:
    return [json.loads(line)["actor/kl_loss"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_the_reference_loads_from_our_checkpoint(tmp_path, uninterrupted):
    checkpoint = uninterrupted / "save" / "iter_0000002"
    done = run_cli(tmp_path, "grpo_tiny_cpu", "megatron_training.train_iters=1", *DYNAMIC_SAMPLING,
                   f"actor_config.load={checkpoint}", "actor_config.finetune=true",
                   f"rl_config.integrated_mode_config.ref_model_load_path={checkpoint}")
    assert done.returncode == 0, done.stderr[-3000:]
    assert f"[checkpoint] reference model loaded from {checkpoint}" in done.stdout

    kl_actor_s_reference_initial = _kl(uninterrupted / "run")[2]
    kl_actor_s_reference_s = _kl(tmp_path / "run")[0]
    assert kl_actor_s_reference_initial > 1e-6
    assert abs(kl_actor_s_reference_s) < 1e-3 * kl_actor_s_reference_initial


def test_save_hf_exports_the_final_actor(world, tmp_path, uninterrupted):
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from mindspeed_rl.checkpoint.hf_export import RUN_EXPORT_DIR, export_checkpoint
    from mindspeed_rl.parallel import megatron_state

    run_dir, save = uninterrupted / "run", uninterrupted / "save"
    export = run_dir / RUN_EXPORT_DIR
    assert f"[export] HF checkpoint: {export}" in (uninterrupted / "stdout.txt").read_text().splitlines()
    assert (save / "latest").read_text().strip() == "iter_0000004"
    # The same weights as the final checkpoint converted by cli/export_hf.py's code, bit for bit.
    from_checkpoint = export_checkpoint(save, tmp_path / "from_checkpoint", parallel=megatron_state.current())
    got, expected = load_file(export / "model.safetensors"), load_file(from_checkpoint / "model.safetensors")
    assert got.keys() == expected.keys() and len(got) > 0
    assert all(torch.equal(got[name], expected[name]) for name in got)
    # ... and trained: not the generated initial weights.
    (initial_dir,) = (uninterrupted / "assets").glob("arith-*")
    initial = load_file(initial_dir / "model" / "model.safetensors")
    assert max((got[name] - initial[name]).abs().max().item() for name in got) > 0
    assert json.loads((export / "config.json").read_text())["dtype"] == "float32"
    assert not [p.name for p in run_dir.iterdir() if p.name.startswith(f".{RUN_EXPORT_DIR}")], "staging left behind"
    model = AutoModelForCausalLM.from_pretrained(str(export), dtype=torch.float32).eval()
    ids = torch.tensor([AutoTokenizer.from_pretrained(str(export)).encode("3+4=")])
    with torch.no_grad():
        logits = model(ids).logits
    assert logits.shape == (1, ids.shape[1], model.config.vocab_size) and torch.isfinite(logits).all()
    assert torch.equal(model.model.embed_tokens.weight, got["model.embed_tokens.weight"])


def test_no_save_optim_and_rng_leave_them_out_and_a_resume_says_what_restarts(world, tmp_path, uninterrupted):
    """MindSpeed-RL's no_save_optim / no_save_rng: the checkpoint holds neither; a resume from it starts Adam's moments
    from zero and keeps the start-up RNG seeds, each said in one line, and continues the learning-rate schedule."""
    lean_save = tmp_path / "lean"
    done = run_cli(tmp_path / "a", "grpo_tiny_cpu", *TRAIN_4, "megatron_training.train_iters=3",
                   f"actor_config.load={uninterrupted / 'save' / 'iter_0000002'}", "actor_config.finetune=false",
                   f"actor_config.save={lean_save}", "actor_config.no_save_optim=true", "actor_config.no_save_rng=true")
    assert done.returncode == 0, done.stderr[-3000:]
    lean = lean_save / "iter_0000003"
    assert sorted(p.name for p in lean.iterdir()) == ["hf", "manifest.json", "model", "trainer_state.json"]
    assert json.loads((lean / "trainer_state.json").read_text())["contents"] == {
        "optimizer": False, "rng": False, "expert_parallel_size": 1}

    resumed = run_cli(tmp_path / "b", "grpo_tiny_cpu", *TRAIN_4, f"actor_config.load={lean}", "actor_config.finetune=false",
                      f"actor_config.save={tmp_path / 'b_save'}")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    lines = [line for line in resumed.stdout.splitlines() if line.startswith(f"[checkpoint] {lean} holds no")]
    assert [line.split(" holds no ")[1].split(" ")[0] for line in lines] == ["optimizer", "RNG"], resumed.stdout[-3000:]
    got = _records(tmp_path / "b" / "run" / "metrics.jsonl")
    expected = _records(uninterrupted / "run" / "metrics.jsonl")[3]
    assert [r["iteration"] for r in got] == [4]
    # Iteration 4's metrics are all taken before its one optimizer step: the weights of iteration 3 arrived intact.
    assert got == [expected]
    want = _plain(uninterrupted / "save" / "iter_0000004" / "model")
    have = _plain(tmp_path / "b_save" / "iter_0000004" / "model")
    assert any(not torch.equal(want[key], have[key]) for key in want if isinstance(want[key], torch.Tensor)), \
        "the step after the resume must differ: Adam's moments restarted"
