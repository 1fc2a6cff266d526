"""The CPU MoE demo (configs/grpo_tiny_moe_cpu.yaml): synthetic_data.num_experts > 0 generates a tiny Qwen3-MoE
checkpoint that configs/model/tiny_qwen3_moe.yaml describes; the dense demo's assets keep their directory.

Runs where: in this process (Hydra composition, one small checkpoint written with transformers); no engine.
"""
import json
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from mindspeed_rl.config import check_model_block_against_hf
from mindspeed_rl.config.model_check import expert_count_key
from mindspeed_rl.data import arith_task
from mindspeed_rl.data.asset_cache import MANIFEST_FILE, asset_dir_name
from test_config import TINY, compose_cfg, config_error, load

MOE = "grpo_tiny_moe_cpu"
# The dense demo's asset directory before the expert keys existed (data/tiny/arith-d65ad0ef2643 of earlier runs):
# its parameters, and the name they hash to. A change here regenerates every dense user's assets.
DENSE_DEMO_PARAMS = {
    "format_version": 2, "vocab_size": 16, "hidden_size": 128, "ffn_hidden_size": 256, "num_layers": 2,
    "num_attention_heads": 4, "num_query_groups": 2, "max_position_embeddings": 256, "init_std": 0.05,
    "num_prompts": 256, "max_operand": 4, "seed": 1,
}
DENSE_DEMO_DIR = "arith-d65ad0ef2643"


def _leaf_keys(cfg) -> set[str]:
    keys = set()

    def walk(node, prefix):
        for key, value in node.items():
            path = f"{prefix}{key}"
            if OmegaConf.is_dict(value) and value:
                walk(value, f"{path}.")
            else:
                keys.add(path)
    walk(cfg, "")
    return keys


# --- the config -------------------------------------------------------------------------------------


