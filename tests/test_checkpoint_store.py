"""Atomic checkpoint directories on the local filesystem (no mocks: real files, real renames)."""

import json
import os
import signal
import subprocess
import sys
import textwrap

import pytest

from mindspeed_rl.checkpoint import begin_save, commit_save, is_checkpoint_dir, resolve_and_verify
from mindspeed_rl.errors import ConfigError

KEY = "actor_config.load"


def _save(root, iteration, *, payload=b"weights", keep_last_n=None):
    tmp = begin_save(root, iteration)
    (tmp / "model").mkdir()
    (tmp / "model" / "shard.distcp").write_bytes(payload * 100)
    (tmp / "trainer_state.json").write_text(json.dumps({"iteration": iteration}))
    return commit_save(tmp, iteration, keep_last_n=keep_last_n)


def test_latest_names_the_newest_checkpoint(tmp_path):
    _save(tmp_path, 2)
    _save(tmp_path, 4)
    assert (tmp_path / "latest").read_text().strip() == "iter_0000004"
    verified = resolve_and_verify(tmp_path, key=KEY)
    assert verified.iteration == 4 and verified.path == tmp_path / "iter_0000004"
    assert is_checkpoint_dir(tmp_path) and is_checkpoint_dir(verified.path)


def test_keep_last_n_removes_older_checkpoints(tmp_path):
    for iteration in (1, 2, 3, 4):
        _save(tmp_path, iteration, keep_last_n=2)
    assert sorted(p.name for p in tmp_path.iterdir() if p.is_dir()) == ["iter_0000003", "iter_0000004"]


def test_manifest_lists_every_file_with_size_and_sha256(tmp_path):
    final = _save(tmp_path, 1)
    manifest = json.loads((final / "manifest.json").read_text())
    assert sorted(manifest["files"]) == ["model/shard.distcp", "trainer_state.json"]
    assert manifest["files"]["model/shard.distcp"]["size"] == 700


def test_truncated_file_is_refused_naming_it(tmp_path):
    final = _save(tmp_path, 1)
    shard = final / "model" / "shard.distcp"
    with open(shard, "r+b") as handle:
        handle.truncate(10)
    with pytest.raises(ConfigError, match=r"shard\.distcp has 10 bytes.*truncated"):
        resolve_and_verify(tmp_path, key=KEY)


def test_corrupted_file_is_refused_naming_it(tmp_path):
    final = _save(tmp_path, 1)
    state = final / "trainer_state.json"
    text = state.read_text()
    state.write_text(text.replace("1", "7"))  # same size, other bytes
    with pytest.raises(ConfigError, match=r"trainer_state\.json does not match its sha256"):
        resolve_and_verify(final, key=KEY)


def test_missing_shard_is_refused_naming_it(tmp_path):
    final = _save(tmp_path, 1)
    os.remove(final / "model" / "shard.distcp")
    with pytest.raises(ConfigError, match=r"shard\.distcp is missing"):
        resolve_and_verify(tmp_path, key=KEY)


def test_directory_without_manifest_is_refused(tmp_path):
    (tmp_path / "model").mkdir()
    with pytest.raises(ConfigError, match=r"manifest\.json is missing"):
        resolve_and_verify(tmp_path, key=KEY)


def test_save_killed_midway_leaves_previous_checkpoint_latest(tmp_path):
    """A real process SIGKILLed while it writes iteration 2: iteration 1 stays the loaded one."""
    _save(tmp_path, 1)
    script = textwrap.dedent(f"""
        import sys, time
        from mindspeed_rl.checkpoint import begin_save
        tmp = begin_save({str(tmp_path)!r}, 2)
        with open(tmp / "big.distcp", "wb") as handle:
            handle.write(b"x" * 4096); handle.flush()
            print("writing", flush=True)
            time.sleep(60)
    """)
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "writing"
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=10)
    assert any(p.name.startswith(".tmp_iter_0000002") for p in tmp_path.iterdir())
    verified = resolve_and_verify(tmp_path, key=KEY)
    assert verified.iteration == 1
    _save(tmp_path, 3)  # the next successful save sweeps the killed save's temporary away
    assert not any(p.name.startswith(".tmp_") for p in tmp_path.iterdir())


