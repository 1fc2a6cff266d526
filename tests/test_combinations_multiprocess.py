"""What users combine, pairwise: every advantage estimator (gae: PPO with a critic) x every loss_agg_mode x {padded,
packed} x {DP2, TP2 (sequence parallel), PP2, CP2} x {dynamic sampling off, on} x {LoRA off, on}, in an all-pairs design
(tests/allpairs.py: 22 cases instead of the product's 640). Each case is one update on a tiny Qwen2 with the repo's own
steps (the estimator, dynamic sampling's group filter, train_on_mini_batch, the critic's clipped value loss) and asserts
a finite loss, every logged metric inside its definition's range (docs/algorithms.md "What each metric averages over"),
and the same loss stats and gradient as the same case at DP1: the actor's full gradient (sharded from the DP1 one by
the layouts' map at TP2 and PP2; LoRA's adapters and the critic by name where the shapes agree, DP2 and CP2, else by
the global gradient norm).

Runs where: the DP1 oracles in the pytest process (1-rank gloo world); every case's layout in one spawn of 2
processes (torch.multiprocessing, gloo).
"""
import math
import os

import pytest
import torch
import torch.distributed as dist

from allpairs import all_pairs, pairs_of
from dp_share import dp_share
from mindspeed_rl.data.tiny_model import create_tiny_qwen2_checkpoint
from mindspeed_rl.parallel import megatron_state
from mindspeed_rl.protocol import RolloutBatch
from resharding_oracle import free_port
from preloaded import spawn_ranks

FACTORS = {
    "estimator": ["group_norm", "rloo", "reinforce_plus_plus", "reinforce_plus_plus_baseline", "gae"],
    "loss_agg_mode": ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm"],
    "packing": ["padded", "packed"],
    "layout": ["DP2", "TP2", "PP2", "CP2"],
    "dynamic_sampling": [False, True],
    "lora": [False, True],
}
CASES = all_pairs(FACTORS)
LAYOUTS = {"DP2": (1, 1, 1), "TP2": (2, 1, 1), "PP2": (1, 2, 1), "CP2": (1, 1, 2)}  # (TP, PP, CP) on 2 ranks
WIDTH, N_PER_PROMPT = 6, 2  # response width (seq-mean-token-sum-norm's L), samples per prompt
REWARDS = torch.tensor([1.0, 0.0, 1.0, 1.0, 0.0, 1.0, 0.0, 0.0])  # groups 1 and 3 have no spread
STATS = ("actor/pg_loss", "actor/kl_loss", "actor/entropy", "actor/pg_clipfrac", "actor/pg_clipfrac_lower",
         "actor/ppo_kl", "actor/grad_norm")
CRITIC_STATS = ("critic/vf_loss", "critic/vf_clipfrac", "critic/grad_norm")
# A token's entropy is at most log(vocabulary), its low_var_kl at most 10 (the clamp); seq-mean-token-sum adds up to
# WIDTH of them per sequence. The fractions are token means in every mode.
RANGES = {"actor/pg_clipfrac": (0, 1), "actor/pg_clipfrac_lower": (0, 1), "actor/entropy": (0, math.log(64)),
          "actor/kl_loss": (0, 10), "critic/vf_clipfrac": (0, 1), "critic/vf_loss": (0, math.inf),
          "actor/grad_norm": (0, math.inf), "critic/grad_norm": (0, math.inf)}
PER_SEQUENCE_SUMS = ("actor/entropy", "actor/kl_loss")


def _adam():
    from mindspeed_rl.engines.megatron_engine import OptimizerSettings

    return OptimizerSettings(lr=1e-3, min_lr=0.0, weight_decay=0.0, adam_beta1=0.9, adam_beta2=0.95, adam_eps=1e-8,
                             clip_grad=1.0)


def _options(case: dict, sequence_parallel: bool = False):
    from mindspeed_rl.models.qwen2 import ModelOptions

    # CP shards each sample's tokens, which the packed layout does; its padded batches run through it too.
    packed = case["packing"] == "packed" or case["layout"] == "CP2"
    return ModelOptions(packed_sequences=packed, sequence_parallel=sequence_parallel)


def _engines(checkpoint: str, case: dict, accelerator, sequence_parallel: bool = False):
    """The actor (with LoRA when the case says) and, for gae, the critic, on the current Megatron layout."""
    from mindspeed_rl.engines.critic import CriticEngine
    from mindspeed_rl.engines.megatron_engine import MegatronEngine
    from mindspeed_rl.models.checkpoint import load_hf_checkpoint
    from mindspeed_rl.models.lora import LoRASettings

    spec, state = load_hf_checkpoint(checkpoint)
    options = _options(case, sequence_parallel)
    lora = LoRASettings(rank=4, alpha=8.0, target_modules=("linear_qkv", "linear_proj"), seed=5) if case["lora"] else None
    actor = MegatronEngine(spec=spec, hf_state=state, params_dtype=torch.float32, accelerator=accelerator,
                           parallel=megatron_state.current(),
                           optimizer=_adam(), options=options, lora=lora)
    critic = None
    if case["estimator"] == "gae":
        critic = CriticEngine(spec=spec, hf_state=state, params_dtype=torch.float32, accelerator=accelerator,
                              parallel=megatron_state.current(),
                              optimizer=_adam(), options=options, head_seed=3)
    return spec, actor, critic


