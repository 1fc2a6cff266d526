"""megatron_training.save_hf: at the end of a run the live actor is exported as an HF checkpoint to
<run dir>/hf_export.

Here in process, with a stand-in group (what is tested is where the export lands and how a later one replaces
it); the end-to-end export of a real run, bit for bit against cli/export_hf.py's conversion of the final
checkpoint: tests/test_checkpoint_resume_e2e.py.
"""
import json

import torch
from safetensors.torch import load_file

from mindspeed_rl.checkpoint.hf_export import RUN_EXPORT_DIR, export_run_actor, write_hf_checkpoint


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
