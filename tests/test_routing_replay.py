"""Routing replay (R3) with real vLLM and real Megatron-core on a tiny Qwen3-MoE: vLLM records the experts its routers
chose (engines/vllm_routing.py), Megatron's routers replay them (engines/routing_replay.py), the mismatch ledger puts
router noise in its routing share.

Router noise is injected into vLLM's selection only: its routers pick the top-k of noisy logits and weigh the picked
experts with the clean ones (renormalised, as the checkpoint's norm_topk_prob does), so the rollout differs from the
trainer in which experts run and in nothing else.

Runs where: in the pytest process (one gloo rank); builds the checkpoint in a temp dir. ~30 s on 2 cores.
"""
import numpy as np
import pytest
import torch

from mindspeed_rl.models.checkpoint import load_hf_checkpoint
from mindspeed_rl.parallel import megatron_state
from mindspeed_rl.protocol import ROUTES_COLUMN, RolloutBatch
from cpu_vllm import cpu_vllm_engine

PROMPTS = [[3, 4, 5, 6], [7, 8, 9], [5, 5, 6, 7, 8]]
MAX_TOKENS = 8
TOPK = 2


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    from mindspeed_rl.data.tiny_moe import create_tiny_qwen3_moe_checkpoint

    return str(create_tiny_qwen3_moe_checkpoint(tmp_path_factory.mktemp("moe") / "model", vocab_size=16, seed=1,
                                                num_experts=8, moe_topk=TOPK))


@pytest.fixture(scope="module")
def rollout(world, checkpoint):
    from vllm.distributed.parallel_state import destroy_model_parallel

    # vLLM's groups of this pytest process were made by an earlier module's dense engine, without the expert-parallel
    # group an MoE layer asks for; made again for this one (a rank builds one engine: a test-process concern only).
    destroy_model_parallel()
    return cpu_vllm_engine(checkpoint, return_routed_experts=True)


def _actor(world, checkpoint, *, recompute: bool = False):
    from mindspeed_rl.engines.megatron_engine import MegatronEngine, OptimizerSettings
    from mindspeed_rl.models.qwen2 import ModelOptions

    spec, state = load_hf_checkpoint(checkpoint)
    options = ModelOptions(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1) \
        if recompute else ModelOptions()
    engine = MegatronEngine(spec=spec, hf_state=state, params_dtype=torch.float32, accelerator=world,
                            parallel=megatron_state.current(), options=options, routing_replay=True,
                            optimizer=OptimizerSettings(lr=1e-2, min_lr=0.0, weight_decay=0.0, adam_beta1=0.9,
                                                        adam_beta2=0.95, adam_eps=1e-8, clip_grad=1.0))
    return engine


@pytest.fixture(scope="module")
def actor(world, checkpoint):
    return _actor(world, checkpoint)


def _noisy_selection(engine, scale: float, seed: int = 0):
    """Every vLLM router picks the top-k of its logits plus Gaussian noise and weighs them with the clean softmax."""
    from vllm.model_executor.layers.fused_moe.layer import MoERunner

    generator = torch.Generator().manual_seed(seed)
    for runner in (m for m in engine.model.modules() if isinstance(m, MoERunner)):
        def compute_routing(hidden_states, router_logits, indices_type=None, *, input_ids=None):
            noisy = router_logits + scale * torch.randn(router_logits.shape, generator=generator)
            ids = noisy.topk(TOPK, dim=-1).indices
            weights = torch.softmax(router_logits.float(), dim=-1).gather(1, ids)
            return weights / weights.sum(-1, keepdim=True), ids.to(indices_type or torch.int32)
        runner.router._compute_routing = compute_routing


def _clean_selection(engine):
    from vllm.model_executor.layers.fused_moe.layer import MoERunner

    for runner in (m for m in engine.model.modules() if isinstance(m, MoERunner)):
        runner.router.__dict__.pop("_compute_routing", None)


def _batch(generations) -> RolloutBatch:
    from mindspeed_rl.trainer.rollout import routes_column

    batch = RolloutBatch.from_token_lists([PROMPTS[g.prompt_index] for g in generations],
                                          [g.token_ids for g in generations], pad_id=0, response_width=MAX_TOKENS)
    logprobs = torch.zeros(batch.response_logprobs_shape)
    for row, g in enumerate(generations):
        logprobs[row, : len(g.logprobs)] = torch.tensor(g.logprobs)
    batch.columns["rollout_logprobs"] = logprobs
    batch.columns[ROUTES_COLUMN] = routes_column([g.routed_experts for g in generations], batch.input_ids.shape[1])
    return batch


