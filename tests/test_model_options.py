"""Model knobs of the config reach the built Megatron model: dropout, softmax precision, and the
fused kernels as resolved for the device (plain torch paths on CPU, with one line naming the
requested kernels that cannot run here).

Runs where: in the pytest process, a 1-rank gloo world (shared with the other single-rank tests).
"""
import pytest
import torch

from mindspeed_rl.accelerator.kernels import KernelRequest, resolve_kernels
from mindspeed_rl.data.tiny_model import create_tiny_qwen2_checkpoint
from mindspeed_rl.engines.megatron_engine import MegatronEngine
from mindspeed_rl.models.checkpoint import load_hf_checkpoint
from mindspeed_rl.models.qwen2 import ModelOptions, transformer_config
from mindspeed_rl.parallel import megatron_state

ALL_KERNELS = KernelRequest(fused_rmsnorm=True, flash_attn=True, masked_softmax_fusion=True,
                            gradient_accumulation_fusion=True, fused_swiglu=True, fused_rotary_pos_emb=True)
FUSION_FIELDS = ("bias_activation_fusion", "masked_softmax_fusion", "apply_rope_fusion", "gradient_accumulation_fusion")


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    out = tmp_path_factory.mktemp("tiny_options") / "model"
    create_tiny_qwen2_checkpoint(out, vocab_size=64, hidden_size=64, ffn_hidden_size=128, num_layers=1,
                                 num_attention_heads=4, num_query_groups=2, seed=19)
    return str(out)


def test_dropout_and_softmax_precision_reach_the_built_model(world, checkpoint):
    spec, state = load_hf_checkpoint(checkpoint)
    options = ModelOptions(attention_dropout=0.1, hidden_dropout=0.2, attention_softmax_in_fp32=False)
    engine = MegatronEngine(spec=spec, hf_state=state, params_dtype=torch.float32, accelerator=world,
                            parallel=megatron_state.current(), optimizer=None,
                            options=options)
    config = engine.module.config
    assert (config.attention_dropout, config.hidden_dropout, config.attention_softmax_in_fp32) == (0.1, 0.2, False)
    attention = engine.module.decoder.layers[0].self_attention.core_attention
    assert attention.attention_dropout.p == 0.1, "the attention module built its dropout from the config"


def test_every_kernel_resolves_to_the_plain_path_on_cpu():
    resolution = resolve_kernels(ALL_KERNELS, "cpu")
    assert resolution.transformer_fields == {name: False for name in FUSION_FIELDS}
    assert resolution.unavailable == ("use_fused_rmsnorm=true", "use_flash_attn=true", "no_masked_softmax_fusion=false",
                                      "no_gradient_accumulation_fusion=false", "use_fused_swiglu=true",
                                      "use_fused_rotary_pos_emb=true")
    message = resolution.message("cpu")
    assert "\n" not in message and all(key in message for key in resolution.unavailable)


def test_nothing_requested_prints_nothing():
    resolution = resolve_kernels(KernelRequest(), "cpu")
    assert resolution.unavailable == () and resolution.message("cpu") is None


def test_cuda_turns_on_what_it_can_run_and_names_the_rest():
    """Megatron's bias-SwiGLU needs only torch on CUDA; the apex/TE kernels need modules absent here."""
    resolution = resolve_kernels(ALL_KERNELS, "cuda")
    assert resolution.transformer_fields["bias_activation_fusion"] is True
    assert "use_fused_swiglu=true" not in resolution.unavailable
    assert "no_masked_softmax_fusion=false" in resolution.unavailable  # scaled_*_softmax_cuda is not installed


def test_sequence_parallel_without_tensor_parallelism_is_refused(checkpoint):
    spec, _ = load_hf_checkpoint(checkpoint)
    with pytest.raises(ValueError, match="sequence_parallel needs tensor parallelism"):
        transformer_config(spec, params_dtype=torch.float32, tp=1, pp=1, options=ModelOptions(sequence_parallel=True))
