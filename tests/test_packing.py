"""Packed micro-batches (rl_config.use_remove_padding) and token-budget micro-batches (use_dynamic_bsz): the
partition's bound and determinism, and at TP1 the packed forward, log-probs and GRPO update equal the padded
ones sample by sample. Runs in-process (a one-rank gloo world); TP2 and PP2: test_packing_multiprocess.py."""
import pytest
import torch

from mindspeed_rl.algorithms.seqlen_balancing import karmarkar_karp, token_budget_partitions
from mindspeed_rl.parallel import megatron_state
from mindspeed_rl.protocol import Packing, RolloutBatch


# -- the partition -------------------------------------------------------------------------------------------
def _long_tailed_lengths(n: int, seed: int) -> list[int]:
    """64 + an exponential tail of mean 120, cut at 900: RL's few long responses among many short ones."""
    g = torch.Generator().manual_seed(seed)
    return [int(64 + min(900, -120 * torch.log(torch.rand(1, generator=g)).item())) for _ in range(n)]


def test_karmarkar_karp_spread_is_at_most_the_largest_item_and_every_index_once():
    for seed in range(20):
        lengths = _long_tailed_lengths(37, seed)
        groups = karmarkar_karp(lengths, 5)
        assert sorted(i for g in groups for i in g) == list(range(37))
        sums = [sum(lengths[i] for i in g) for g in groups]
        assert max(sums) - min(sums) <= max(lengths)


def test_karmarkar_karp_follows_the_textbook_example():
    # {8,7,6,5,4} in two: differencing 8-7, 6-5, 4-1, 3-1 leaves 2: {7,5,4} = 16 against {8,6} = 14, the
    # method's known gap to the optimum 15/15.
    lengths = [8, 7, 6, 5, 4]
    groups = karmarkar_karp(lengths, 2)
    assert sorted(sorted(lengths[i] for i in g) for g in groups) == [[4, 5, 7], [6, 8]]


def test_token_budget_groups_fit_the_budget_and_are_as_few_as_the_total_allows():
    for seed in range(10):
        lengths = _long_tailed_lengths(64, seed)
        groups = token_budget_partitions(lengths, max_tokens=2048)
        assert sorted(i for g in groups for i in g) == list(range(64))
        assert all(sum(lengths[i] for i in g) <= 2048 for g in groups)
        assert len(groups) <= -(-sum(lengths) // 2048) + 1


def test_token_budget_groups_are_deterministic_and_ordered():
    lengths = _long_tailed_lengths(50, 3)
    first = token_budget_partitions(lengths, max_tokens=1500)
    assert first == token_budget_partitions(list(lengths), max_tokens=1500)
    assert [g[0] for g in first] == sorted(g[0] for g in first)


def test_max_samples_caps_each_group():
    groups = token_budget_partitions([10] * 20, max_tokens=10_000, max_samples=3)
    assert max(len(g) for g in groups) <= 3 and len(groups) == 7


def test_a_sample_over_the_budget_is_an_error():
    with pytest.raises(ValueError, match="sample 1 has 300 tokens, more than the packing budget of 256"):
        token_budget_partitions([10, 300], max_tokens=256)


# -- the packed micro-batch ----------------------------------------------------------------------------------
def _batch(seed: int = 0, samples: int = 6, vocab: int = 64) -> RolloutBatch:
    g = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(1, vocab, (int(n),), generator=g).tolist() for n in torch.randint(2, 7, (samples,), generator=g)]
    responses = [torch.randint(1, vocab, (int(n),), generator=g).tolist() for n in torch.randint(1, 9, (samples,), generator=g)]
    return RolloutBatch.from_token_lists(prompts, responses, pad_id=0, response_width=8)


