"""megatron_training.save_hf: at the end of a run the live actor is exported as an HF checkpoint to
<run dir>/hf_export.

The end-to-end test runs the demo CLI for 2 iterations (a subprocess; Ray starts one worker; ~60 s on 2
cores) and checks the export bit for bit against cli/export_hf.py's conversion of the final checkpoint.
"""
import json
from pathlib import Path

import torch
from safetensors.torch import load_file

from cli_runner import run_cli
from mindspeed_rl.checkpoint.hf_export import RUN_EXPORT_DIR, export_checkpoint, export_run_actor, write_hf_checkpoint


class FakeActorGroup:
    """Two ranks answering `export_hf` as the workers do: rank 0 writes the directory, rank 1 returns None."""

    def __init__(self, weights: dict[str, torch.Tensor]):
        self.weights = weights
        self.calls = []

    def call(self, method, output_dir, config_dir):
        self.calls.append((method, output_dir, config_dir))
        path = write_hf_checkpoint(self.weights, config_dir=config_dir, output_dir=output_dir)
        return [(str(path), {"timing/export_hf": 0.1}), (None, {"timing/export_hf": 0.1})]


def test_export_lands_in_the_run_dir_and_a_later_one_replaces_it_whole(tmp_path):
    config_dir = tmp_path / "model"
    config_dir.mkdir()
    (config_dir / "config.json").write_text(json.dumps({"model_type": "qwen2"}))
    (config_dir / "tokenizer.json").write_text("{}")
    run_dir = tmp_path / "run"
    run_dir.mkdir()

    first = FakeActorGroup({"model.embed_tokens.weight": torch.zeros(4, 2)})
    out = export_run_actor(first, run_dir=run_dir, config_dir=config_dir)
    assert out == run_dir / RUN_EXPORT_DIR
    assert first.calls[0][0] == "export_hf" and first.calls[0][2] == str(config_dir)
    assert torch.equal(load_file(out / "model.safetensors")["model.embed_tokens.weight"], torch.zeros(4, 2))
    (out / "stale.txt").write_text("left by the earlier part of a resumed run")

    # A resumed run in the same directory: its export takes the place of the earlier one, whole.
    second = FakeActorGroup({"model.embed_tokens.weight": torch.ones(4, 2)})
    assert export_run_actor(second, run_dir=run_dir, config_dir=config_dir) == out
    assert torch.equal(load_file(out / "model.safetensors")["model.embed_tokens.weight"], torch.ones(4, 2))
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "model.safetensors", "tokenizer.json"]
    assert sorted(p.name for p in run_dir.iterdir()) == [RUN_EXPORT_DIR]  # no staging or old copy left


def test_demo_with_save_hf_exports_the_final_actor(tmp_path, world):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    save = tmp_path / "save"
    done = run_cli(tmp_path, "grpo_tiny_cpu", "megatron_training.train_iters=2", "megatron_training.save_hf=true",
                   f"actor_config.save={save}", f"synthetic_data.data_dir={tmp_path / 'assets'}")
    assert done.returncode == 0, done.stderr[-3000:]
    run_dir = tmp_path / "run"
    export = run_dir / RUN_EXPORT_DIR
    assert f"[export] HF checkpoint: {export}" in done.stdout.splitlines()
    assert (save / "latest").read_text().strip() == "iter_0000002"

    # The same weights as the final checkpoint converted by cli/export_hf.py's code, bit for bit.
    from_checkpoint = export_checkpoint(save, tmp_path / "from_checkpoint")
    got, expected = load_file(export / "model.safetensors"), load_file(from_checkpoint / "model.safetensors")
    assert got.keys() == expected.keys() and len(got) > 0
    assert all(torch.equal(got[name], expected[name]) for name in got)
    # ... and trained: not the generated initial weights.
    (initial_dir,) = (tmp_path / "assets").glob("arith-*")
    initial = load_file(initial_dir / "model" / "model.safetensors")
    assert max((got[name] - initial[name]).abs().max().item() for name in got) > 0
    assert json.loads((export / "config.json").read_text())["dtype"] == "float32"
    assert not [p.name for p in run_dir.iterdir() if p.name.startswith(f".{RUN_EXPORT_DIR}")], "staging left behind"

    model = AutoModelForCausalLM.from_pretrained(str(export), dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(str(export))
    ids = torch.tensor([tokenizer.encode("3+4=")])
    with torch.no_grad():
        logits = model(ids).logits
    assert logits.shape == (1, ids.shape[1], model.config.vocab_size) and torch.isfinite(logits).all()
    assert torch.equal(model.model.embed_tokens.weight, got["model.embed_tokens.weight"])
