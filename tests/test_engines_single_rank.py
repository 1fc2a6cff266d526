"""Megatron-core and vLLM in one process (world of 1 rank, gloo), checked against HF transformers.

Runs where: in the pytest process; builds a tiny Qwen2 checkpoint in a temp dir.
"""

import pytest
import torch

from mindspeed_rl.data.tiny_model import create_tiny_qwen2_checkpoint
from mindspeed_rl.engines.megatron_engine import MegatronEngine, OptimizerSettings
from mindspeed_rl.protocol import RolloutBatch
from mindspeed_rl.resharding.fingerprint import verify_transfer
from mindspeed_rl.resharding.plan import InferLayout, TrainLayout, build_plan
from mindspeed_rl.resharding.transfer import Transfer
from mindspeed_rl.models.checkpoint import load_hf_checkpoint
from mindspeed_rl.parallel import megatron_state
from cpu_vllm import cpu_vllm_engine

ADAM = OptimizerSettings(lr=1e-2, min_lr=0.0, weight_decay=0.0, adam_beta1=0.9, adam_beta2=0.95, adam_eps=1e-8, clip_grad=1.0)
PROMPTS = [[5, 9, 6, 11], [7, 9, 8, 11], [4, 9, 4, 11]]
MAX_TOKENS = 6


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    out = tmp_path_factory.mktemp("tiny") / "model"
    create_tiny_qwen2_checkpoint(out, vocab_size=64, hidden_size=128, ffn_hidden_size=256, num_layers=2,
                                 num_attention_heads=4, num_query_groups=2, seed=3)
    return str(out)


@pytest.fixture(scope="module")
def actor(world, checkpoint):
    spec, state = load_hf_checkpoint(checkpoint)
    return MegatronEngine(spec=spec, hf_state=state, params_dtype=torch.float32, accelerator=world,
                          parallel=megatron_state.current(), optimizer=ADAM)


@pytest.fixture(scope="module")
def rollout(world, checkpoint):
    return cpu_vllm_engine(checkpoint)


def hf_model(checkpoint):
    from transformers import Qwen2ForCausalLM

    return Qwen2ForCausalLM.from_pretrained(checkpoint, dtype=torch.float32, attn_implementation="eager").eval()


