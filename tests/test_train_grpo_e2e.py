"""End to end: `python cli/train_grpo.py` runs 2 GRPO iterations of the CPU demo with real Megatron-core
and real vLLM, and leaves metrics.jsonl in the Hydra run directory. The one-rank demo runs its rank in
the CLI's own process, without Ray (runtime.local_single_rank); the 2-rank variant through Ray.

Runs where: subprocesses (the 2-rank variant: Ray and two worker processes); ~40 s each on 2 cores.
"""
import json
import re
import os
from pathlib import Path

import pytest

from cli_runner import run_cli
from wandb_reader import history_rows
from tracker_readers import mlflow_scalars, swanlab_scalars
from planner_checks import assert_host_prediction_matches_ledger, assert_prediction_matches_ledger
from profiler_checks import assert_profiled_iteration_two, profiling_overrides
from msprobe_checks import assert_msprobe_dumps, msprobe_overrides


def test_two_iterations_write_metrics(tmp_path):
    """The one-rank demo, its rank in the CLI's own process: Ray is never started."""
    run_dir, ray_tmp = tmp_path / "run", tmp_path / "ray_tmp"
    # Ray puts every session it starts (ray.init, its daemons) under $RAY_TMPDIR/ray: it stays absent.
    done = run_cli(tmp_path, "grpo_tiny_cpu", "megatron_training.train_iters=2", "rl_config.use_tensorboard=true",
                   "runtime.progress_seconds=0.1",
                   "rl_config.use_wandb=true", "rl_config.wandb_project=e2e", "rl_config.wandb_exp_name=two",
                   # SwanLab's local mode without its dashboard package writes offline, saying so; MLflow's
                   # default store is <run dir>/mlflow.db.
                   "rl_config.use_swanlab=true", "rl_config.swanlab_mode=local", "rl_config.swanlab_project=e2e",
                   "rl_config.swanlab_exp_name=two",
                   "rl_config.use_mlflow=true", "rl_config.mlflow_project=e2e", "rl_config.mlflow_exp_name=two",
                   *profiling_overrides(tmp_path / "prof"),  # MindSpeed-RL's profiler on this run too
                   *msprobe_overrides(tmp_path / "msprobe"),  # and their msprobe dumps
                   env={"RAY_TMPDIR": str(ray_tmp), "WANDB_MODE": "offline"}, plots=True)
    assert done.returncode == 0, done.stderr[-3000:]
    assert_profiled_iteration_two(tmp_path / "prof", done.stdout)
    assert_msprobe_dumps(tmp_path / "msprobe", train_iters=2)
    assert "[init] one rank: running it in this process (no Ray; runtime.local_single_rank=false uses Ray)" \
        in done.stdout.splitlines()
    assert not ray_tmp.exists(), sorted(str(p) for p in ray_tmp.rglob("*"))[:5]
    assert "Traceback" not in done.stderr, done.stderr[-3000:]
    lines = [line for line in done.stdout.splitlines() if line.startswith("[iter")]
    assert len(lines) == 2, done.stdout[-2000:]
    # The console shows our lines and warnings; Megatron's INFO chatter (its gradient buckets' parameter
    # lists) is in the run's log file only, and 256 prompts draw no progress bar.
    console = done.stdout + done.stderr
    assert "Params for bucket" not in console and "tokenizing prompts" not in console
    assert "[summary] 2 iterations" in done.stdout
    # A phase longer than runtime.progress_seconds says so while it runs (the first generate, vLLM's first
    # batches, takes about a second here: ten times the 0.1 s asked for).
    assert re.search(r"^\[progress\] iteration 1, generate: \d+ s so far$", done.stdout, re.MULTILINE), done.stdout[-2000:]
    assert "Params for bucket" in (run_dir / "train_grpo.log").read_text()

    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["iteration"] for r in records] == [1, 2]
    # partial rollout off (its split 1): every trained token sampled by the policy being updated
    assert all(r["rollout/token_age_max"] == 0 and r["rollout/resumed_samples"] == 0 for r in records)
    # wandb (offline here) holds every numeric scalar of every record
    (wandb_run,) = (run_dir / "wandb").glob("offline-run-*/run-*.wandb")
    for row, record in zip(history_rows(wandb_run), records, strict=True):
        assert row["_step"] == record["iteration"]
        assert all(row[k] == pytest.approx(v) for k, v in record.items() if k != "iteration" and isinstance(v, (int, float)))
    # ... and so do SwanLab's offline run and MLflow's run, each at step = iteration
    assert "swanlab_mode local needs swanboard" in console, console[-3000:]
    for steps in (swanlab_scalars(run_dir / "swanlab"),
                  mlflow_scalars(f"sqlite:///{run_dir / 'mlflow.db'}", experiment="e2e", run_name="two")):
        assert sorted(steps) == [1, 2]
        for record in records:
            assert all(steps[record["iteration"]][k] == pytest.approx(v)
                       for k, v in record.items() if k != "iteration" and isinstance(v, (int, float)))
    # The planner (cli/plan.py) printed its per-phase bytes at start; each record carries them beside the
    # ledger's: within 10% per category, 30% for the activations.
    assert sum(line.startswith("[plan] ") for line in done.stdout.splitlines()) == 4, done.stdout[-3000:]
    for r in records:
        assert_prediction_matches_ledger(r)
        assert_host_prediction_matches_ledger(r)  # the mirrors of what leaves the device
    for r in records:
        assert 0.0 <= r["reward/mean"] <= 1.0
        # After every weight push vLLM samples from exactly the training weights.
        assert r["rollout/logprob_max_abs_diff"] < 1e-4
        # offload_train_* are on: while generating, no training state is on the device ...
        assert r["memory/generate/train_params_bytes"] == 0
        assert r["memory/generate/optimizer_states_bytes"] == 0
        assert r["memory/generate/kv_cache_bytes"] > 0
        # ... and while updating, the KV cache is gone and the reference model is off the device.
        assert r["memory/update/kv_cache_bytes"] == 0
        assert r["memory/update/reference_params_bytes"] == 0
        assert r["memory/update/train_params_bytes"] > 0
        assert r["memory/ref_logprob/reference_params_bytes"] == r["memory/update/train_params_bytes"]
        assert r["actor/optimizer_steps"] == 2  # 16 prompts x 8 samples in mini-batches of 8 prompts
        assert r["timing/rollout"] > 0
        # One rank, the same layout on both sides: the whole model is copied locally, checked, nothing sent.
        assert r["resharding/bytes_sent"] == r["resharding/bytes_received"] == 0
        assert r["resharding/bytes_local"] == r["memory/update/train_params_bytes"]
        assert r["resharding/ranges_verified"] > 0
    # MindSpeed-RL's names, each consistent with the figures it is made of.
    for r in records:
        assert r["arith_acc_rewards/mean"] == r["reward/mean"]  # one verifier, weight 1
        assert r["response_length/min"] <= r["response_length/mean"] <= r["response_length/max"] <= 4
        assert r["prompt_length/max"] <= 8
        assert r["timing/update"] == r["timing/update/total"] > 0
        assert r["timing/resharding_to_infer"] >= r["timing/resharding_enter_infer"] > 0
        assert r["e2e_tps"] > 0 and r["vllm_tps"] > r["e2e_tps"] and r["update_tps"] > r["e2e_tps"]
        assert r["actor/lr"] == 5e-4  # constant schedule
        assert r["grad_norm"] == r["actor/grad_norm"]
    assert (run_dir / "training_curves.png").stat().st_size > 10_000
    assert (run_dir / "memory_timeline.png").stat().st_size > 10_000
    assert list((run_dir / "tensorboard").glob("events.out.tfevents.*"))
    # Adam moments exist from the first step on: 2 x the parameter bytes, resident while updating.
    assert records[1]["memory/update/optimizer_states_bytes"] == 2 * records[1]["memory/update/train_params_bytes"]