def test_checkpoint_of_another_model_is_refused_naming_its_config(tmp_path):
    from mindspeed_rl.checkpoint.trainer_state import find_resume_point

    tmp = begin_save(tmp_path, 2)
    (tmp / "hf").mkdir()
    (tmp / "hf" / "config.json").write_text(json.dumps({"hidden_size": 64, "num_hidden_layers": 2}))
    (tmp / "trainer_state.json").write_text(json.dumps({"iteration": 2}))
    commit_save(tmp, 2, keep_last_n=None)
    with pytest.raises(ConfigError, match=r"hf/config\.json: hidden_size=64 but the model being built has "
                                          r"hidden_size=128"):
        find_resume_point(str(tmp_path), finetune=False, hf_config={"hidden_size": 128, "num_hidden_layers": 2})


def test_rerun_into_a_run_dir_with_metrics_is_refused_unless_resuming(tmp_path):
    from mindspeed_rl.trainer.setup import check_run_dir_metrics

    metrics = tmp_path / "metrics.jsonl"
    metrics.write_text('{"iteration": 1}\n')
    with pytest.raises(ConfigError, match=r"metrics\.jsonl already has records"):
        check_run_dir_metrics(metrics, resume_iteration=0)
    check_run_dir_metrics(metrics, resume_iteration=1)  # resuming: allowed, later lines are truncated


def test_truncate_metrics_keeps_iterations_up_to_the_checkpoint(tmp_path):
    from mindspeed_rl.checkpoint.trainer_state import truncate_metrics_after

    metrics = tmp_path / "metrics.jsonl"
    metrics.write_text('{"iteration": 1}\n{"iteration": 2}\n{"iteration": 3}\n{"iter')  # cut-off last line
    truncate_metrics_after(metrics, 2)
    assert metrics.read_text() == '{"iteration": 1}\n{"iteration": 2}\n'


def test_a_save_root_without_latest_resumes_from_its_newest_complete_checkpoint(tmp_path, capsys):
    _save(tmp_path, 2)
    _save(tmp_path, 4)
    (tmp_path / "latest").unlink()
    (tmp_path / "iter_0000006").mkdir()  # no manifest: never a complete checkpoint
    assert is_checkpoint_dir(tmp_path), "not taken for an HF directory"
    verified = resolve_and_verify(tmp_path, key=KEY)
    assert verified.path == tmp_path / "iter_0000004"
    assert capsys.readouterr().out == (f"[checkpoint] {tmp_path} has no `latest` pointer: resuming from its newest "
                                       "complete checkpoint, iter_0000004\n")


def test_a_save_root_without_latest_or_a_complete_checkpoint_says_so(tmp_path):
    _save(tmp_path, 2)
    (tmp_path / "latest").unlink()
    (tmp_path / "iter_0000002" / "manifest.json").unlink()
    assert is_checkpoint_dir(tmp_path), "a save root, though without a complete checkpoint"
    with pytest.raises(ConfigError, match=f"{tmp_path} has no `latest` pointer and no complete checkpoint"):
        resolve_and_verify(tmp_path, key=KEY)


def _truncate_newest(root):
    shard = root / "iter_0000004" / "model" / "shard.distcp"
    with open(shard, "r+b") as handle:
        handle.truncate(10)
    return shard


def test_a_damaged_newest_checkpoint_names_the_newest_intact_one_and_how_to_resume(tmp_path):
    _save(tmp_path, 2)
    _save(tmp_path, 3)
    _save(tmp_path, 4)
    shard = _truncate_newest(tmp_path)
    (tmp_path / "iter_0000003" / "trainer_state.json").write_text("{}")  # damaged too: the one before it is named
    with pytest.raises(ConfigError) as info:
        resolve_and_verify(tmp_path, key=KEY)
    assert str(info.value) == (
        f"{KEY}: {shard} has 10 bytes, the manifest says 700 (truncated or partial checkpoint); the newest intact "
        f"checkpoint is {tmp_path / 'iter_0000002'}: resume from it with {KEY}={tmp_path / 'iter_0000002'}, or set "
        "runtime.resume_from_last_intact=true")


