"""The mismatch ledger (algorithms/mismatch.py): its buckets add up to its total, and each cause injected alone — a
stale version, a dtype difference, one perturbed pushed tensor — lands >= 95% in its own bucket.

The injection tests measure every link of the chain (they re-score even where the engine would take a link as 0 by
definition), so a cause leaking into another bucket would show: real vLLM (fp32, in-process, the 1-rank world) samples
and re-scores; the trainer's log-probs come from transformers' Qwen2 on the same weights (fp32 or bf16). The weights
are rounded to bf16 once so that "the same weights" hold exactly in either dtype.
Runs where: in the pytest process, a 1-rank gloo world (shared with the other single-rank tests).
"""
import pytest
import torch

from mindspeed_rl.algorithms.mismatch import CAUSES, ledger_from_gap, mismatch_ledger
from mindspeed_rl.data.tiny_model import create_tiny_qwen2_checkpoint
from mindspeed_rl.models.checkpoint import load_hf_checkpoint
from mindspeed_rl.resharding.fingerprint import range_fingerprint
from mindspeed_rl.resharding.naive import load_full_hf
from cpu_vllm import cpu_vllm_engine

PROMPTS = [[5, 9, 6, 11], [7, 9, 8, 11], [3, 4, 5, 6]]
MAX_TOKENS = 12


def _buckets(metrics):
    return {cause: metrics[f"mismatch/{cause}"] for cause in CAUSES}


# -- the decomposition itself ---------------------------------------------------------------------------------
def test_the_buckets_sum_to_the_total():
    generator = torch.Generator().manual_seed(0)
    shape = (4, 7)
    roll, now, exact, old = (torch.randn(shape, generator=generator) for _ in range(4))
    mask = (torch.rand(shape, generator=generator) > 0.3).float()
    for kwargs in ({}, {"stale": True, "rescored": now}, {"stale": True, "rescored": now, "exact": exact,
                                                         "weights_exact": False},
                   {"exact": exact, "weights_exact": False}, {"weights_exact": False}):
        metrics = mismatch_ledger(roll, old, mask, **kwargs)
        assert metrics["mismatch/total"] == pytest.approx(sum(_buckets(metrics).values()), rel=1e-12)
        # the path is never shorter than the end-to-end gap (triangle inequality)
        end_to_end = ((old.double() - roll.double()).abs() * mask).sum().item() / mask.sum().item()
        assert metrics["mismatch/total"] >= end_to_end - 1e-9
    gap = ledger_from_gap(0.25, weights_exact=True)
    assert gap["mismatch/total"] == sum(_buckets(gap).values()) == gap["mismatch/numerics"] == 0.25


def test_on_policy_exact_push_puts_the_gap_in_numerics_and_a_stale_rollout_needs_its_rescore():
    roll, old, mask = torch.zeros(2, 3), torch.full((2, 3), 0.5), torch.ones(2, 3)
    assert _buckets(mismatch_ledger(roll, old, mask)) == {"staleness": 0.0, "push": 0.0, "numerics": 0.5,
                                                          "routing": 0.0}
    assert mismatch_ledger(roll, old, mask, weights_exact=False)["mismatch/push"] == 0.5
    with pytest.raises(ValueError, match="re-score"):
        mismatch_ledger(roll, old, mask, stale=True)


# -- each cause injected alone, measured with real engines -----------------------------------------------------
@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    out = tmp_path_factory.mktemp("tiny_mismatch") / "model"
    create_tiny_qwen2_checkpoint(out, vocab_size=64, hidden_size=128, ffn_hidden_size=256, num_layers=2,
                                 num_attention_heads=4, num_query_groups=2, seed=31, init_std=0.2)
    spec, state = load_hf_checkpoint(str(out))
    return str(out), spec, {name: t.to(torch.bfloat16).to(torch.float32) for name, t in state.items()}