def test_megatron_logits_equal_hf(world, checkpoint, actor):
    ids = torch.randint(0, 64, (3, 17), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        expected = hf_model(checkpoint)(ids).logits
        with world.megatron_context():
            got = actor.module(ids.to(world.device), torch.arange(17, device=world.device).expand(3, 17), None).cpu()
    assert got.shape == expected.shape
    assert (got - expected).abs().max().item() < 1e-4


def _rollout_batch(generations) -> RolloutBatch:
    batch = RolloutBatch.from_token_lists([PROMPTS[g.prompt_index] for g in generations],
                                          [g.token_ids for g in generations], pad_id=0, response_width=MAX_TOKENS)
    logprobs = torch.zeros(batch.response_logprobs_shape)
    for row, g in enumerate(generations):
        logprobs[row, : len(g.logprobs)] = torch.tensor(g.logprobs)
    batch.columns["rollout_logprobs"] = logprobs
    return batch


def _generate(rollout):
    return rollout.generate(PROMPTS, n=4, max_tokens=MAX_TOKENS, temperature=1.0, top_p=1.0, top_k=-1, min_p=0.0, seed=7)


def _max_diff(a, b, mask):
    return ((a - b).abs() * mask).max().item()


def test_vllm_logprobs_follow_megatron_across_updates(actor, rollout):
    """vLLM's sampled-token log-probs equal Megatron's before and after train steps + weight push."""
    batch = _rollout_batch(_generate(rollout))
    assert batch.response_mask.sum() > 0
    megatron = actor.compute_logprobs(batch, micro_batch_size=4, temperature=1.0)
    assert _max_diff(megatron, batch.columns["rollout_logprobs"], batch.response_mask) < 1e-4

    def loss_fn(logprobs, entropy, mb):  # push up the sampled tokens: a visible, real update
        loss = -(logprobs * mb.response_mask).sum() / batch.response_mask.sum()
        return loss, {"loss": loss.item()}

    for _ in range(2):
        stats = actor.train_step(batch, micro_batch_size=4, temperature=1.0, loss_fn=loss_fn)
        assert stats["actor/grad_norm"] > 0
    updated = actor.compute_logprobs(batch, micro_batch_size=4, temperature=1.0)
    assert _max_diff(updated, megatron, batch.response_mask) > 1e-2, "the update must move the policy"

    plan = build_plan(actor.spec, TrainLayout(tp=1, pp=1), InferLayout(tp=1), world_size=1)
    stats = Transfer(plan, rank=0, bucket_bytes=1 << 16, dtype=torch.float32).run(actor.named_weights(), rollout.named_weights())
    assert stats.bytes_received == 0 and stats.bytes_local > 0, "same layout on one rank: nothing crosses the wire"
    assert verify_transfer(plan, 0, actor.named_weights(), rollout.named_weights()) > 0
    rollout.mark_weights_loaded()
    after = _rollout_batch(_generate(rollout))
    megatron_after = actor.compute_logprobs(after, micro_batch_size=4, temperature=1.0)
    assert _max_diff(megatron_after, after.columns["rollout_logprobs"], after.response_mask) < 1e-4


def test_hf_weights_round_trip_exact(actor, checkpoint):
    """Megatron shards -> HF names gives back exactly the tensors of a freshly loaded engine."""
    from mindspeed_rl.models.layouts import megatron_shard_from_hf

    from mindspeed_rl.checkpoint.hf_export import hf_weights_from_megatron

    exported = hf_weights_from_megatron(actor.named_weights(), actor.spec, parallel=actor.parallel)
    _, original = load_hf_checkpoint(checkpoint)
    assert set(exported) == set(original)
    again = megatron_shard_from_hf(exported, actor.spec, tp_rank=0, tp=1)
    for name, param in actor.module.named_parameters():
        assert torch.equal(again[name].cpu(), param.detach().cpu()), name


def test_kv_cache_release_and_rebuild_keep_outputs(rollout):
    before = _generate(rollout)
    nbytes = rollout.kv_cache_bytes()
    assert nbytes > 0
    assert rollout.release_kv_cache() == nbytes
    assert rollout.kv_cache_bytes() == 0
    assert rollout.rebuild_kv_cache() == nbytes
    after = _generate(rollout)
    assert [g.token_ids for g in after] == [g.token_ids for g in before]
    assert [g.logprobs for g in after] == [g.logprobs for g in before]


def test_cpu_gemms_read_packed_copies_of_the_loaded_weights(checkpoint, rollout):
    """engines/vllm_cpu_linears.py: after a load the linears GEMM with oneDNN copies packed from the plain weights,
    as many bytes as the planner predicts; dropped, the plain weights give the same samples and log-probs."""
    import json
    from pathlib import Path

    from mindspeed_rl.engines.vllm_cpu_linears import packs_linears
    from mindspeed_rl.planner.arch import from_hf_config
    from mindspeed_rl.planner.params import vllm_packed_linear_numel

    if not packs_linears():
        pytest.skip("vLLM-cpu packs its linears with oneDNN on x86 only")
    arch = from_hf_config(json.loads((Path(checkpoint) / "config.json").read_text()))
    assert rollout.packed_linear_bytes() == 4 * vllm_packed_linear_numel(arch, tp=1, dp=1, expert_parallel=False)
    packed = _generate(rollout)
    freed = rollout.drop_packed_linears()
    assert freed > 0 and rollout.packed_linear_bytes() == 0
    plain = _generate(rollout)
    assert rollout.pack_linears() == freed
    assert [g.token_ids for g in plain] == [g.token_ids for g in packed]
    for a, b in zip(plain, packed):
        assert max(abs(x - y) for x, y in zip(a.logprobs, b.logprobs)) < 1e-5
    assert [g.logprobs for g in _generate(rollout)] == [g.logprobs for g in packed]


def _sampled(rollout, until=None):
    """One sample of each prompt (budgets 3, 5, 6) from the same generator state: the stepped generate's input."""
    torch.manual_seed(11)
    return rollout.generate(PROMPTS, n=1, max_tokens=[3, 5, MAX_TOKENS], temperature=1.0, top_p=1.0, top_k=-1,
                            min_p=0.0, seed=None, until=until)


def test_a_stepped_generate_run_to_the_end_samples_what_generate_samples(rollout):
    whole, stepped = _sampled(rollout), _sampled(rollout, until=lambda unfinished: not unfinished)
    assert [g.token_ids for g in stepped] == [g.token_ids for g in whole]
    assert [g.logprobs for g in stepped] == [g.logprobs for g in whole]
    assert [g.stopped for g in stepped] == [g.stopped for g in whole]


def test_a_stepped_generate_stopped_early_keeps_each_samples_tokens_so_far(rollout):
    steps = []

    def after_four_steps(unfinished):
        steps.append(list(unfinished))
        return len(steps) == 4 or not unfinished

    whole, stopped = _sampled(rollout), _sampled(rollout, until=after_four_steps)
    # step 1 prefills and samples a token: after 4 steps, 4 tokens; the budget-3 sample finished at step 3
    assert steps[2] == [1, 2] and [len(g.token_ids) for g in stopped] == [3, 4, 4]
    for cut, full in zip(stopped, whole):
        kept = len(cut.token_ids)
        assert cut.token_ids == full.token_ids[:kept] and cut.logprobs == full.logprobs[:kept]
    assert [g.stopped for g in stopped[1:]] == [False, False]  # aborted: carried, not done
    assert [g.token_ids for g in _sampled(rollout)] == [g.token_ids for g in whole]  # the engine is left clean
