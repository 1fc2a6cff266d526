"""The update's logged stats are what docs/algorithms.md ("What each metric averages over") says they are. Each
stat is computed from its definition over the whole mini-batch, with HF transformers' forward of the step's
starting weights as the per-token log-probs and entropies; one rank (4 micro-batches of 2 samples), and two real
gloo DP ranks with 2 micro-batches each, with Megatron's plain optimizer and with its DistributedOptimizer,
log those values (pg_loss, kl_loss, entropy, pg_clipfrac, pg_clipfrac_lower, ppo_kl), the same grad norm, and end
with the same weights.

Runs where: the DP=1 oracle in the pytest process (1-rank gloo world); DP=2 in 2 spawned processes
(torch.multiprocessing, gloo).
"""
import dataclasses
import os

import pytest
import torch
import torch.distributed as dist

from mindspeed_rl.algorithms.grpo import GRPOLossConfig
from mindspeed_rl.data.tiny_model import create_tiny_qwen2_checkpoint
from mindspeed_rl.engines.megatron_engine import MegatronEngine, OptimizerSettings
from mindspeed_rl.models.checkpoint import load_hf_checkpoint
from mindspeed_rl.parallel import megatron_state
from mindspeed_rl.protocol import RolloutBatch
from mindspeed_rl.workers.actor_steps import train_on_mini_batch
from dp_share import dp_share
from resharding_oracle import free_port
from preloaded import spawn_ranks

LOSS = GRPOLossConfig(clip_ratio=0.2, kl_penalty="low_var_kl", kl_coef=0.05, entropy_coeff=0.01, loss_agg_mode="token-mean",
                      clip_ratio_c=1.5)  # low enough that the dual clip bites on these tokens
LOSS_STATS = ("actor/pg_loss", "actor/kl_loss", "actor/entropy", "actor/pg_clipfrac", "actor/pg_clipfrac_lower",
              "actor/ppo_kl")
MICRO_BATCH = 2


def _settings(distributed: bool) -> OptimizerSettings:
    # adam_eps 1e-3: Adam's first step lr x g / (|g| + eps) is then about lr x g / eps wherever |g| < eps, so the
    # parameters after it compare the DP split's gradients themselves. With 1e-8 an entry whose gradient is 0 in exact
    # arithmetic (the key bias: softmax ignores a shift shared by every key) steps by up to lr in the direction of its
    # rounding noise, which the split's summation order changes.
    return OptimizerSettings(lr=1e-3, min_lr=0.0, weight_decay=0.01, adam_beta1=0.9, adam_beta2=0.95, adam_eps=1e-3,
                             clip_grad=1.0, use_distributed_optimizer=distributed)


def _engine(checkpoint: str, accelerator, distributed: bool) -> MegatronEngine:
    spec, state = load_hf_checkpoint(checkpoint)
    return MegatronEngine(spec=spec, hf_state=state, params_dtype=torch.float32, accelerator=accelerator,
                          parallel=megatron_state.current(),
                          optimizer=_settings(distributed))


def _step(engine: MegatronEngine, batch: RolloutBatch) -> tuple[dict, dict]:
    """One step on this DP rank's share of the mini-batch (the whole of it at DP1)."""
    stats = train_on_mini_batch(engine, dp_share(batch), LOSS, micro_batch_size=MICRO_BATCH, temperature=1.0)
    return stats, {name: p.detach().clone() for name, p in engine.module.named_parameters()}


def _mini_batch(checkpoint: str, accelerator) -> RolloutBatch:
    """8 samples of uneven length with old/ref log-probs off the policy, so every stat is non-zero."""
    g = torch.Generator().manual_seed(9)
    prompts = [torch.randint(1, 64, (4,), generator=g).tolist() for _ in range(8)]
    responses = [torch.randint(1, 64, (int(n),), generator=g).tolist() for n in torch.randint(2, 7, (8,), generator=g)]
    batch = RolloutBatch.from_token_lists(prompts, responses, pad_id=0, response_width=6)
    spec, state = load_hf_checkpoint(checkpoint)
    policy = MegatronEngine(spec=spec, hf_state=state, params_dtype=torch.float32, accelerator=accelerator,
                            parallel=megatron_state.current(), optimizer=None)
    logprobs = policy.compute_logprobs(batch, micro_batch_size=4, temperature=1.0)
    mask = batch.response_mask
    batch.columns["old_logprobs"] = (logprobs + 0.5 * torch.randn(logprobs.shape, generator=g)) * mask
    batch.columns["ref_logprobs"] = (logprobs + 0.3 * torch.randn(logprobs.shape, generator=g)) * mask
    batch.columns["advantages"] = torch.randn(len(batch), 1, generator=g).expand_as(logprobs) * mask
    return batch


def _hf_tokens(checkpoint: str, batch: RolloutBatch) -> tuple[torch.Tensor, torch.Tensor]:
    """Per response token: HF transformers' log-prob of the sampled token and the entropy of its distribution."""
    from transformers import Qwen2ForCausalLM

    model = Qwen2ForCausalLM.from_pretrained(checkpoint, dtype=torch.float32, attn_implementation="eager").eval()
    logprobs, entropy = torch.zeros(batch.response_mask.shape), torch.zeros(batch.response_mask.shape)
    with torch.no_grad():
        for i in range(len(batch)):
            start, length = int(batch.prompt_lengths[i]), int(batch.response_mask[i].sum())
            log_p = model(batch.input_ids[i:i + 1, : start + length]).logits[0].log_softmax(-1)[start - 1: start + length - 1]
            tokens = batch.input_ids[i, start: start + length]
            logprobs[i, :length] = log_p.gather(-1, tokens.unsqueeze(-1)).squeeze(-1)
            entropy[i, :length] = -(log_p.exp() * log_p).sum(-1)
    return logprobs, entropy