def _rollout(checkpoint: str, case: dict, accelerator) -> RolloutBatch:
    """The case's mini-batch, made on one rank with the repo's own steps: the rollout columns (old and reference
    log-probs off the policy), dynamic sampling's group filter, the estimator's advantages (gae: the critic's values,
    GAE's advantages and returns)."""
    from mindspeed_rl.algorithms.advantages import compute_advantages
    from mindspeed_rl.algorithms.ppo import gae_advantages_and_returns, token_level_rewards
    from mindspeed_rl.trainer.dynamic_sampling import groups_with_spread

    g = torch.Generator().manual_seed(21)
    prompts = [torch.randint(1, 64, (int(n),), generator=g).tolist() for n in torch.randint(2, 6, (4,), generator=g)]
    prompts = [p for p in prompts for _ in range(N_PER_PROMPT)]
    responses = [torch.randint(1, 64, (int(n),), generator=g).tolist() for n in torch.randint(1, WIDTH + 1, (8,), generator=g)]
    batch = RolloutBatch.from_token_lists(prompts, responses, pad_id=0, response_width=WIDTH)
    _, actor, critic = _engines(checkpoint, case, accelerator)
    logprobs = actor.compute_logprobs(batch, micro_batch_size=4, temperature=1.0)
    mask = batch.response_mask
    batch.columns["old_logprobs"] = (logprobs + 0.4 * torch.randn(mask.shape, generator=g)) * mask
    batch.columns["ref_logprobs"] = (logprobs + 0.3 * torch.randn(mask.shape, generator=g)) * mask
    rewards = REWARDS
    if case["dynamic_sampling"]:
        kept = [i * N_PER_PROMPT + j for i in groups_with_spread(REWARDS, N_PER_PROMPT) for j in range(N_PER_PROMPT)]
        batch, rewards = batch.select(torch.tensor(kept)), REWARDS[kept]
    mask = batch.response_mask
    if critic is None:
        from types import SimpleNamespace

        rl = SimpleNamespace(adv_estimator=case["estimator"], n_samples_per_prompt=N_PER_PROMPT,
                             norm_adv_by_std_in_grpo=True, gamma=0.9)
        batch.columns["advantages"] = compute_advantages(rl, rewards, mask)
    else:
        values = critic.compute_values(batch, micro_batch_size=4)
        advantages, returns = gae_advantages_and_returns(token_level_rewards(rewards, mask), values, mask,
                                                         gamma=1.0, lam=0.95)
        batch.columns.update(advantages=advantages, returns=returns, values=values)
    return batch