def _generate(rollout, *, noise: float = 0.0):
    if noise:
        _noisy_selection(rollout, noise)
    try:
        return rollout.generate(PROMPTS, n=4, max_tokens=MAX_TOKENS, temperature=1.0, top_p=1.0, top_k=-1, min_p=0.0,
                                seed=None)
    finally:
        _clean_selection(rollout)


def _gap(a, b, mask) -> float:
    return ((a - b).abs() * mask).max().item()


def test_vllm_records_the_experts_hf_routes_to(rollout, checkpoint):
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).eval()
    for generation in _generate(rollout):
        ids = PROMPTS[generation.prompt_index] + generation.token_ids
        assert generation.routed_experts.shape == (len(ids) - 1, 2, TOPK)  # the last token never ran a forward
        with torch.no_grad():
            router_logits = hf(torch.tensor([ids]), output_router_logits=True).router_logits
        for layer, logits in enumerate(router_logits):
            expected = logits.topk(TOPK, dim=-1).indices.sort(-1).values[: len(ids) - 1]
            recorded = torch.from_numpy(generation.routed_experts[:, layer].astype(np.int64)).sort(-1).values
            assert torch.equal(recorded, expected), layer


def test_replay_gives_megatron_the_rollouts_experts(rollout, actor):
    """Under router noise the trainer's own routing is another policy; replayed, it is the rollout's."""
    batch = _batch(_generate(rollout, noise=0.5))
    mask, sampled = batch.response_mask, batch.columns["rollout_logprobs"]
    with actor.routing_replay.forced(False):
        own = actor.compute_logprobs(batch, micro_batch_size=4, temperature=1.0)
    measured = actor.routing_metrics()
    replayed = actor.compute_logprobs(batch, micro_batch_size=4, temperature=1.0)
    forced = actor.routing_metrics()
    assert measured["mismatch/router_disagreement"] > 0.05 and measured["mismatch/routing_flips"] > 0.05
    assert forced["mismatch/routing_flips"] == 0.0
    assert forced["mismatch/router_disagreement"] > 0.05  # measured on the replayed forward's own hidden states
    assert _gap(own, sampled, mask) > 1e-2
    assert _gap(replayed, sampled, mask) < 1e-4


def test_the_ledger_puts_router_noise_in_routing(rollout, actor):
    from mindspeed_rl.algorithms.mismatch import mismatch_ledger

    batch = _batch(_generate(rollout, noise=0.5))
    with actor.routing_replay.forced(False):
        own = actor.compute_logprobs(batch, micro_batch_size=4, temperature=1.0)
    replayed = actor.compute_logprobs(batch, micro_batch_size=4, temperature=1.0)
    actor.routing_metrics()
    ledger = mismatch_ledger(batch.columns["rollout_logprobs"], own, batch.loss_mask(), replayed=replayed)
    assert ledger["mismatch/routing"] >= 0.95 * ledger["mismatch/total"] > 0


def test_without_noise_replay_changes_nothing(rollout, actor):
    batch = _batch(_generate(rollout))
    replayed = actor.compute_logprobs(batch, micro_batch_size=4, temperature=1.0)
    with actor.routing_replay.forced(False):
        own = actor.compute_logprobs(batch, micro_batch_size=4, temperature=1.0)
    assert actor.routing_metrics()["mismatch/router_disagreement"] == 0.0
    assert torch.equal(replayed, own)


def test_the_update_and_its_recompute_replay_the_same_routes(world, rollout, checkpoint):
    """One optimizer step with Megatron's full recompute equals the step without: the backward's recompute of each
    checkpointed layer replays the routes its forward did (its own routing would give other gradients)."""
    batch = _batch(_generate(rollout, noise=0.5))

    def loss_fn(logprobs, entropy, mb):
        loss = -(logprobs * mb.response_mask).sum() / batch.response_mask.sum()
        return loss, {"loss": loss.item(), "gap": _gap(logprobs.detach().cpu(), mb.extras["rollout_logprobs"].cpu(),
                                                      mb.response_mask.cpu())}

    steps = {}
    for recompute in (False, True):
        engine = _actor(world, checkpoint, recompute=recompute)
        stats = engine.train_step(batch, micro_batch_size=4, temperature=1.0, loss_fn=loss_fn)
        steps[recompute] = (stats, {n: p.detach().clone() for n, p in engine.module.named_parameters()})
        assert stats["gap"] < 1e-4  # the update's forward ran the rollout's experts
        assert engine.routing_metrics()["mismatch/routing_flips"] == 0.0
    (plain, plain_params), (recomputed, recomputed_params) = steps[False], steps[True]
    assert recomputed["actor/grad_norm"] == pytest.approx(plain["actor/grad_norm"], rel=1e-5)
    for name, param in plain_params.items():
        assert torch.allclose(recomputed_params[name], param, atol=1e-6), name
