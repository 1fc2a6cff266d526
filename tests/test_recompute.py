"""Megatron's activation recompute (actor_config.recompute_*): the update computes the same loss and gradients
with fewer activation bytes (the ledger's meter). In-process, a one-rank gloo world."""

import re

import pytest
import torch

from mindspeed_rl.memory.ledger import ActivationMeter
from mindspeed_rl.parallel import megatron_state
from mindspeed_rl.protocol import RolloutBatch

RECOMPUTE = {
    "none": {},
    "full_uniform_1": dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1),
    "full_block_4": dict(recompute_granularity="full", recompute_method="block", recompute_num_layers=4),
    "selective": dict(recompute_granularity="selective"),
}


@pytest.fixture(scope="module")
def updates(world, tmp_path_factory):
    """Each recompute setting's update of the same weights on the same batch: (metrics, grads, activation bytes)."""
    from mindspeed_rl.algorithms.grpo import GRPOLossConfig
    from mindspeed_rl.data.tiny_model import create_tiny_qwen2_checkpoint
    from mindspeed_rl.engines.megatron_engine import MegatronEngine, OptimizerSettings
    from mindspeed_rl.models.checkpoint import load_hf_checkpoint
    from mindspeed_rl.models.qwen2 import ModelOptions
    from mindspeed_rl.workers.actor_steps import train_on_mini_batch

    path = str(tmp_path_factory.mktemp("recompute") / "model")
    create_tiny_qwen2_checkpoint(path, vocab_size=64, hidden_size=64, ffn_hidden_size=128, num_layers=4,
                                 num_attention_heads=4, num_query_groups=2, seed=5)
    spec, state = load_hf_checkpoint(path)
    settings = OptimizerSettings(lr=1e-3, min_lr=0.0, weight_decay=0.0, adam_beta1=0.9, adam_beta2=0.95,
                                 adam_eps=1e-8, clip_grad=1.0)
    loss = GRPOLossConfig(clip_ratio=0.2, kl_penalty="low_var_kl", kl_coef=0.05, entropy_coeff=0.01)
    results = {}
    for name, fields in RECOMPUTE.items():
        engine = MegatronEngine(spec=spec, hf_state=state, params_dtype=torch.float32, accelerator=world,
                                parallel=megatron_state.current(),
                                optimizer=settings, options=ModelOptions(**fields))
        with ActivationMeter({p.untyped_storage()._cdata for p in engine.module.parameters()}) as meter:
            metrics = train_on_mini_batch(engine, _batch(), loss, micro_batch_size=8, temperature=1.0)
        grads = {n: p.main_grad.clone() for n, p in engine.module.named_parameters()}
        results[name] = (metrics, grads, meter.peak_bytes)
        del engine
    return results


def _batch() -> RolloutBatch:
    g = torch.Generator().manual_seed(11)
    prompts = [torch.randint(1, 64, (12,), generator=g).tolist() for _ in range(8)]
    responses = [torch.randint(1, 64, (20,), generator=g).tolist() for _ in range(8)]
    batch = RolloutBatch.from_token_lists(prompts, responses, pad_id=0, response_width=20)
    mask = batch.response_mask
    for column, scale in (("old_logprobs", 0.5), ("ref_logprobs", 0.3)):
        batch.columns[column] = (-4.0 + scale * torch.randn(mask.shape, generator=g)) * mask
    batch.columns["advantages"] = torch.randn(len(batch), 1, generator=g).expand_as(mask) * mask
    return batch


@pytest.mark.parametrize("name", [name for name in RECOMPUTE if name != "none"])
def test_recompute_keeps_the_loss_and_the_gradients(updates, name):
    want_metrics, want_grads, _ = updates["none"]
    metrics, grads, _ = updates[name]
    for key in ("actor/pg_loss", "actor/kl_loss", "actor/entropy", "actor/grad_norm"):
        assert metrics[key] == want_metrics[key], key  # the same operations in the same order: bit-equal
    for param_name, grad in grads.items():
        assert torch.equal(grad, want_grads[param_name]), param_name


def test_full_recompute_keeps_fewer_activation_bytes(updates):
    none, uniform, block, selective = (updates[name][2] for name in RECOMPUTE)
    assert uniform < 0.6 * none, (uniform, none)
    assert block < 0.6 * none, (block, none)
    assert selective < none, (selective, none)


# -- the config keys ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("overrides, expected", [
    (["recompute_granularity=full", "recompute_num_layers=1"], "actor_config.recompute_method: must be one of uniform, block"),
    (["recompute_granularity=full", "recompute_method=block"], "actor_config.recompute_num_layers: must be >= 1"),
    (["recompute_granularity=selective", "recompute_method=block"], "actor_config.recompute_method: must be null"),
    (["recompute_method=block"], "actor_config.recompute_method: is read only with recompute_granularity full"),
    (["recompute_granularity=full", "recompute_method=uniform", "recompute_num_layers=3"],
     "actor_config.recompute_num_layers: must divide the 2 layers of each pipeline stage"),
])
def test_recompute_keys_follow_megatrons_rules(overrides, expected):
    from mindspeed_rl.config import ConfigError
    from tests.test_config import TINY, load

    with pytest.raises(ConfigError, match=f"^{expected}"):
        load(TINY, *(f"++actor_config.{override}" for override in overrides))


def test_recompute_keys_reach_the_model_options():
    from mindspeed_rl.workers.engine_builders import model_options
    from tests.test_config import TINY, load

    config = load(TINY, "++actor_config.recompute_granularity=full", "++actor_config.recompute_method=block",
                  "++actor_config.recompute_num_layers=1")
    from mindspeed_rl.accelerator import get_accelerator

    options = model_options(config, get_accelerator("cpu"), announce=False)
    assert (options.recompute_granularity, options.recompute_method, options.recompute_num_layers) == ("full", "block", 1)


@pytest.mark.parametrize("value, expected", [
    ("1,1", None),
    ("2", "actor_config.num_layer_list: must list 2 stages"),
    ("2,0", "actor_config.num_layer_list: must list 2 stages (pipeline_model_parallel_size) of at least one layer"),
    ("a,b", "actor_config.num_layer_list: must be comma-separated layer counts"),
])
def test_num_layer_list_lists_every_stage_or_is_an_error(value, expected):
    from mindspeed_rl.config import ConfigError
    from tests.test_config import TINY, load

    overrides = ("actor_config.pipeline_model_parallel_size=2", "rl_config.actor_resource.num_npus=2",
                 f"++actor_config.num_layer_list='{value}'")
    if expected is None:
        assert load(TINY, *overrides).actor_config.num_layer_list == value
        return
    with pytest.raises(ConfigError, match=f"^{re.escape(expected)}"):
        load(TINY, *overrides)
