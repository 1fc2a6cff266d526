"""The CPU demo's generated assets: tokenizer, tiny Qwen2 checkpoint, prompts, rule rewards."""

import json

import pytest
import torch

from mindspeed_rl.data import (
    EOS_TOKEN,
    accuracy,
    arith_acc,
    compute_rule_rewards,
    create_tiny_qwen2_checkpoint,
    ensure_demo_assets,
    make_arith_prompts,
    read_prompts_jsonl,
    train_arith_tokenizer,
    write_prompts_jsonl,
)
from mindspeed_rl.data import rewards
from mindspeed_rl.data.tokenizer import QWEN2_PRETOKENIZE_REGEX

VOCAB_SIZE = 48
TINY = dict(vocab_size=VOCAB_SIZE, hidden_size=32, ffn_hidden_size=64, num_layers=2,
            num_attention_heads=4, num_query_groups=2, max_position_embeddings=64)
TEXTS = ["3+4=7", "12+30=42", " 7", "  1 + 2 = 3 ", "", "99+99=198"]


@pytest.fixture(scope="module")
def tokenizer():
    return train_arith_tokenizer(VOCAB_SIZE, seed=0, num_lines=500)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory, tokenizer):
    out_dir = tmp_path_factory.mktemp("ckpt") / "tiny"
    return create_tiny_qwen2_checkpoint(out_dir, **TINY, seed=3, tokenizer=tokenizer)


def test_tokenizer_round_trip_and_exact_vocab(tokenizer):
    for text in TEXTS:
        assert tokenizer.decode(tokenizer.encode(text).ids) == text
    ids = sorted(tokenizer.get_vocab(with_added_tokens=True).values())
    assert ids == list(range(VOCAB_SIZE))
    assert tokenizer.token_to_id(EOS_TOKEN) == 0
    for token_id in range(VOCAB_SIZE):
        assert tokenizer.decode([token_id], skip_special_tokens=False) != ""


def test_tokenizer_is_deterministic_and_rejects_tiny_vocab(tokenizer):
    again = train_arith_tokenizer(VOCAB_SIZE, seed=0, num_lines=500)
    assert again.to_str() == tokenizer.to_str()
    with pytest.raises(ValueError, match="too small"):
        train_arith_tokenizer(5, seed=0)


def test_pretokenize_regex_matches_transformers_qwen2():
    from transformers.models.qwen2.tokenization_qwen2 import PRETOKENIZE_REGEX

    assert QWEN2_PRETOKENIZE_REGEX == PRETOKENIZE_REGEX


def test_auto_tokenizer_from_checkpoint_agrees(checkpoint, tokenizer):
    from transformers import AutoTokenizer

    # config.json says qwen2, so transformers rebuilds a Qwen2Tokenizer from vocab + merges.
    hf_tokenizer = AutoTokenizer.from_pretrained(str(checkpoint), local_files_only=True)
    assert len(hf_tokenizer) == VOCAB_SIZE
    assert hf_tokenizer.eos_token_id == 0 and hf_tokenizer.pad_token_id == 0
    for text in TEXTS:
        ids = hf_tokenizer.encode(text, add_special_tokens=False)
        assert ids == tokenizer.encode(text).ids
        assert hf_tokenizer.decode(ids) == text
    for token_id in range(VOCAB_SIZE):
        assert hf_tokenizer.decode([token_id]) == tokenizer.decode([token_id], skip_special_tokens=False)
    # filler tokens are not special, so they cannot vanish from a decoded response.
    filler = VOCAB_SIZE - 1
    seven = hf_tokenizer.encode("7")[0]
    decoded = hf_tokenizer.decode([filler, seven], skip_special_tokens=True)
    assert decoded == tokenizer.id_to_token(filler) + "7"
    assert decoded.startswith("<|unused_")


def test_tiny_checkpoint_loads_with_requested_sizes(checkpoint):
    from transformers import Qwen2ForCausalLM

    model = Qwen2ForCausalLM.from_pretrained(str(checkpoint))
    config = model.config
    assert (config.vocab_size, config.hidden_size, config.intermediate_size) == (48, 32, 64)
    assert (config.num_hidden_layers, config.num_attention_heads, config.num_key_value_heads) == (2, 4, 2)
    assert config.tie_word_embeddings is False
    assert config.rope_parameters["rope_theta"] == 1e6
    assert model.lm_head.weight.data_ptr() != model.model.embed_tokens.weight.data_ptr()
    assert not torch.equal(model.lm_head.weight, model.model.embed_tokens.weight)
    # biases and norms are random too, so a mapping bug cannot hide behind zeros / ones.
    layer = model.model.layers[0]
    assert layer.self_attn.q_proj.bias.abs().min() > 0
    assert not torch.allclose(layer.input_layernorm.weight, torch.ones(32))
    logits = model(torch.tensor([[3, 1, 4, 12]])).logits
    assert logits.shape == (1, 4, VOCAB_SIZE) and torch.isfinite(logits).all()