def test_a_packed_micro_batch_holds_the_samples_without_padding_and_scores_the_same_tokens():
    batch = _batch()
    padded = batch.micro_batches(3, "cpu")[0]
    packed = batch.micro_batches(3, "cpu", Packing(multiple=4))[0]
    lengths = batch.sample_lengths()[:3].tolist()
    assert packed.input_ids.shape == (1, -(-sum(lengths) // 4) * 4)
    assert packed.cu_seqlens.tolist()[:4] == [0, lengths[0], lengths[0] + lengths[1], sum(lengths)]
    assert packed.position_ids[0, lengths[0]].item() == 0  # positions restart per sample
    flat_padded, flat_packed = padded.input_ids.reshape(-1), packed.input_ids.reshape(-1)
    assert torch.equal(flat_padded[padded.scored_rows() + 1], flat_packed[packed.scored_rows() + 1])
    assert torch.equal(flat_padded[padded.scored_rows()], flat_packed[packed.scored_rows()])


# -- the engine, packed vs padded ----------------------------------------------------------------------------
@pytest.fixture(scope="module")
def engines(world, tmp_path_factory):
    from mindspeed_rl.data.tiny_model import create_tiny_qwen2_checkpoint
    from mindspeed_rl.engines.megatron_engine import MegatronEngine, OptimizerSettings
    from mindspeed_rl.models.checkpoint import load_hf_checkpoint
    from mindspeed_rl.models.qwen2 import ModelOptions

    path = str(tmp_path_factory.mktemp("packing") / "model")
    create_tiny_qwen2_checkpoint(path, vocab_size=64, hidden_size=64, ffn_hidden_size=128, num_layers=2,
                                 num_attention_heads=4, num_query_groups=2, seed=3)
    spec, state = load_hf_checkpoint(path)
    settings = OptimizerSettings(lr=1e-3, min_lr=0.0, weight_decay=0.0, adam_beta1=0.9, adam_beta2=0.95,
                                 adam_eps=1e-8, clip_grad=1.0)

    def build(packed: bool):
        return MegatronEngine(spec=spec, hf_state=state, params_dtype=torch.float32, accelerator=world,
                              parallel=megatron_state.current(),
                              optimizer=settings, options=ModelOptions(packed_sequences=packed))

    return build(False), build(True)


def test_packed_log_probs_equal_padded(engines):
    padded, packed = engines
    batch = _batch(5, samples=8)
    # The token budget cuts groups that are not contiguous: the rows must come back in sample order.
    assert [mb.sample_indices for mb in batch.micro_batches(3, "cpu", Packing(max_tokens=30))] == \
        [[0, 2, 4, 6], [1, 3, 5, 7]]
    want = padded.compute_logprobs(batch, micro_batch_size=3, temperature=0.9)
    got = packed.compute_logprobs(batch, micro_batch_size=3, temperature=0.9, packing=Packing())
    budget = packed.compute_logprobs(batch, micro_batch_size=3, temperature=0.9, packing=Packing(max_tokens=30))
    torch.testing.assert_close(got, want, rtol=0, atol=2e-5)
    torch.testing.assert_close(budget, want, rtol=0, atol=2e-5)


def _rollout_columns(batch: RolloutBatch, seed: int) -> RolloutBatch:
    g = torch.Generator().manual_seed(seed)
    mask = batch.response_mask
    for name, scale in (("old_logprobs", 0.5), ("ref_logprobs", 0.3)):
        batch.columns[name] = (-1.0 + scale * torch.randn(mask.shape, generator=g)) * mask
    batch.columns["advantages"] = torch.randn(len(batch), 1, generator=g).expand_as(mask) * mask
    return batch


@pytest.mark.parametrize("loss_agg_mode", ["token-mean", "seq-mean-token-mean"])
def test_a_packed_grpo_update_equals_the_padded_update(engines, loss_agg_mode):
    from mindspeed_rl.algorithms.grpo import GRPOLossConfig
    from mindspeed_rl.workers.actor_steps import train_on_mini_batch

    padded, packed = engines
    for name, param in packed.module.named_parameters():  # the same starting weights (earlier tests stepped)
        param.data.copy_(dict(padded.module.named_parameters())[name].data)
    batch = _rollout_columns(_batch(2, samples=8), seed=4)
    config = GRPOLossConfig(clip_ratio=0.2, kl_penalty="low_var_kl", kl_coef=0.05, entropy_coeff=0.01,
                            loss_agg_mode=loss_agg_mode)
    want = train_on_mini_batch(padded, batch, config, micro_batch_size=3, temperature=1.0)
    got = train_on_mini_batch(packed, batch, config, micro_batch_size=3, temperature=1.0,
                              packing=Packing(max_tokens=40))
    for key in ("actor/pg_loss", "actor/kl_loss", "actor/entropy", "actor/pg_clipfrac", "actor/ppo_kl",
                "actor/grad_norm"):
        assert got[key] == pytest.approx(want[key], rel=1e-5, abs=1e-6), key
    # The gradients themselves (Megatron keeps them in the DDP buffer after the step; Adam's update of elements
    # whose gradient is ~0 would magnify rounding differences into the weights).
    want_grads = {name: param.main_grad for name, param in padded.module.named_parameters()}
    for name, param in packed.module.named_parameters():
        torch.testing.assert_close(param.main_grad, want_grads[name], rtol=1e-4, atol=1e-7)
