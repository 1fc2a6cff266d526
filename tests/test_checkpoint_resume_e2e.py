"""End to end through the CLI (subprocesses, real Ray + vLLM + Megatron, 1 rank): a run resumed from its
iteration-2 checkpoint reaches the uninterrupted run's iteration 3 bit-exactly (fp32 CPU).

The interruption is a clean stop: the resumed run loads the uninterrupted run's own iteration-2 checkpoint
(saved by save_interval=2), which is what a run SIGKILLed after iteration 2 would have left behind."""

import json
import shutil

import torch

from cli_runner import run_cli

# Wall-clock and memory figures differ between any two runs; everything else must be equal.
VOLATILE_PREFIXES = ("timing/", "memory/", "offload/")
VOLATILE_SUFFIXES = ("_tps", "seconds")


def _records(path):
    return [{k: v for k, v in json.loads(line).items() 
             if not k.startswith(VOLATILE_PREFIXES) and not k.endswith(VOLATILE_SUFFIXES)}
            for line in path.read_text().splitlines()]


def _plain(directory):
    from megatron.core import dist_checkpointing

    return dist_checkpointing.load_plain_tensors(str(directory))


def test_resume_from_iteration_2_matches_uninterrupted_run(world, tmp_path):
    full, resumed = tmp_path / "full", tmp_path / "resumed"
    done = run_cli(full, "grpo_tiny_cpu", "megatron_training.train_iters=3", "megatron_training.save_interval=2",
                   f"actor_config.save={full / 'ckpt'}")
    assert done.returncode == 0, done.stderr[-3000:]
    assert sorted(p.name for p in (full / "ckpt").iterdir()) == ["iter_0000002", "iter_0000003", "latest"]

    # The interrupted run's directory: its metrics up to iteration 2 plus a record the crash lost track of.
    (resumed / "run").mkdir(parents=True)
    shutil.copy(full / "run" / "metrics.jsonl", resumed / "run" / "metrics.jsonl")
    done = run_cli(resumed, "grpo_tiny_cpu", "megatron_training.train_iters=3",
                   f"actor_config.load={full / 'ckpt' / 'iter_0000002'}", "actor_config.finetune=false",
                   f"actor_config.save={resumed / 'ckpt'}")
    assert done.returncode == 0, done.stderr[-3000:]

    expected = _records(full / "run" / "metrics.jsonl")
    got = _records(resumed / "run" / "metrics.jsonl")
    assert [r["iteration"] for r in got] == [1, 2, 3]
    assert got == expected
    for part in ("model", "optimizer"):
        want, have = _plain(full / "ckpt" / "iter_0000003" / part), _plain(resumed / "ckpt" / "iter_0000003" / part)
        assert sorted(want) == sorted(have)
        for key in want:
            if isinstance(want[key], torch.Tensor):
                assert torch.equal(want[key], have[key]), f"{part}: {key}"