def test_math_demo_two_iterations_through_parquet_chat_template_and_math_verify(tmp_path):
    """The second demo's real formats end to end: DAPO-schema parquet, chat template, two verifiers."""
    run_dir = tmp_path / "run"
    done = run_cli(tmp_path, "grpo_tiny_math_cpu", "megatron_training.train_iters=2",
                   f"synthetic_data.data_dir={tmp_path / 'math'}")
    assert done.returncode == 0, done.stderr[-3000:]
    assert "prompt_type=chat" in done.stdout
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["iteration"] for r in records] == [1, 2]
    for r in records:
        accuracy, form = r["math_17k_acc_rewards/mean"], r["format_rewards/mean"]
        assert 0.0 <= accuracy <= 1.0 and 0.0 <= form <= 1.0
        assert abs(r["reward/mean"] - (1.0 * accuracy + 0.2 * form)) < 1e-6  # verifier_weight [1.0, 0.2]
        assert r["reward/accuracy"] == accuracy  # the last box, math-verify equivalence, no format needed
        assert 24 <= r["prompt_length/min"] <= r["prompt_length/max"] <= 32
        assert r["rollout/logprob_max_abs_diff"] < 1e-4


def _demo_assets(tmp_path) -> Path:
    from mindspeed_rl.data.arith_task import ensure_demo_assets

    model_dir, _ = ensure_demo_assets(tmp_path / "assets", vocab_size=16, hidden_size=128, ffn_hidden_size=256,
                                      num_layers=2, num_attention_heads=4, num_query_groups=2, num_prompts=16,
                                      max_operand=4, seed=1)
    return model_dir