@pytest.fixture(scope="module")
def rollout(world, checkpoint):
    return cpu_vllm_engine(checkpoint[0], max_model_len=64, max_num_seqs=16, cpu_kvcache_space_gb=0.03125,
                           loaded=False)  # each test pushes its own weights


def _push(engine, spec, state) -> dict[str, torch.Tensor]:
    load_full_hf(engine.named_weights(), state, spec, tp=1, tp_rank=0)
    engine.mark_weights_loaded()
    return {name: t.clone() for name, t in engine.named_weights().items()}


def _fingerprints_agree(engine, pushed: dict[str, torch.Tensor]) -> bool:
    """The resharding check's verdict, whole tensors: what landed vs what the trainer's weights give."""
    return all(torch.equal(range_fingerprint(live, 0, 0, live.shape[0], live.dtype),
                           range_fingerprint(pushed[name], 0, 0, live.shape[0], live.dtype))
               for name, live in engine.named_weights().items())


def _sample(engine):
    generations = engine.generate(PROMPTS, n=2, max_tokens=MAX_TOKENS, temperature=1.0, top_p=1.0, top_k=-1,
                                  min_p=0.0, seed=5)
    prompts = [PROMPTS[g.prompt_index] for g in generations]
    return prompts, [g.token_ids for g in generations], _padded([g.logprobs for g in generations])


def _padded(rows):
    out, mask = torch.zeros(len(rows), MAX_TOKENS), torch.zeros(len(rows), MAX_TOKENS)
    for i, row in enumerate(rows):
        out[i, :len(row)], mask[i, :len(row)] = torch.tensor(row), 1.0
    return out, mask


