"""HF export of a trained actor: Megatron dist checkpoint -> HF dir, read back by transformers and vLLM (one rank, gloo)."""
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from mindspeed_rl.checkpoint.hf_export import ExportOptions, export_checkpoint, write_hf_checkpoint
from mindspeed_rl.checkpoint.store import begin_save, commit_save
from mindspeed_rl.errors import ConfigError
from mindspeed_rl.data.tiny_model import create_tiny_qwen2_checkpoint
from mindspeed_rl.engines.megatron_engine import MegatronEngine, OptimizerSettings
from mindspeed_rl.models.checkpoint import load_hf_checkpoint
from mindspeed_rl.parallel import megatron_state
from mindspeed_rl.protocol import RolloutBatch
from cpu_vllm import cpu_vllm_engine

ROOT = Path(__file__).resolve().parents[1]
ADAM = OptimizerSettings(lr=1e-2, min_lr=0.0, weight_decay=0.0, adam_beta1=0.9, adam_beta2=0.95, adam_eps=1e-8, clip_grad=1.0)
PROMPTS = [[5, 9, 6, 11], [7, 9, 8, 11], [4, 9, 4, 11]]
RESPONSES = [[3, 7, 2], [8, 8, 1], [6, 2, 2]]
HF_SIDE_FILES = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
                 "special_tokens_map.json")


@pytest.fixture(scope="module")
def initial(tmp_path_factory):
    out = tmp_path_factory.mktemp("tiny") / "model"
    create_tiny_qwen2_checkpoint(out, vocab_size=64, hidden_size=128, ffn_hidden_size=256, num_layers=2,
                                 num_attention_heads=4, num_query_groups=2, seed=3)
    return out


def _batch() -> RolloutBatch:
    return RolloutBatch.from_token_lists(PROMPTS, RESPONSES, pad_id=0, response_width=4)


@pytest.fixture(scope="module")
def trained(world, initial):
    """An actor after two Adam steps (its weights differ from the initial checkpoint's)."""
    spec, state = load_hf_checkpoint(str(initial))
    actor = MegatronEngine(spec=spec, hf_state=state, params_dtype=torch.float32, accelerator=world,
                           parallel=megatron_state.current(), optimizer=ADAM)
    batch = _batch()

    def loss_fn(logprobs, entropy, mb):  # push up the given responses: a visible, real update
        loss = -(logprobs * mb.response_mask).sum() / batch.response_mask.sum()
        return loss, {"loss": loss.item()}

    for _ in range(2):
        actor.train_step(batch, micro_batch_size=3, temperature=1.0, loss_fn=loss_fn)
    return actor


@pytest.fixture(scope="module")
def saved(trained, initial, tmp_path_factory):
    """A checkpoint in FORMAT.md's layout (model/ only, hf/ copies), committed with its manifest."""
    root = tmp_path_factory.mktemp("run") / "save"
    tmp = begin_save(root, 2)
    trained.save_sharded(str(tmp), with_optimizer=False)
    (tmp / "hf").mkdir()
    for name in HF_SIDE_FILES:
        if (initial / name).is_file():
            shutil.copyfile(initial / name, tmp / "hf" / name)
    commit_save(tmp, 2, keep_last_n=None)
    return root


@pytest.fixture(scope="module")
def exported(saved, tmp_path_factory):
    return export_checkpoint(saved, tmp_path_factory.mktemp("export") / "hf", parallel=megatron_state.current())


def test_export_differs_from_initial_weights(exported, initial):
    _, before = load_hf_checkpoint(str(initial))
    _, after = load_hf_checkpoint(str(exported))
    assert set(before) == set(after)
    moved = max((after[n] - before[n]).abs().max().item() for n in before)
    assert moved > 1e-3, "the export must hold the trained weights, not the initial ones"


def test_export_has_config_tokenizer_and_generation_config(exported, initial):
    files = {p.name for p in exported.iterdir()}
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= files
    for name in ("tokenizer.json", "generation_config.json"):
        if (initial / name).is_file():
            assert (exported / name).read_bytes() == (initial / name).read_bytes()
    assert json.loads((exported / "config.json").read_text())["dtype"] == "float32"
    assert not [p for p in exported.parent.iterdir() if p.name.startswith(".")], "no temp dir left behind"