def test_bad_prompts_file_is_a_config_error(tmp_path):
    """A malformed data file stops the run before any worker starts: one line naming key, file and line."""
    data = tmp_path / "prompts.jsonl"
    data.write_text('{"prompt": "1+1=", "answer": "2"}\n{"prompt": "2+2="}\n')
    done = run_cli(tmp_path, "grpo_tiny_cpu", "synthetic_data.enabled=false",
                   f"megatron_training.tokenizer_name_or_path={_demo_assets(tmp_path)}",
                   f"megatron_training.data_path={data}", timeout=120)
    assert done.returncode == 2
    assert "Traceback" not in done.stderr
    assert f"megatron_training.data_path: {data}:2:" in done.stderr


def test_dataset_smaller_than_a_batch_is_an_error_not_a_hang(tmp_path):
    data = tmp_path / "prompts.jsonl"
    data.write_text("".join(f'{{"prompt": "{i}+1=", "answer": "{i + 1}"}}\n' for i in range(3)))
    done = run_cli(tmp_path, "grpo_tiny_cpu", "synthetic_data.enabled=false",
                   f"megatron_training.tokenizer_name_or_path={_demo_assets(tmp_path)}",
                   f"megatron_training.data_path={data}", timeout=120)
    assert done.returncode == 2, done.stderr[-2000:]
    assert "Traceback" not in done.stderr
    assert "megatron_training.global_batch_size" in done.stderr


@pytest.fixture(scope="module")
def pp2_run(tmp_path_factory):
    """The 2-rank variant, watched: Megatron PP2 stages are resharded into vLLM TP2 halves every iteration; its
    forwards and updates run packed, in token-budget micro-batches (the stages exchange each one's shape); 12
    held-out prompts are evaluated before training and after the second update; 2 CPU Ray workers score the rule
    rewards (ROLL's rewards.rule.world_size)."""
    from run_watch import launch, leftovers, shm_entries

    tmp_path = tmp_path_factory.mktemp("pp2")
    eval_path = tmp_path / "eval.jsonl"
    eval_path.write_text("".join(json.dumps({"prompt": f"{a}+{b}=", "answer": str(a + b)}) + "\n"
                                 for a in range(4) for b in range(3)))  # 12 prompts
    shm_before = shm_entries()
    run = launch(tmp_path, "grpo_tiny_cpu_pp2_infer_tp2", "megatron_training.train_iters=2",
                 "rl_config.use_remove_padding=true",
                 "rl_config.use_dynamic_bsz=true", "rl_config.max_packing_token_size=64",
                 "rl_config.eval_interval=2", "rl_config.eval_before_train=true",
                 f"megatron_training.eval_data_path={eval_path}", "rewards.rule.world_size=2")
    code, _ = run.finish(timeout=600)
    assert code == 0, run.stderr_text()[-3000:]
    return tmp_path / "run", leftovers(run, shm_before), run.stdout_text()


def test_pp2_train_tp2_infer_variant_runs(pp2_run):
    run_dir, _, _ = pp2_run
    records = [r for r in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines()) if "reward/mean" in r]
    assert len(records) == 2
    for r in records:
        assert r["rollout/logprob_max_abs_diff"] < 1e-4  # vLLM's log-probs against the packed Megatron forward
        # each rank holds half the layers and needs half of every layer: it receives a quarter of
        # the model from the other rank and copies a quarter locally
        assert r["resharding/bytes_received"] > 0
        assert abs(r["resharding/bytes_received"] - r["resharding/bytes_local"]) / r["resharding/bytes_local"] < 0.2
        assert r["resharding/ranges_verified"] > 0
        assert_prediction_matches_ledger(r)  # the planner's bytes per phase and category, largest rank