def _defined_stats(batch: RolloutBatch, logprobs: torch.Tensor, entropy: torch.Tensor, mode: str) -> dict:
    """Each stat from its definition (docs/algorithms.md): the per-token value x, aggregated over the mini-batch as
    the loss is (token-mean sum(m x) / sum(m); seq-mean-token-mean the mean over sequences of their token means), the
    clip fractions and ppo_kl as token means in every mode."""
    m = batch.response_mask
    old, ref, adv = batch.columns["old_logprobs"], batch.columns["ref_logprobs"], batch.columns["advantages"]
    ratio = (logprobs - old).exp()
    unclipped, clipped = -adv * ratio, -adv * ratio.clamp(1 - LOSS.clip_ratio, 1 + LOSS.clip_ratio)
    ppo, bound = torch.maximum(unclipped, clipped), -adv * LOSS.clip_ratio_c
    lower = (adv < 0) & (ppo > bound)
    per_token = {"actor/pg_loss": torch.where(adv < 0, torch.minimum(ppo, bound), ppo),
                 "actor/pg_clipfrac": (clipped > unclipped).float(), "actor/pg_clipfrac_lower": lower.float(),
                 "actor/ppo_kl": old - logprobs, "actor/entropy": entropy,
                 "actor/kl_loss": ((ref - logprobs).exp() - (ref - logprobs) - 1).clamp(-10, 10)}
    token_means = ("actor/pg_clipfrac", "actor/pg_clipfrac_lower", "actor/ppo_kl")  # a fraction in every mode
    if mode == "token-mean":
        return {k: ((x * m).sum() / m.sum()).item() for k, x in per_token.items()}
    return {k: ((x * m).sum() / m.sum() if k in token_means else ((x * m).sum(-1) / m.sum(-1)).mean()).item()
            for k, x in per_token.items()}


def test_one_ranks_stats_are_their_definitions_in_each_aggregation(world, checkpoint):
    batch = _mini_batch(checkpoint, world)
    logprobs, entropy = _hf_tokens(checkpoint, batch)
    for mode in ("token-mean", "seq-mean-token-mean"):
        config = dataclasses.replace(LOSS, loss_agg_mode=mode)
        stats = train_on_mini_batch(_engine(checkpoint, world, False), batch, config, micro_batch_size=MICRO_BATCH,
                                    temperature=1.0)
        for key, want in _defined_stats(batch, logprobs, entropy, mode).items():
            assert abs(stats[key] - want) <= 1e-5 * max(1.0, abs(want)), (mode, key, stats[key], want)


def _assert_same(stats: dict, params: dict, oracle_stats: dict, oracle_params: dict, label: str) -> None:
    for key in (*LOSS_STATS, "actor/grad_norm"):
        want = oracle_stats[key]
        assert abs(stats[key] - want) <= 1e-5 * max(1.0, abs(want)), (label, key, stats[key], want)
    for name, want in oracle_params.items():
        # Adam's first step is lr x g / (|g| + eps): where g is 0 in exact arithmetic and rounding noise in floats (the
        # key biases: softmax ignores a shift shared by every key; a few entries of the qkv and fc weights), the two
        # splits' noise gives steps up to ~1e-5 apart (5.6e-6 measured, in 1-12 entries per tensor); the rest agree
        # to ~1e-8.
        assert (params[name] - want).abs().max().item() < 1e-5, (label, name)


def _worker(rank, world_size, port, checkpoint, batch, oracle_stats, oracle_params):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world_size))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    try:
        from megatron.core import parallel_state as ps

        from mindspeed_rl.accelerator import get_accelerator

        ps.initialize_model_parallel(tensor_model_parallel_size=1, pipeline_model_parallel_size=1)
        assert ps.get_data_parallel_world_size() == 2
        acc = get_accelerator("cpu")
        acc.seed_model_parallel_rng(1)
        for distributed in (False, True):
            stats, params = _step(_engine(checkpoint, acc, distributed), batch)
            _assert_same(stats, params, oracle_stats, oracle_params, f"rank {rank}, distributed optimizer {distributed}")
        ps.destroy_model_parallel()
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    out = tmp_path_factory.mktemp("tiny_dp") / "model"
    create_tiny_qwen2_checkpoint(out, vocab_size=64, hidden_size=64, ffn_hidden_size=128, num_layers=2,
                                 num_attention_heads=4, num_query_groups=2, seed=13)
    return str(out)


def test_dp2_loss_stats_are_their_definitions_and_weights_equal_dp1(world, checkpoint):
    batch = _mini_batch(checkpoint, world)
    oracle_stats, oracle_params = _step(_engine(checkpoint, world, distributed=False), batch)
    assert all(abs(oracle_stats[key]) > 1e-4 for key in LOSS_STATS), oracle_stats  # no stat passes vacuously
    oracle_stats |= _defined_stats(batch, *_hf_tokens(checkpoint, batch), LOSS.loss_agg_mode)
    spawn_ranks(_worker, args=(2, free_port(), checkpoint, batch, oracle_stats, oracle_params), nprocs=2)