def _trainer_logprobs(checkpoint, state, dtype, prompts, responses):
    """The trainer's old log-probs: transformers' Qwen2 on `state` in `dtype`, log-softmax in fp32."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32, attn_implementation="eager")
    model.load_state_dict(state, strict=True)
    model = model.to(dtype).eval()
    rows = []
    with torch.no_grad():
        for prompt, response in zip(prompts, responses):
            ids = torch.tensor([prompt + response])
            logp = model(ids).logits[0].float().log_softmax(-1)
            positions = torch.arange(len(prompt) - 1, len(prompt) + len(response) - 1)
            rows.append(logp[positions, torch.tensor(response)].tolist())
    return _padded(rows)[0]


def _measure(engine, spec, checkpoint_dir, *, sampled_state, pushed_state, trainer_state, trainer_dtype):
    """Every link of the chain measured: sample under `sampled_state`, push `pushed_state` (what landed in vLLM),
    re-score; re-score under the trainer's exact weights; the trainer's log-probs under `trainer_state`."""
    _push(engine, spec, sampled_state)
    prompts, responses, (roll, mask) = _sample(engine)
    _push(engine, spec, pushed_state)
    now = _padded(engine.score(prompts, responses))[0]
    exact_weights = _push(engine, spec, trainer_state)
    exact = _padded(engine.score(prompts, responses))[0]
    _push(engine, spec, pushed_state)
    agree = _fingerprints_agree(engine, exact_weights)
    old = _trainer_logprobs(checkpoint_dir, trainer_state, trainer_dtype, prompts, responses)
    metrics = mismatch_ledger(roll, old, mask, rescored=now, exact=exact, stale=True, weights_exact=agree)
    return metrics, agree


def _share(metrics, cause):
    return metrics[f"mismatch/{cause}"] / metrics["mismatch/total"]


def test_a_stale_version_lands_in_staleness(rollout, checkpoint):
    directory, spec, state = checkpoint
    generator = torch.Generator().manual_seed(1)
    older = {name: t + 0.01 * torch.randn(t.shape, generator=generator) for name, t in state.items()}
    metrics, agree = _measure(rollout, spec, directory, sampled_state=older, pushed_state=state, trainer_state=state,
                              trainer_dtype=torch.float32)
    assert agree
    assert metrics["mismatch/total"] > 1e-2
    assert _share(metrics, "staleness") >= 0.95, metrics


def test_the_same_weights_in_another_dtype_land_in_numerics(rollout, checkpoint):
    directory, spec, state = checkpoint
    metrics, agree = _measure(rollout, spec, directory, sampled_state=state, pushed_state=state, trainer_state=state,
                              trainer_dtype=torch.bfloat16)
    assert agree
    assert metrics["mismatch/total"] > 1e-3
    assert _share(metrics, "numerics") >= 0.95, metrics


def test_one_perturbed_pushed_tensor_lands_in_push(rollout, checkpoint):
    directory, spec, state = checkpoint
    corrupted = dict(state)
    name = "model.layers.0.mlp.down_proj.weight"
    corrupted[name] = state[name] + 0.05 * torch.randn(state[name].shape, generator=torch.Generator().manual_seed(2))
    # vLLM sampled with, and holds, what the push landed: on-policy for vLLM, off the trainer's weights
    metrics, agree = _measure(rollout, spec, directory, sampled_state=corrupted, pushed_state=corrupted,
                              trainer_state=state, trainer_dtype=torch.float32)
    assert not agree
    assert metrics["mismatch/total"] > 1e-3
    assert _share(metrics, "push") >= 0.95, metrics


# -- the switch, the records, the summary ----------------------------------------------------------------------
def _load(*overrides):
    from test_config import load

    return load(*overrides)


def test_the_ledger_is_off_by_default_and_refused_where_it_cannot_split():
    from test_config import config_error

    assert _load("grpo_tiny_cpu").rl_config.mismatch_ledger is False
    assert _load("grpo_tiny_cpu", "rl_config.mismatch_ledger=true").rl_config.mismatch_ledger is True
    assert "check_weights_after_switch" in config_error("grpo_tiny_cpu", "rl_config.mismatch_ledger=true",
                                                        "generate_config.check_weights_after_switch=false")


class _Batch:
    def __init__(self, columns, mask):
        self.columns, self._mask = columns, mask

    def loss_mask(self):
        return self._mask


def test_records_carry_the_ledger_from_either_old_logprob_source():
    from mindspeed_rl.trainer.metrics import ledger_metrics

    mask = torch.tensor([[1.0, 1.0, 0.0]])
    roll, old = torch.tensor([[-1.0, -2.0, -9.0]]), torch.tensor([[-1.5, -2.5, 0.0]])
    separate = ledger_metrics(_Batch({"rollout_logprobs": roll, "old_logprobs": old}, mask), {}, policy_version=0)
    from_update = ledger_metrics(_Batch({"rollout_logprobs": roll}, mask), {"rollout/logprob_mean_abs_diff": 0.5},
                                 policy_version=0)
    assert separate == from_update
    assert separate["mismatch/numerics"] == separate["mismatch/total"] == 0.5
    assert separate["mismatch/staleness"] == separate["mismatch/push"] == separate["mismatch/routing"] == 0.0


def test_a_partial_rollouts_older_tokens_alone_are_stale_and_split_by_age():
    # Four sampled tokens of ages 0, 1, 2, 2 (versions 5, 4, 3, 3 under the policy of version 5); the re-score differs
    # from the rollout's log-prob on every token, the age-0 one included (another batch shape): that one is numerics.
    mask = torch.tensor([[1.0, 1.0, 1.0, 1.0, 0.0]])
    roll = torch.tensor([[-1.0, -1.0, -1.0, -1.0, -9.0]])
    rescored = torch.tensor([[-1.1, -1.5, -2.0, -3.0, 0.0]])
    old = torch.tensor([[-1.2, -1.5, -2.0, -3.0, 0.0]])
    ages = torch.tensor([[0, 1, 2, 2, 0]])
    metrics = mismatch_ledger(roll, old, mask, rescored=rescored, stale=True, ages=ages)
    assert metrics["mismatch/staleness"] == pytest.approx((0.5 + 1.0 + 2.0) / 4)
    assert metrics["mismatch/staleness_age1"] == pytest.approx(0.5 / 4)
    assert metrics["mismatch/staleness_age2"] == pytest.approx(3.0 / 4)
    assert metrics["mismatch/numerics"] == pytest.approx(0.2 / 4)  # the age-0 token against its own sampling
    assert metrics["mismatch/total"] == pytest.approx(metrics["mismatch/staleness"] + metrics["mismatch/numerics"])


def test_the_summary_gives_the_runs_mean_per_cause():
    from pathlib import Path

    from mindspeed_rl.trainer.summary import summary_lines

    history = [{"iteration": i, "timing/all": 1.0, "mismatch/staleness": 0.0, "mismatch/push": 0.0,
                "mismatch/numerics": 0.01 * i, "mismatch/routing": 0.0, "mismatch/total": 0.01 * i} for i in (1, 3)]
    line = next(line for line in summary_lines(history, run_dir=Path("/run"), artefacts=[]) if "mismatch" in line)
    assert "numerics=2.00e-02" in line and "total=2.00e-02" in line and "staleness=0.00e+00" in line
    assert not any("mismatch" in line for line in summary_lines([{"iteration": 1, "timing/all": 1.0}],
                                                                run_dir=Path("/run"), artefacts=[]))


def test_the_training_curves_draw_every_cause(tmp_path):
    from mindspeed_rl.trainer.curves import plot_training_curves

    records = [{"iteration": i, "reward/mean": 0.1, **{f"mismatch/{cause}": 0.0 for cause in CAUSES},
                "mismatch/total": 1e-6 * i} for i in range(1, 4)]
    drawn = plot_training_curves(records, tmp_path / "curves.png")
    assert {f"mismatch/{cause}" for cause in (*CAUSES, "total")} <= set(drawn)


def test_the_replayed_forward_splits_routing_from_numerics():
    """L_roll -> L_rep (Megatron on vLLM's routes) -> L_old (its own routes): numerics and routing, summing up."""
    mask = torch.tensor([[1.0, 1.0, 0.0]])
    rollout, replayed, old = (torch.tensor([[-1.0, -2.0, 5.0]]), torch.tensor([[-1.1, -2.0, 0.0]]),
                              torch.tensor([[-1.1, -2.4, 9.0]]))
    ledger = mismatch_ledger(rollout, old, mask, replayed=replayed)
    assert ledger["mismatch/numerics"] == pytest.approx(0.05) and ledger["mismatch/routing"] == pytest.approx(0.2)
    assert ledger["mismatch/total"] == pytest.approx(0.25)


def test_routing_replay_is_refused_where_routes_are_not_recorded():
    from test_config import config_error

    assert _load("grpo_tiny_cpu").rl_config.routing_replay is False
    assert "prefix cache" in config_error("grpo_tiny_cpu", "rl_config.routing_replay=true",
                                          "generate_config.enable_prefix_caching=true")


def test_the_rescore_gives_the_log_probs_sampling_gave_at_any_temperature(rollout, checkpoint):
    """`VLLMEngine.score` at the sampling temperature equals what `generate` returned for the same tokens."""
    _, spec, state = checkpoint
    _push(rollout, spec, state)
    for temperature in (1.0, 0.7):
        generations = rollout.generate(PROMPTS, n=2, max_tokens=MAX_TOKENS, temperature=temperature, top_p=1.0,
                                       top_k=-1, min_p=0.0, seed=5)
        rescored = rollout.score([PROMPTS[g.prompt_index] for g in generations], [g.token_ids for g in generations],
                                 temperature=temperature)
        for generation, values in zip(generations, rescored):
            assert torch.allclose(torch.tensor(values), torch.tensor(generation.logprobs), atol=1e-5), temperature