def test_two_reward_workers_score_the_rule_rewards_as_the_driver_would(pp2_run):
    run_dir, _, stdout = pp2_run
    assert "rewards.rule (2 worker(s))" in stdout and "[reward] warning" not in stdout
    records = [r for r in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines()) if "reward/mean" in r]
    for r in records:
        assert r["reward_workers/failed_samples"] == 0
        assert 0.0 <= r["reward/mean"] <= 1.0
        assert r["arith_acc_rewards/mean"] == r["reward/mean"]  # one verifier, weight 1
        assert r["reward/mean"] >= r["reward/accuracy"]  # correct answers score 1, the rest 0 or 0.2


def test_a_finished_two_rank_run_leaves_no_process_and_no_shm_segment(pp2_run):
    """vLLM's TP2 broadcast buffer (/dev/shm/psm_*) used to outlive even a successful run."""
    _, (processes, shm), _ = pp2_run
    assert not processes, f"processes of the run still alive: {processes}"
    assert not shm, f"/dev/shm segments left: {shm}"


@pytest.mark.parametrize("recipe, script", [("grpo_qwen25_7b_A3", "cli/train_grpo.py"),
                                            ("dapo_qwen25_7b_A3", "cli/train_dapo.py"),
                                            ("ppo_qwen25_7b_A3", "cli/train_ppo.py")])
def test_the_7b_recipe_on_this_host_passes_every_check_then_names_the_device_count(tmp_path, recipe, script):
    """The users' command with a small Qwen2 checkpoint and a DeepScaleR-style file: config, data, template,
    verifier and model checks pass; on a 2-core CPU host the 16 ranks are refused in one line, exit 2."""
    from mindspeed_rl.data.tiny_math import build_tiny_math_tokenizer
    from mindspeed_rl.data.tiny_model import create_tiny_qwen2_checkpoint

    cores = os.cpu_count() or 1
    if cores >= 16:
        pytest.skip("this host could start all 16 CPU ranks of the 7B recipe")
    tokenizer = build_tiny_math_tokenizer(4)
    model = create_tiny_qwen2_checkpoint(
        tmp_path / "small_qwen2", vocab_size=tokenizer.get_vocab_size(with_added_tokens=True), hidden_size=64,
        ffn_hidden_size=128, num_layers=2, num_attention_heads=4, num_query_groups=2,
        max_position_embeddings=32768, seed=1, tokenizer=tokenizer)
    data = tmp_path / "deepscaler.json"
    data.write_text(json.dumps([{"problem": f"What is {i} + 1?", "answer": str(i + 1), "solution": "."}
                                for i in range(40)]))
    done = run_cli(tmp_path, recipe, f"megatron_training.tokenizer_name_or_path={model}",
                   f"actor_config.load={model}", f"megatron_training.data_path={data}", "runtime.device=cpu",
                   "+runtime.max_ranks_per_cpu_core=1", timeout=180, script=script)
    assert done.returncode == 2, done.stderr[-2000:]
    assert "Traceback" not in done.stderr
    assert "[data] 40 prompts" in done.stdout and "prompt_type=qwen_r1" in done.stdout
    errors = [line for line in done.stderr.splitlines() if line.startswith("config error:")]
    assert errors == [f"config error: rl_config.actor_resource.num_npus: 16 ranks on runtime.device=cpu, but this "
                      f"host has {cores} CPU cores and runtime.max_ranks_per_cpu_core=1 allows {cores}: "
                      "lower num_npus (and the parallel sizes with it) or run on the accelerators the config "
                      "was written for"]


# MindSpeed-RL's recipes shipped verbatim, with a tiny checkpoint whose heads, groups, layers and experts their
# layouts can split (TP4 x PP4; TP4 x EP2 with vLLM's EP over 16 ranks; DeepSeek-V3's 61 layers in 8 uneven stages,
# EP8, vLLM's EP64 over 256 ranks).
VERBATIM_RECIPES = {
    "grpo_qwen3_8b_A3": ("cli/train_grpo.py", "dense", 16),
    "grpo_qwen25_32b_A2": ("cli/train_grpo.py", "dense", 16),
    "dapo_qwen3_30b_a3b_A3": ("cli/train_dapo.py", "moe", 16),
    "ppo_qwen25_32b_A3": ("cli/train_ppo.py", "dense", 32),  # TP8: the tiny model has 8 KV heads
    "grpo_deepseek_r1_671b_A3": ("cli/train_grpo.py", "deepseek_v3", 256),
}