def test_moe_demo_loads_with_train_ep2_and_infer_tp2_without_ep() -> None:
    config = load(MOE)
    actor, gen = config.actor_config, config.generate_config
    assert config.world_size == 2 and config.num_rank_processes == 2
    assert (actor.tensor_model_parallel_size, actor.pipeline_model_parallel_size, actor.expert_model_parallel_size,
            config.train_data_parallel_size) == (1, 1, 2, 2)
    assert (gen.infer_tensor_parallel_size, gen.infer_expert_parallel_size, gen.enable_expert_parallel,
            config.infer_data_parallel_size) == (2, 1, False, 1)
    assert config.megatron_training.bf16 is False and gen.dtype == "float32"
    assert config.megatron_training.train_iters == 20
    assert config.rl_config.routing_replay is False and config.rl_config.mismatch_ledger is False
    synthetic, arch = config.synthetic_data, config.selected_model
    assert synthetic.enabled and synthetic.task == "arith" and synthetic.is_moe
    assert (synthetic.num_experts, synthetic.moe_router_topk, synthetic.moe_ffn_hidden_size) == (8, 2, 64)
    assert (arch.num_experts, arch.moe_router_topk, arch.moe_ffn_hidden_size) == (8, 2, 64)
    assert (arch.hidden_size, arch.num_layers, arch.kv_channels, arch.qk_layernorm, arch.add_qkv_bias) == (
        128, 2, 32, True, False)
    # vLLM on CPU: head size >= 32; hidden size and each inference rank's expert width divisible by 32.
    assert synthetic.hidden_size // synthetic.num_attention_heads >= 32 and synthetic.hidden_size % 32 == 0
    assert (synthetic.moe_ffn_hidden_size // gen.infer_tensor_parallel_size) % 32 == 0


def test_moe_demo_lists_every_key_of_the_dense_demo() -> None:
    """Every key of grpo_tiny_cpu.yaml is there (overrides need no `+`); the only keys it adds are the model block's
    MoE fields and rl_config.routing_replay."""
    dense, moe = _leaf_keys(compose_cfg(TINY)), _leaf_keys(compose_cfg(MOE))
    strip_block = lambda keys, name: {k.replace(f"model.{name}.", "model.BLOCK.") for k in keys}
    dense, moe = strip_block(dense, "tiny_qwen2"), strip_block(moe, "tiny_qwen3_moe")
    assert dense - moe == set()
    assert "rl_config.routing_replay" in moe
    assert moe - dense - {"rl_config.routing_replay"} == {
        "model.BLOCK.kv_channels", "model.BLOCK.qk_layernorm", "model.BLOCK.max_position_embeddings",
        "model.BLOCK.num_experts", "model.BLOCK.moe_router_topk", "model.BLOCK.moe_ffn_hidden_size",
        "model.BLOCK.norm_topk_prob", "model.BLOCK.moe_router_load_balancing_type", "model.BLOCK.moe_aux_loss_coeff",
    }


def test_the_dense_demo_stays_dense() -> None:
    synthetic = load(TINY).synthetic_data
    assert synthetic.num_experts == 0 and not synthetic.is_moe


@pytest.mark.parametrize("override,expected", [
    ("synthetic_data.num_experts=-1", "synthetic_data.num_experts: must be >= 0, got -1"),
    ("synthetic_data.moe_router_topk=9", "synthetic_data.moe_router_topk: must be <= synthetic_data.num_experts=8, "
                                         "got 9"),
    ("synthetic_data.moe_router_topk=0", "synthetic_data.moe_router_topk: must be > 0, got 0"),
    ("synthetic_data.moe_ffn_hidden_size=0", "synthetic_data.moe_ffn_hidden_size: must be > 0, got 0"),
    ("synthetic_data.task=math_word", "synthetic_data.num_experts: the math_word task generates a dense Qwen2 "
                                      "checkpoint (only arith generates a MoE one): set 0, got 8"),
])
def test_synthetic_experts_out_of_range_are_config_errors(override: str, expected: str) -> None:
    assert config_error(MOE, override) == expected


def test_a_dense_task_ignores_the_expert_sizes_with_no_experts() -> None:
    synthetic = load(TINY, "synthetic_data.moe_router_topk=9", "synthetic_data.moe_ffn_hidden_size=0").synthetic_data
    assert not synthetic.is_moe


@pytest.mark.parametrize("override,expected", [
    ("synthetic_data.num_experts=4", "model.tiny_qwen3_moe.num_experts: must equal synthetic_data.num_experts=4, got 8"),
    ("synthetic_data.moe_router_topk=4",
     "model.tiny_qwen3_moe.moe_router_topk: must equal synthetic_data.moe_router_topk=4, got 2"),
    ("synthetic_data.moe_ffn_hidden_size=32",
     "model.tiny_qwen3_moe.moe_ffn_hidden_size: must equal synthetic_data.moe_ffn_hidden_size=32, got 64"),
    ("synthetic_data.num_experts=0", "model.tiny_qwen3_moe.num_experts: synthetic_data.num_experts=0 generates a "
                                     "dense Qwen2 checkpoint: leave it unset, got 8"),
])
def test_the_model_block_must_describe_the_generated_experts(override: str, expected: str) -> None:
    assert config_error(MOE, override) == expected


def test_a_dense_block_cannot_describe_a_generated_moe() -> None:
    assert config_error(TINY, "synthetic_data.num_experts=8", "synthetic_data.moe_router_topk=2") == (
        "model.tiny_qwen2.num_experts: must equal synthetic_data.num_experts=8, got None")


def test_the_block_head_size_must_be_the_generated_one() -> None:
    assert config_error(MOE, "model.tiny_qwen3_moe.kv_channels=64") == (
        "model.tiny_qwen3_moe.kv_channels: must equal synthetic_data.hidden_size / num_attention_heads = 128 / 4 = 32, "
        "got 64")


# --- the generated assets -----------------------------------------------------------------------------


def _generated_params(monkeypatch, config) -> dict:
    """The parameters the trainer's asset step hashes for `config` (nothing is generated)."""
    from mindspeed_rl.trainer import setup

    seen = {}

    def fake_ensure_generated(data_dir, task, params, *, required, generate):
        seen.update(task=task, params=dict(params))
        return Path(data_dir)

    monkeypatch.setattr(arith_task, "ensure_generated", fake_ensure_generated)
    setup._generate_synthetic_assets(config.synthetic_data)
    assert seen["task"] == "arith"
    return seen["params"]


def test_the_dense_demo_keeps_its_asset_directory(monkeypatch) -> None:
    params = _generated_params(monkeypatch, load(TINY))
    assert params == DENSE_DEMO_PARAMS
    assert asset_dir_name("arith", params) == DENSE_DEMO_DIR
    # Expert sizes given with no experts change nothing.
    assert _generated_params(monkeypatch, load(TINY, "synthetic_data.moe_router_topk=3")) == DENSE_DEMO_PARAMS


def test_the_moe_demo_hashes_its_expert_sizes(monkeypatch) -> None:
    params = _generated_params(monkeypatch, load(MOE))
    assert {k: params[k] for k in ("num_experts", "moe_router_topk", "moe_ffn_hidden_size")} == {
        "num_experts": 8, "moe_router_topk": 2, "moe_ffn_hidden_size": 64}
    other = _generated_params(monkeypatch, load(MOE, "synthetic_data.moe_router_topk=3",
                                                "model.tiny_qwen3_moe.moe_router_topk=3"))
    assert asset_dir_name("arith", other) != asset_dir_name("arith", params)


def test_ensure_demo_assets_writes_a_qwen3_moe_checkpoint(tmp_path) -> None:
    sizes = dict(vocab_size=16, hidden_size=64, ffn_hidden_size=128, num_layers=1, num_attention_heads=2,
                 num_query_groups=1, max_position_embeddings=32, num_prompts=8, max_operand=4, seed=1)
    model_dir, prompts = arith_task.ensure_demo_assets(tmp_path, **sizes, num_experts=4, moe_router_topk=2,
                                                       moe_ffn_hidden_size=32)
    hf = json.loads((model_dir / "config.json").read_text())
    assert hf["architectures"] == ["Qwen3MoeForCausalLM"] and hf["model_type"] == "qwen3_moe"
    # transformers 5 writes the expert count as num_local_experts, the published Qwen3-MoE configs as num_experts.
    assert hf[expert_count_key(hf)] == 4
    assert (hf["num_experts_per_tok"], hf["moe_intermediate_size"]) == (2, 32)
    assert (hf["hidden_size"], hf["head_dim"], hf["num_key_value_heads"], hf["intermediate_size"]) == (64, 32, 1, 128)
    assert (hf["vocab_size"], hf["num_hidden_layers"], hf["max_position_embeddings"]) == (16, 1, 32)
    assert prompts.is_file() and (model_dir / "tokenizer.json").is_file()
    manifest = json.loads((model_dir.parent / MANIFEST_FILE).read_text())
    assert manifest["num_experts"] == 4 and manifest["task"] == "arith"
    dense_model, _ = arith_task.ensure_demo_assets(tmp_path, **sizes)  # the same sizes, dense: its own directory
    assert dense_model != model_dir
    assert json.loads((dense_model / "config.json").read_text())["architectures"] == ["Qwen2ForCausalLM"]


def test_the_moe_demo_block_describes_its_generated_checkpoint(tmp_path) -> None:
    """What the trainer compares at start (model_check): the demo's own block against the demo's own checkpoint."""
    from mindspeed_rl.trainer import setup

    config = load(MOE, f"synthetic_data.data_dir={tmp_path}")
    model_dir, _ = setup._generate_synthetic_assets(config.synthetic_data)
    hf = json.loads((model_dir / "config.json").read_text())
    assert hf["architectures"] == ["Qwen3MoeForCausalLM"] and hf[expert_count_key(hf)] == 8
    check_model_block_against_hf(config.selected_model, "model.tiny_qwen3_moe", hf)  # raises on a mismatch