def _update(case: dict, actor, critic, batch: RolloutBatch) -> dict[str, float]:
    """One update on this DP rank's share: the actor's GRPO/PPO loss and, with a critic, its clipped value loss."""
    from mindspeed_rl.algorithms.grpo import GRPOLossConfig, count_loss_units
    from mindspeed_rl.algorithms.ppo import clipped_value_loss
    from mindspeed_rl.protocol import Packing
    from mindspeed_rl.workers.actor_steps import train_on_mini_batch

    mode, share = case["loss_agg_mode"], dp_share(batch)
    packing = Packing() if case["packing"] == "packed" else None
    micro_batch_size = max(1, len(share) // 2)  # two micro-batches per rank
    loss = GRPOLossConfig(clip_ratio=0.2, kl_penalty="low_var_kl", kl_coef=0.05, entropy_coeff=0.01,
                          loss_agg_mode=mode, norm_length=WIDTH, clip_ratio_c=3.0)
    stats = train_on_mini_batch(actor, share, loss, micro_batch_size=micro_batch_size, temperature=1.0,
                                packing=packing)
    if critic is not None:
        denominator = critic.over_data_parallel(count_loss_units(share.response_mask, mode, WIDTH))
        tokens = critic.over_data_parallel(float(share.response_mask.sum()))

        def value_loss(values, mb):
            return clipped_value_loss(values, mb.extras["values"], mb.extras["returns"], mb.response_mask,
                                      cliprange_value=0.2, loss_agg_mode=mode, denominator=denominator,
                                      mini_batch_tokens=tokens)

        stats |= critic.train_step(share, micro_batch_size=micro_batch_size, loss_fn=value_loss, packing=packing)
    return stats


def _grads(engine) -> dict[str, torch.Tensor]:
    return {name: p.main_grad.detach().clone() for name, p in engine.module.named_parameters()
            if getattr(p, "main_grad", None) is not None and p.requires_grad}


def _assert_in_ranges(stats: dict, case: dict) -> None:
    for key, value in stats.items():
        assert math.isfinite(value), (case, key, value)
        low, high = RANGES.get(key, (-math.inf, math.inf))
        if case["loss_agg_mode"] == "seq-mean-token-sum" and key in PER_SEQUENCE_SUMS:
            high *= WIDTH
        assert low - 1e-6 <= value <= high + 1e-6, (case, key, value)


def _close(got: float, want: float) -> bool:
    return abs(got - want) <= 2e-5 * max(1.0, abs(want))


def _check_gradients(case, spec, actor, critic, oracle, label) -> None:
    from megatron.core import parallel_state as ps

    from mindspeed_rl.models.layouts import megatron_shard_from_hf

    tp, pp, _ = LAYOUTS[case["layout"]]
    for engine, want in ((actor, oracle["actor_grads"]), (critic, oracle.get("critic_grads"))):
        if engine is None:
            continue
        got = _grads(engine)
        if engine is actor and not case["lora"]:  # the full gradient, cut as the layouts' map places it
            want = megatron_shard_from_hf(oracle["actor_hf_grads"], spec, tp=tp, tp_rank=ps.get_tensor_model_parallel_rank(),
                                          pp=pp, pp_rank=ps.get_pipeline_model_parallel_rank())
        elif tp * pp > 1:
            continue  # LoRA's adapters and the critic at TP2/PP2: the grad norm (checked with the stats) covers them
        assert set(got) <= set(want), (label, sorted(set(got) - set(want)))
        for name, grad in got.items():
            error = (grad - want[name]).abs().max().item()
            assert error <= 2e-5 * max(1.0, want[name].abs().max().item()), (label, name, error)


def _run_case(checkpoint: str, case: dict, batch: RolloutBatch, oracle: dict) -> None:
    from megatron.core import parallel_state as ps

    from mindspeed_rl.accelerator import get_accelerator

    tp, pp, cp = LAYOUTS[case["layout"]]
    ps.initialize_model_parallel(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
                                 context_parallel_size=cp)
    try:
        accelerator = get_accelerator("cpu")
        accelerator.seed_model_parallel_rng(1)
        spec, actor, critic = _engines(checkpoint, case, accelerator, sequence_parallel=tp > 1)
        stats = _update(case, actor, critic, batch)
        label = tuple(case.values())
        _assert_in_ranges(stats, case)
        for key, want in oracle["stats"].items():
            assert _close(stats[key], want), (label, key, stats[key], want)
        _check_gradients(case, spec, actor, critic, oracle, label)
    finally:
        ps.destroy_model_parallel()


def _worker(rank, world_size, port, checkpoint, cases, batches, oracles):
    """Every case in turn on one 2-rank world; the failures of all of them reported together."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world_size))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    failures = []
    try:
        for case, batch, oracle in zip(cases, batches, oracles):
            try:
                _run_case(checkpoint, case, batch, oracle)
            except AssertionError as error:
                failures.append(f"{case}: {error}")
    finally:
        dist.destroy_process_group()
    assert not failures, "\n".join(failures)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    out = tmp_path_factory.mktemp("tiny_pairs") / "model"
    create_tiny_qwen2_checkpoint(out, vocab_size=64, hidden_size=64, ffn_hidden_size=128, num_layers=2,
                                 num_attention_heads=4, num_query_groups=2, seed=19)
    return str(out)


def test_the_design_covers_every_pair_of_values():
    names = list(FACTORS)
    covered = set().union(*(pairs_of(case, names) for case in CASES))
    wanted = {((a, x), (b, y)) for i, a in enumerate(names) for b in names[i + 1:] for x in FACTORS[a] for y in FACTORS[b]}
    assert covered == wanted and len(CASES) == 22


def _oracle(checkpoint: str, case: dict, world) -> tuple[RolloutBatch, dict]:
    """The case at DP1 in this process: its mini-batch, its stats and gradients (the actor's also in HF names)."""
    from mindspeed_rl.checkpoint.hf_export import hf_weights_from_megatron

    batch = _rollout(checkpoint, case, world)
    spec, actor, critic = _engines(checkpoint, case, world)
    stats = _update(case, actor, critic, batch)
    _assert_in_ranges(stats, case)
    keys = STATS + (CRITIC_STATS if critic is not None else ())
    oracle = {"stats": {key: stats[key] for key in keys}, "actor_grads": _grads(actor)}
    if not case["lora"]:
        oracle["actor_hf_grads"] = hf_weights_from_megatron(oracle["actor_grads"], spec, parallel=actor.parallel)
    if critic is not None:
        oracle["critic_grads"] = _grads(critic)
    assert all(abs(stats[key]) > 0 for key in ("actor/pg_loss", "actor/grad_norm")), (case, stats)
    return batch, oracle


def test_every_case_at_its_layout_equals_dp1(world, checkpoint):
    oracles = [_oracle(checkpoint, case, world) for case in CASES]
    spawn_ranks(_worker, args=(2, free_port(), checkpoint, CASES, [b for b, _ in oracles], [o for _, o in oracles]),
                nprocs=2)