def test_resume_from_last_intact_takes_the_newest_intact_checkpoint_and_says_so(tmp_path, capsys):
    _save(tmp_path, 2)
    _save(tmp_path, 4)
    _truncate_newest(tmp_path)
    verified = resolve_and_verify(tmp_path, key=KEY, fall_back_to_intact=True)
    assert verified.iteration == 2 and verified.path == tmp_path / "iter_0000002"
    out = capsys.readouterr().out
    assert out.startswith(f"[checkpoint] {tmp_path / 'iter_0000004'} is damaged (")
    assert out.endswith(f"resuming from the newest intact checkpoint, {tmp_path / 'iter_0000002'} "
                        "(runtime.resume_from_last_intact)\n")


def test_a_damaged_newest_checkpoint_without_an_intact_one_says_so(tmp_path):
    _save(tmp_path, 4)
    _truncate_newest(tmp_path)
    with pytest.raises(ConfigError, match=f"; no older checkpoint in {tmp_path} is intact$"):
        resolve_and_verify(tmp_path, key=KEY, fall_back_to_intact=True)


def _point(tmp_path, **contents):
    from mindspeed_rl.checkpoint.trainer_state import ResumePoint

    return ResumePoint(path=tmp_path, iteration=2, state={"iteration": 2, "contents": {
        "optimizer": True, "rng": True, **contents}})


def test_a_moe_optimizer_saved_at_ep2_is_refused_at_ep1_naming_both_ways_out(tmp_path):
    from mindspeed_rl.checkpoint.trainer_state import check_optimizer_split

    with pytest.raises(ConfigError) as refused:
        check_optimizer_split(_point(tmp_path, expert_parallel_size=2), finetune=False, no_load_optim=False,
                              is_moe=True, expert_parallel_size=1)
    assert refused.value.key == KEY
    assert "expert parallel size 2, and this run has 1" in str(refused.value)
    assert "actor_config.no_load_optim=true" in str(refused.value)


def test_an_optimizer_split_that_matches_or_is_not_loaded_passes(tmp_path):
    from mindspeed_rl.checkpoint.trainer_state import check_optimizer_split

    ep2 = _point(tmp_path, expert_parallel_size=2)
    check_optimizer_split(ep2, finetune=False, no_load_optim=False, is_moe=True, expert_parallel_size=4)
    check_optimizer_split(ep2, finetune=False, no_load_optim=True, is_moe=True, expert_parallel_size=1)
    check_optimizer_split(ep2, finetune=True, no_load_optim=False, is_moe=True, expert_parallel_size=1)
    check_optimizer_split(_point(tmp_path, expert_parallel_size=2, optimizer=False), finetune=False,
                          no_load_optim=False, is_moe=True, expert_parallel_size=1)
    old = _point(tmp_path)  # a checkpoint from before `contents` was recorded: EP1
    del old.state["contents"]
    check_optimizer_split(old, finetune=False, no_load_optim=False, is_moe=True, expert_parallel_size=1)


def test_a_rollout_ahead_saved_as_tuples_resumes_as_generations(tmp_path):
    """Checkpoints written before `Generation` kept the rollout started ahead as (index, ids, log-probs[, routes])."""
    import numpy as np
    import torch

    from mindspeed_rl.checkpoint.trainer_state import ROLLOUT_AHEAD_NAME, ResumePoint, saved_rollout_ahead
    from mindspeed_rl.protocol import Generation, Shard

    routes = np.zeros((3, 1, 2), dtype=np.int16)
    saved = [(Shard(start=0, stop=2, value=[(0, [5, 6], [-0.5, -0.25]), (1, [7], [-1.0], routes)]), {"m": 1.0}),
             (Shard(start=0, stop=2, value=None), {})]
    torch.save(saved, tmp_path / ROLLOUT_AHEAD_NAME)
    (shard, metrics), (empty, _) = saved_rollout_ahead(ResumePoint(path=tmp_path, iteration=2, state={}))
    assert shard.value[0] == Generation(prompt_index=0, token_ids=[5, 6], logprobs=[-0.5, -0.25])
    assert shard.value[1].routed_experts is routes or np.array_equal(shard.value[1].routed_experts, routes)
    assert metrics == {"m": 1.0} and empty.value is None
