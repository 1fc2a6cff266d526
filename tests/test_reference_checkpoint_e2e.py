"""End to end through the CLI: `rl_config.integrated_mode_config.ref_model_load_path` naming one of our
checkpoints loads the reference from it (not from the initial weights, not from the actor).

Oracle: with one optimizer step per iteration the KL term of an iteration is computed before its
step, between the actor's and the reference's log-probs of the same samples. A run whose actor and
reference both come from checkpoint S has a KL of (numerically) zero at its first iteration; the run
that wrote S has a clearly positive one at its second iteration, where its actor equals S and its
reference is the initial model.

Runs where: subprocesses (Ray, 1 worker); ~1 min on 2 cores.
"""
import json

from cli_runner import run_cli

ONE_STEP_PER_ITERATION = "rl_config.mini_batch_size=16"  # = megatron_training.global_batch_size


def _kl(run_dir) -> list[float]:
    return [json.loads(line)["actor/kl_loss"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_reference_loads_from_our_checkpoint(tmp_path):
    assets = f"synthetic_data.data_dir={tmp_path / 'assets'}"
    first, second = tmp_path / "first", tmp_path / "second"
    done = run_cli(first, "grpo_tiny_cpu", "megatron_training.train_iters=2", "megatron_training.save_interval=1",
                   f"actor_config.save={first / 'save'}", ONE_STEP_PER_ITERATION, assets)
    assert done.returncode == 0, done.stderr[-3000:]
    checkpoint = first / "save" / "iter_0000001"

    done = run_cli(second, "grpo_tiny_cpu", "megatron_training.train_iters=1", f"actor_config.load={checkpoint}",
                   "actor_config.finetune=true", f"rl_config.integrated_mode_config.ref_model_load_path={checkpoint}",
                   ONE_STEP_PER_ITERATION, assets)
    assert done.returncode == 0, done.stderr[-3000:]
    assert f"[checkpoint] reference model loaded from {checkpoint}" in done.stdout

    kl_actor_s_reference_initial = _kl(first / "run")[1]
    kl_actor_s_reference_s = _kl(second / "run")[0]
    assert kl_actor_s_reference_initial > 1e-6
    assert abs(kl_actor_s_reference_s) < 1e-3 * kl_actor_s_reference_initial