def test_transformers_logits_equal_megatron(world, exported, trained):
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(str(exported), dtype=torch.float32, attn_implementation="eager").eval()
    ids = torch.randint(0, 64, (3, 17), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        expected = hf(ids).logits
        with world.megatron_context():
            got = trained.module(ids, torch.arange(17).expand(3, 17), None)
    assert got.shape == expected.shape
    assert (got - expected).abs().max().item() < 1e-4


def test_vllm_logprobs_from_export_equal_megatron(world, exported, trained):
    """vLLM built on the exported directory (config + tokenizer), weights read from its safetensors:
    the sampled tokens' log-probs equal Megatron's."""
    engine = cpu_vllm_engine(str(exported))  # its weights from the export's files
    generations = engine.generate(PROMPTS, n=4, max_tokens=6, temperature=1.0, top_p=1.0, top_k=-1, min_p=0.0, seed=7)
    batch = RolloutBatch.from_token_lists([PROMPTS[g.prompt_index] for g in generations],
                                          [g.token_ids for g in generations], pad_id=0, response_width=6)
    vllm_logprobs = torch.zeros(batch.response_logprobs_shape)
    for row, g in enumerate(generations):
        vllm_logprobs[row, : len(g.logprobs)] = torch.tensor(g.logprobs)
    megatron = trained.compute_logprobs(batch, micro_batch_size=4, temperature=1.0)
    assert batch.response_mask.sum() > 0
    assert ((megatron - vllm_logprobs).abs() * batch.response_mask).max().item() < 1e-4


def test_small_max_shard_writes_index(tmp_path, exported):
    _, state = load_hf_checkpoint(str(exported))
    out = write_hf_checkpoint(state, config_dir=exported, output_dir=tmp_path / "sharded",
                              options=ExportOptions(max_shard_bytes=64 * 1024))
    index = json.loads((out / "model.safetensors.index.json").read_text())
    files = sorted(p.name for p in out.glob("*.safetensors"))
    assert len(files) > 1 and set(index["weight_map"].values()) == set(files)
    assert set(index["weight_map"]) == set(state)
    _, again = load_hf_checkpoint(str(out))
    assert all(torch.equal(again[n], state[n]) for n in state)


def test_bf16_dtype_option(tmp_path, exported):
    _, state = load_hf_checkpoint(str(exported))
    out = write_hf_checkpoint(state, config_dir=exported, output_dir=tmp_path / "bf16",
                              options=ExportOptions(dtype=torch.bfloat16))
    _, again = load_hf_checkpoint(str(out))
    assert all(t.dtype == torch.bfloat16 for t in again.values())
    assert json.loads((out / "config.json").read_text())["dtype"] == "bfloat16"


def test_an_export_from_a_config_with_an_mtp_module_says_it_holds_none(tmp_path, exported):
    """DeepSeek-V3's multi-token-prediction layers are not trained or exported: config.json must not promise them."""
    import shutil

    _, state = load_hf_checkpoint(str(exported))
    config_dir = tmp_path / "source"
    shutil.copytree(exported, config_dir)
    config = json.loads((config_dir / "config.json").read_text())
    (config_dir / "config.json").write_text(json.dumps(config | {"num_nextn_predict_layers": 1}))
    out = write_hf_checkpoint(state, config_dir=config_dir, output_dir=tmp_path / "out")
    assert json.loads((out / "config.json").read_text())["num_nextn_predict_layers"] == 0


def test_existing_nonempty_output_is_refused(tmp_path, saved):
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "keep.txt").write_text("x")
    with pytest.raises(ConfigError, match="--output"):
        export_checkpoint(saved, tmp_path / "out", parallel=megatron_state.current())


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(ROOT / "cli" / "export_hf.py"), *args], capture_output=True,
                          text=True, timeout=300, cwd=ROOT)


def test_cli_missing_checkpoint_is_one_line_exit_2(tmp_path):
    result = _cli("--checkpoint", str(tmp_path / "nowhere"), "--output", str(tmp_path / "out"))
    assert result.returncode == 2
    assert result.stderr.strip().count("\n") == 0 and "nowhere" in result.stderr


def test_cli_corrupt_checkpoint_is_one_line_exit_2(tmp_path, saved):
    copy = tmp_path / "save"
    shutil.copytree(saved, copy)
    latest = (copy / "latest").read_text().strip()
    victim = next((copy / latest / "model").glob("*.distcp"))
    victim.write_bytes(victim.read_bytes()[:-10])
    result = _cli("--checkpoint", str(copy), "--output", str(tmp_path / "out"))
    assert result.returncode == 2
    assert result.stderr.strip().count("\n") == 0 and victim.name in result.stderr
    assert not (tmp_path / "out").exists()


def test_cli_export_equals_in_process_export(tmp_path, saved, exported):
    result = _cli("--checkpoint", str(saved), "--output", str(tmp_path / "out"))
    assert result.returncode == 0, result.stderr
    _, expected = load_hf_checkpoint(str(exported))
    _, got = load_hf_checkpoint(str(tmp_path / "out"))
    assert set(got) == set(expected) and all(torch.equal(got[n], expected[n]) for n in expected)


def test_live_engine_export_equals_checkpoint_export(tmp_path, trained, initial, exported):
    """`save_hf` at the end of a run exports the live actor; it must match the export of its saved checkpoint."""
    from mindspeed_rl.checkpoint.hf_export import export_engine

    out = export_engine(trained, config_dir=initial, output_dir=tmp_path / "live")
    _, expected = load_hf_checkpoint(str(exported))
    _, got = load_hf_checkpoint(str(out))
    assert set(got) == set(expected) and all(torch.equal(got[n], expected[n]) for n in expected)
