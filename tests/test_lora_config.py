"""LoRA's keys (actor_config.lora_*, MindSpeed-RL's megatron_training spelling, rl_config.share_backbone): the demo
loads with them, MindSpeed-RL's placement of the keys is read as its actor reads them, and each inconsistent
combination is one `config error` line naming its key. In the pytest process, config only."""

import pytest

from mindspeed_rl.config import ConfigError, load_config
from tests.test_config import TINY, compose_cfg, load

LORA = "grpo_tiny_cpu_lora"


def test_the_demo_loads_with_adapters_and_a_shared_backbone():
    config = load(LORA)
    actor = config.actor_config
    assert actor.uses_lora and (actor.lora_r, actor.lora_alpha) == (16, 32)
    assert config.reference_is_backbone
    assert not load(LORA, "rl_config.share_backbone=false").reference_is_backbone
    assert not load(TINY).actor_config.uses_lora and not load(TINY).reference_is_backbone


def test_mindspeed_rls_keys_in_megatron_training_are_the_actors():
    from omegaconf import OmegaConf

    from mindspeed_rl.config import load_config

    tree = OmegaConf.to_container(compose_cfg(TINY, ["+megatron_training.lora_r=8", "+megatron_training.lora_alpha=16",
                                                     "+megatron_training.lora_target_modules=[linear_qkv,linear_fc2]",
                                                     "+megatron_training.lora_ckpt_filter=true"]))
    for key in ("lora_r", "lora_alpha", "lora_target_modules", "lora_filter"):  # as in MindSpeed-RL's recipe
        del tree["actor_config"][key]
    actor = load_config(tree).actor_config
    assert (actor.lora_r, actor.lora_alpha, actor.lora_target_modules, actor.lora_filter) == (
        8, 16, ["linear_qkv", "linear_fc2"], True)


@pytest.mark.parametrize("config_name, overrides, expected", [
    (LORA, ["actor_config.lora_target_modules=[linear_qkv,q_proj]"],
     "actor_config.lora_target_modules: unknown module(s) ['q_proj']: LoRA wraps Megatron's linear_qkv"),
    (LORA, ["actor_config.lora_r=0"], "actor_config.lora_r: must be >= 1 with lora_target_modules set"),
    (TINY, ["rl_config.share_backbone=true"], "rl_config.share_backbone: true needs LoRA"),
    (LORA, ["+megatron_training.lora_r=8"], "megatron_training.lora_r: is 8 but actor_config.lora_r is 16: one value"),
    (LORA, ["rl_config.integrated_mode_config.ref_model_load_path=/some/ref"],
     "rl_config.integrated_mode_config.ref_model_load_path: names a reference model, but with LoRA's shared"),
])
def test_an_inconsistent_lora_config_is_one_error_naming_its_key(config_name, overrides, expected):
    with pytest.raises(ConfigError) as info:
        load(config_name, *overrides)
    assert str(info.value).startswith(expected), str(info.value)


def test_ccloras_fusion_is_a_listed_knob_with_no_effect() -> None:
    """MindSpeed's CCLoRA (lora_fusion: true) overlaps the adapters' communication with their compute: the same
    adapters; their LoRA recipe sets it. Listed at start, an error with runtime.strict_keys."""
    notices: list[str] = []
    config = load_config(compose_cfg(LORA, ["actor_config.lora_fusion=true"]), notices=notices)
    assert config.actor_config.lora_fusion is False and config.actor_config.uses_lora
    assert any(notice.startswith("actor_config.lora_fusion (MindSpeed's CCLoRA") for notice in notices)
    with pytest.raises(ConfigError, match="^actor_config.lora_fusion: no effect on this engine"):
        load_config(compose_cfg(LORA, ["actor_config.lora_fusion=true", "runtime.strict_keys=true"]))