@pytest.mark.parametrize("recipe", sorted(VERBATIM_RECIPES))
def test_mindspeed_rls_own_recipes_pass_every_start_check_then_name_the_device_count(tmp_path, recipe):
    """Their files as shipped, only the paths given: the knobs line at start, then on this 2-core host the one
    line refusing the 16 ranks, exit 2."""
    from mindspeed_rl.data.tiny_model import create_tiny_qwen2_checkpoint
    from mindspeed_rl.data.tiny_moe import create_tiny_qwen3_moe_checkpoint

    script, kind, ranks = VERBATIM_RECIPES[recipe]
    cores = os.cpu_count() or 1
    if cores >= ranks:
        pytest.skip(f"this host could start all {ranks} CPU ranks")
    if kind == "dense":
        model = create_tiny_qwen2_checkpoint(tmp_path / "model", vocab_size=64, hidden_size=128, ffn_hidden_size=128,
                                             num_layers=4, num_attention_heads=8, num_query_groups=8,
                                             max_position_embeddings=32768, seed=1)
    elif kind == "deepseek_v3":
        from mindspeed_rl.data.tiny_deepseek_v3 import create_tiny_deepseek_v3_checkpoint

        model = create_tiny_deepseek_v3_checkpoint(
            tmp_path / "model", num_layers=61, hidden_size=64, num_attention_heads=4, intermediate_size=32,
            n_routed_experts=64, moe_intermediate_size=8, num_experts_per_tok=8, n_group=8, topk_group=4,
            first_k_dense_replace=3, max_position_embeddings=32768, seed=1)
    else:
        model = create_tiny_qwen3_moe_checkpoint(tmp_path / "model", hidden_size=128, num_attention_heads=8,
                                                 num_query_groups=4, num_experts=16, moe_ffn_hidden_size=64, seed=1,
                                                 max_position_embeddings=32768)
    data = tmp_path / "prompts.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"{i}+1=", "answer": str(i + 1)}) + "\n" for i in range(512)))
    done = run_cli(tmp_path, recipe, f"megatron_training.tokenizer_name_or_path={model}", f"actor_config.load={model}",
                   f"megatron_training.data_path={data}", f"actor_config.save={tmp_path / 'save'}",
                   *([f"critic_config.load={model}"] if recipe.startswith("ppo") else []),
                   "runtime.device=cpu", "runtime.max_ranks_per_cpu_core=1", timeout=180, script=script)
    assert done.returncode == 2, done.stderr[-2000:]
    assert "Traceback" not in done.stderr
    assert "[config] no effect on this engine: megatron_training.seq_length" in done.stdout
    errors = [line for line in done.stderr.splitlines() if line.startswith("config error:")]
    assert len(errors) == 1 and errors[0].startswith(f"config error: rl_config.actor_resource.num_npus: {ranks} ranks "
                                                     "on runtime.device=cpu"), done.stderr[-2000:]


def test_evaluation_runs_before_training_and_after_every_interval_th_update(pp2_run):
    """In the 2-rank run: held-out prompts generated greedily (vLLM TP2) and scored: a record of their own before
    the first update, then in the records of the interval's iterations only (and in the curves)."""
    run_dir, _, stdout = pp2_run
    assert "[data] 12 eval prompts from" in stdout
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["iteration"] for r in records] == [0, 1, 2]
    assert [r.get("eval/updates") for r in records] == [0, None, 2]
    assert "reward/mean" not in records[0]  # the evaluation's own record: nothing trained
    for r in (records[0], records[2]):
        assert r["eval/prompts"] == 12
        assert 0.0 <= r["eval/accuracy"] == r["eval/pass@1"] == r["eval/maj@1"] <= 1.0  # greedy: one sample per prompt
        assert 0.0 <= r["eval/arith_acc/mean"] <= 1.0
        assert 0 < r["eval/response_length/mean"] <= 4
    assert sum(line.startswith("[eval after ") for line in stdout.splitlines()) == 2
