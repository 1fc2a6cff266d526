"""MoE router load balancing (model.<name>.moe_router_load_balancing_type, moe_aux_loss_coeff): Megatron's
auxiliary loss enters the update's gradient with its coefficient, and nothing else changes. In-process, a
one-rank gloo world."""

import pytest
import torch

from mindspeed_rl.parallel import megatron_state
from mindspeed_rl.protocol import RolloutBatch

SETTINGS = {"none": ("none", 0.0), "aux_0.1": ("aux_loss", 0.1), "aux_0.2": ("aux_loss", 0.2),
            "seq_aux_0.1": ("seq_aux_loss", 0.1)}


@pytest.fixture(scope="module")
def updates(world, tmp_path_factory):
    """Each setting's update of the same weights on the same batch: (metrics, gradients)."""
    from mindspeed_rl.algorithms.grpo import GRPOLossConfig
    from mindspeed_rl.data.tiny_moe import create_tiny_qwen3_moe_checkpoint
    from mindspeed_rl.engines.megatron_engine import MegatronEngine, OptimizerSettings
    from mindspeed_rl.models.checkpoint import load_hf_checkpoint
    from mindspeed_rl.models.qwen2 import ModelOptions
    from mindspeed_rl.workers.actor_steps import train_on_mini_batch

    path = str(tmp_path_factory.mktemp("moe_aux") / "model")
    create_tiny_qwen3_moe_checkpoint(path, seed=4)
    spec, state = load_hf_checkpoint(path)
    settings = OptimizerSettings(lr=1e-3, min_lr=0.0, weight_decay=0.0, adam_beta1=0.9, adam_beta2=0.95,
                                 adam_eps=1e-8, clip_grad=0.0)
    loss = GRPOLossConfig(clip_ratio=0.2, kl_penalty="low_var_kl", kl_coef=0.05, entropy_coeff=0.0)
    results = {}
    for name, (kind, coeff) in SETTINGS.items():
        engine = MegatronEngine(spec=spec, hf_state=state, params_dtype=torch.float32, accelerator=world,
                                parallel=megatron_state.current(),
                                optimizer=settings,
                                options=ModelOptions(moe_router_load_balancing_type=kind, moe_aux_loss_coeff=coeff))
        metrics = train_on_mini_batch(engine, _batch(), loss, micro_batch_size=4, temperature=1.0)
        results[name] = (metrics, {n: p.main_grad.clone() for n, p in engine.module.named_parameters()})
        del engine
    return results


def _batch() -> RolloutBatch:
    g = torch.Generator().manual_seed(2)
    prompts = [torch.randint(1, 64, (10,), generator=g).tolist() for _ in range(8)]
    responses = [torch.randint(1, 64, (12,), generator=g).tolist() for _ in range(8)]
    batch = RolloutBatch.from_token_lists(prompts, responses, pad_id=0, response_width=12)
    mask = batch.response_mask
    for column in ("old_logprobs", "ref_logprobs"):
        batch.columns[column] = (-4.0 + 0.3 * torch.randn(mask.shape, generator=g)) * mask
    batch.columns["advantages"] = torch.randn(len(batch), 1, generator=g).expand_as(mask) * mask
    return batch


@pytest.mark.parametrize("name", ["aux_0.1", "seq_aux_0.1"])
def test_the_policy_loss_is_unchanged(updates, name):
    for key in ("actor/pg_loss", "actor/kl_loss", "actor/entropy"):
        assert updates[name][0][key] == updates["none"][0][key], key


def test_the_aux_loss_gradient_reaches_the_router_and_scales_with_its_coefficient(updates):
    """The routing (top-k) does not depend on the coefficient, so the added gradient is linear in it."""
    none, one, two = (updates[name][1] for name in ("none", "aux_0.1", "aux_0.2"))
    router = [name for name in none if "router" in name]
    assert router and all((one[name] - none[name]).abs().max() > 1e-6 for name in router)
    for name in none:
        torch.testing.assert_close(two[name] - none[name], 2 * (one[name] - none[name]), rtol=1e-3, atol=1e-7)


def test_the_model_block_keys_reach_the_engine_options():
    from mindspeed_rl.accelerator import get_accelerator
    from mindspeed_rl.workers.engine_builders import model_options
    from tests.test_config import TINY, load

    config = load(TINY, "+model.tiny_qwen2.moe_router_load_balancing_type=aux_loss",
                  "+model.tiny_qwen2.moe_aux_loss_coeff=0.001")
    options = model_options(config, get_accelerator("cpu"), announce=False)
    assert (options.moe_router_load_balancing_type, options.moe_aux_loss_coeff) == ("aux_loss", 0.001)
