"""`sampling_config.logprobs` and `detokenize` reach vLLM's SamplingParams, and `trust_remote_code`
its LLM: real vLLM on a tiny checkpoint, compared with the plain call (logprobs=0, no text).

Runs where: in the pytest process, a 1-rank gloo world (shared with the other single-rank tests).
"""
import pytest
from transformers import AutoTokenizer

from mindspeed_rl.data.tiny_model import create_tiny_qwen2_checkpoint
from mindspeed_rl.models.checkpoint import load_hf_checkpoint
from mindspeed_rl.resharding.naive import load_full_hf
from cpu_vllm import cpu_vllm_engine

PROMPTS = [[5, 9, 6, 11], [7, 9, 8, 11]]
# vLLM caches whole KV blocks (128 tokens on CPU): prompts sharing a 130-token prefix reuse one block.
SHARED_PREFIX = [(7 * i) % 60 + 2 for i in range(130)]
LONG_PROMPTS = [SHARED_PREFIX + [5, 9], SHARED_PREFIX + [7, 8], SHARED_PREFIX + [5, 9]]
MAX_MODEL_LEN = 160
TOP = 3


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    out = tmp_path_factory.mktemp("tiny_sampling") / "model"
    create_tiny_qwen2_checkpoint(out, vocab_size=64, hidden_size=128, ffn_hidden_size=256, num_layers=1,
                                 num_attention_heads=4, num_query_groups=2, seed=23)
    return str(out)


@pytest.fixture(scope="module")
def rollout(world, checkpoint):
    return cpu_vllm_engine(checkpoint, max_model_len=MAX_MODEL_LEN, max_num_seqs=16, cpu_kvcache_space_gb=0.03125,
                           trust_remote_code=True)


def _generate(rollout, **options):
    return rollout.generate(PROMPTS, n=2, max_tokens=6, temperature=1.0, top_p=1.0, top_k=-1, min_p=0.0, seed=3,
                            **options)


def test_trust_remote_code_reaches_the_engine(rollout):
    assert rollout.llm.llm_engine.model_config.trust_remote_code is True


def test_top_logprobs_come_back_and_the_sampled_ones_are_unchanged(rollout):
    plain, rich = _generate(rollout), _generate(rollout, logprobs=TOP)
    assert [g.token_ids for g in rich] == [g.token_ids for g in plain]
    for a, b in zip(rich, plain):
        assert a.logprobs == pytest.approx(b.logprobs, abs=1e-6)
    assert all(g.top_logprobs is None for g in plain)
    for g in rich:
        for token, sampled, step in zip(g.token_ids, g.logprobs, g.top_logprobs):
            assert token in step and step[token] == pytest.approx(sampled, abs=1e-6)
            # the TOP most likely tokens, plus the sampled one when it is not among them
            assert len(step) in (TOP, TOP + 1) and all(lp <= 0 for lp in step.values())


def test_detokenize_returns_the_tokenizers_text(rollout, checkpoint):
    tokenizer = AutoTokenizer.from_pretrained(checkpoint)
    for g in _generate(rollout, detokenize=True):
        assert g.text == tokenizer.decode(g.token_ids, skip_special_tokens=True)


# -- generate_config.enable_prefix_caching ------------------------------------------------------------------
@pytest.fixture(scope="module")
def cached(world, checkpoint, rollout):
    return cpu_vllm_engine(checkpoint, max_model_len=MAX_MODEL_LEN, max_num_seqs=16, cpu_kvcache_space_gb=0.03125,
                           enable_prefix_caching=True)


def _greedy(engine):
    return [(g.token_ids, g.logprobs) for g in engine.generate(
        LONG_PROMPTS, n=1, max_tokens=6, temperature=0.0, top_p=1.0, top_k=-1, min_p=0.0, seed=None)]


def test_prefix_caching_generates_what_the_plain_engine_does_across_weight_pushes_and_kv_rebuilds(
        cached, rollout, checkpoint):
    """Prefix caching reaches vLLM and never serves KV of old weights: after a push of other weights and after a
    KV release/rebuild, the cached engine's greedy tokens and log-probs equal the plain engine's."""
    assert cached.llm.llm_engine.vllm_config.cache_config.enable_prefix_caching is True
    assert rollout.llm.llm_engine.vllm_config.cache_config.enable_prefix_caching is False

    def assert_same():
        for (tokens, logprobs), (want_tokens, want_logprobs) in zip(_greedy(cached), _greedy(rollout)):
            assert tokens == want_tokens
            assert logprobs == pytest.approx(want_logprobs, abs=1e-5)

    assert_same()
    spec, state = load_hf_checkpoint(checkpoint)
    other = {name: tensor * 1.5 if tensor.dim() == 2 else tensor for name, tensor in state.items()}
    for engine in (cached, rollout):
        load_full_hf(engine.named_weights(), other, spec, tp=1, tp_rank=0)
        engine.mark_weights_loaded()
    assert_same()
    cached.release_kv_cache()
    cached.rebuild_kv_cache()
    assert_same()
    for engine in (cached, rollout):  # the other tests of this module use the checkpoint's weights
        load_full_hf(engine.named_weights(), state, spec, tp=1, tp_rank=0)
        engine.mark_weights_loaded()