def test_tiny_checkpoint_is_seeded(tmp_path, tokenizer):
    from safetensors.torch import load_file

    first = create_tiny_qwen2_checkpoint(tmp_path / "a", **TINY, seed=5, tokenizer=tokenizer)
    second = create_tiny_qwen2_checkpoint(tmp_path / "b", **TINY, seed=5, tokenizer=tokenizer)
    weights_a, weights_b = load_file(first / "model.safetensors"), load_file(second / "model.safetensors")
    assert weights_a.keys() == weights_b.keys()
    assert all(torch.equal(weights_a[name], weights_b[name]) for name in weights_a)
    # no staging directories are left next to the targets
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a", "b"]


def test_ensure_demo_assets_reuses_and_gives_other_parameters_their_own_directory(tmp_path):
    params = dict(TINY, num_prompts=16, max_operand=9, seed=7)
    model_dir, prompts_path = ensure_demo_assets(tmp_path, **params)
    assert model_dir.parent == prompts_path.parent and model_dir.parent.parent == tmp_path
    assert model_dir.parent.name.startswith("arith-")
    weights = model_dir / "model.safetensors"
    first_mtimes = (weights.stat().st_mtime_ns, prompts_path.stat().st_mtime_ns)
    assert len(read_prompts_jsonl(prompts_path)) == 16

    assert ensure_demo_assets(tmp_path, **params) == (model_dir, prompts_path)
    assert (weights.stat().st_mtime_ns, prompts_path.stat().st_mtime_ns) == first_mtimes

    other_model, other_prompts = ensure_demo_assets(tmp_path, **dict(params, num_prompts=20))
    assert other_model.parent != model_dir.parent
    assert len(read_prompts_jsonl(other_prompts)) == 20
    assert json.loads((other_model.parent / "assets.json").read_text())["num_prompts"] == 20
    # the first set is still there, untouched
    assert len(read_prompts_jsonl(prompts_path)) == 16
    assert (weights.stat().st_mtime_ns, prompts_path.stat().st_mtime_ns) == first_mtimes


def test_the_evaluation_split_holds_every_problem_of_the_task_once(tmp_path):
    from mindspeed_rl.data.arith_task import EVAL_FILE

    _, prompts_path = ensure_demo_assets(tmp_path, **dict(TINY, num_prompts=16, max_operand=3, seed=7))
    rows = read_prompts_jsonl(prompts_path.with_name(EVAL_FILE))
    assert sorted(row["prompt"] for row in rows) == sorted(f"{a}+{b}=" for a in range(4) for b in range(4))
    assert all(int(row["answer"]) == sum(map(int, row["prompt"][:-1].split("+"))) for row in rows)


def test_prompts_are_correct_sums_and_round_trip(tmp_path):
    rows = make_arith_prompts(50, max_operand=9, seed=0)
    for row in rows:
        a, b = row["prompt"].removesuffix("=").split("+")
        assert 0 <= int(a) <= 9 and 0 <= int(b) <= 9
        assert row["answer"] == str(int(a) + int(b))
    path = tmp_path / "p.jsonl"
    write_prompts_jsonl(path, rows)
    assert read_prompts_jsonl(path) == rows


def test_prompts_parse_error_names_file_and_line(tmp_path):
    path = tmp_path / "bad.jsonl"
    path.write_text('{"prompt": "1+1=", "answer": "2"}\n\n{"prompt": "2+2="}\n')
    with pytest.raises(ValueError, match=rf"{path}:3: .*'answer'"):
        read_prompts_jsonl(path)
    path.write_text("not json\n")
    with pytest.raises(ValueError, match=rf"{path}:1: invalid JSON"):
        read_prompts_jsonl(path)


@pytest.mark.parametrize(
    "response, answer, expected",
    [("7", "7", 1.0), (" 7", "7", 1.0), ("7+1", "7", 1.0), ("12", "1", 0.2), ("x", "7", 0.0),
     ("", "7", 0.0)],
)
def test_arith_acc_shaping(response, answer, expected):
    assert arith_acc(response, answer) == expected


def starts_with_space(response: str, answer: str) -> float:
    # Module level: verifiers run in the verifier process, which imports them by name.
    return float(response.startswith(" "))


def test_weighted_sum_of_two_verifiers(monkeypatch):
    monkeypatch.setitem(rewards.VERIFIERS, "starts_with_space", starts_with_space)
    got = compute_rule_rewards([" 7", "12", "x"], ["7", "1", "7"],
                               ["arith_acc", "starts_with_space"], [1.0, 0.5])
    assert got.total.dtype == torch.float32
    torch.testing.assert_close(got.total, torch.tensor([1.5, 0.2, 0.0]))
    with pytest.raises(ValueError, match=r"'nope'.*arith_acc"):
        compute_rule_rewards(["7"], ["7"], ["nope"], [1.0])
    assert accuracy([" 7", "12", "7"], ["7", "1", "8"], ["arith_acc"]) == pytest.approx(1.0 / 3.0)
