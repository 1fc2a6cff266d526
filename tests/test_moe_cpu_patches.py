"""The Megatron-on-CPU patches MoE needs (P5, P6 in accelerator/megatron_cpu.py) do what their reasons say.

Runs where: in the pytest process, no process group needed.
"""
from types import SimpleNamespace

import torch

from mindspeed_rl.accelerator.megatron_cpu import (SequenceParallelRMSNorm, megatron_on_cpu,
                                                   patch_moe_without_transformer_engine, with_sequence_parallel_norms)


def test_router_gemm_sees_no_transformer_engine():
    from megatron.core.transformer.moe import moe_utils

    patch_moe_without_transformer_engine()
    assert moe_utils.te_general_gemm is None or moe_utils.HAVE_TE  # None: the router's torch path runs
    with megatron_on_cpu():  # entering the scope applies it too
        assert hasattr(moe_utils, "te_general_gemm")


def test_sequence_parallel_norm_marks_its_weight_for_the_tp_all_reduce():
    norm = SequenceParallelRMSNorm(SimpleNamespace(sequence_parallel=True), 8, eps=1e-6)
    assert isinstance(norm, torch.nn.RMSNorm) and norm.weight.sequence_parallel
    x = torch.randn(3, 8)
    assert torch.allclose(norm(x), x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6))


def test_block_spec_swaps_every_torch_norm():
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.torch_norm import WrappedTorchNorm

    spec = get_gpt_layer_local_spec(num_experts=4, moe_grouped_gemm=False, qk_layernorm=True, normalization="RMSNorm")
    block = with_sequence_parallel_norms(spec, 3)
    assert len(block.layer_specs) == 3 and block.layer_norm is SequenceParallelRMSNorm
    layer = block.layer_specs[0].submodules
    attention = layer.self_attention.submodules
    for norm in (layer.input_layernorm, layer.pre_mlp_layernorm, attention.q_layernorm, attention.k_layernorm):
        assert norm is SequenceParallelRMSNorm
    assert spec.submodules.input_layernorm is WrappedTorchNorm  # the original spec is left alone
