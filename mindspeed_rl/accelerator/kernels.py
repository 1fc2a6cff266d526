"""Which fused kernels a config asks for, and which of them this device can run.

MindSpeed-RL's `megatron_training` keys name kernels (`use_fused_swiglu`, `no_masked_softmax_fusion`,
...). Each maps to one Megatron `TransformerConfig` field, or to none where the kernel lives only in
TransformerEngine's layer spec. A requested kernel is turned on only where its implementation is
importable on this device; everywhere else Megatron runs its plain torch path, which computes the
same function. The worker prints the requested-but-unavailable ones once at initialize.
"""
from __future__ import annotations

import importlib.util
from dataclasses import dataclass


@dataclass(frozen=True, kw_only=True)
class KernelRequest:
    """The kernel keys of `megatron_training`, in the user's positive sense (True = wants the fused kernel)."""

    fused_rmsnorm: bool = False
    flash_attn: bool = False
    masked_softmax_fusion: bool = False
    gradient_accumulation_fusion: bool = False
    fused_swiglu: bool = False
    fused_rotary_pos_emb: bool = False

    @classmethod
    def from_megatron_training(cls, mt) -> "KernelRequest":
        return cls(fused_rmsnorm=mt.use_fused_rmsnorm, flash_attn=mt.use_flash_attn,
                   masked_softmax_fusion=not mt.no_masked_softmax_fusion,
                   gradient_accumulation_fusion=not mt.no_gradient_accumulation_fusion,
                   fused_swiglu=mt.use_fused_swiglu, fused_rotary_pos_emb=mt.use_fused_rotary_pos_emb)


@dataclass(frozen=True, kw_only=True)
class _Kernel:
    config_key: str  # the megatron_training key, as the user wrote it
    transformer_field: str | None  # TransformerConfig field; None: only TransformerEngine's spec has it
    devices: tuple[str, ...]  # devices whose torch can run it, given `importable`
    importable: tuple[str, ...] = ()  # modules the implementation imports (any one suffices)


# Request field -> the kernel. Megatron's fusions are CUDA extensions (apex, its own fused kernels,
# TransformerEngine); the NPU equivalents arrive through MindSpeed's patches, which this engine does
# not apply, so on npu and cpu every kernel resolves to the plain path. RMSNorm and flash attention
# exist only in TransformerEngine's layer spec, whose fused layer names (e.g. linear_qkv.layer_norm_weight)
# the HF <-> Megatron layout maps do not read; the local spec runs torch RMSNorm and DotProductAttention.
_KERNELS = {
    "fused_rmsnorm": _Kernel(config_key="use_fused_rmsnorm", transformer_field=None, devices=()),
    "flash_attn": _Kernel(config_key="use_flash_attn", transformer_field=None, devices=()),
    "masked_softmax_fusion": _Kernel(config_key="no_masked_softmax_fusion", transformer_field="masked_softmax_fusion",
                                     devices=("cuda",), importable=("scaled_upper_triang_masked_softmax_cuda",)),
    "gradient_accumulation_fusion": _Kernel(config_key="no_gradient_accumulation_fusion",
                                            transformer_field="gradient_accumulation_fusion", devices=("cuda",),
                                            importable=("fused_weight_gradient_mlp_cuda",)),
    # Megatron's bias-SwiGLU is a torch.compile'd function: CUDA compiles it; on CPU it would need
    # a C++ toolchain at run time for no numerical difference.
    "fused_swiglu": _Kernel(config_key="use_fused_swiglu", transformer_field="bias_activation_fusion",
                            devices=("cuda",)),
    "fused_rotary_pos_emb": _Kernel(config_key="use_fused_rotary_pos_emb", transformer_field="apply_rope_fusion",
                                    devices=("cuda",), importable=("transformer_engine",)),
}


@dataclass(frozen=True, kw_only=True)
class KernelResolution:
    transformer_fields: dict[str, bool]  # every fusion field of TransformerConfig, on or off
    unavailable: tuple[str, ...]  # 'key=value' of each requested kernel this device cannot run

    def message(self, device: str) -> str | None:
        if not self.unavailable:
            return None
        return (f"[kernels] requested but unavailable on {device}, running the plain torch path instead: "
                f"{', '.join(self.unavailable)}")


def _available(kernel: _Kernel, device: str) -> bool:
    if device not in kernel.devices:
        return False
    return not kernel.importable or any(importlib.util.find_spec(m) is not None for m in kernel.importable)


def resolve_kernels(request: KernelRequest, device: str) -> KernelResolution:
    fields: dict[str, bool] = {}
    unavailable: list[str] = []
    for name, kernel in _KERNELS.items():
        wanted = getattr(request, name)
        usable = wanted and _available(kernel, device)
        if kernel.transformer_field is not None:
            fields[kernel.transformer_field] = usable
        if wanted and not usable:
            # As the user wrote it: the "no_*" keys ask for the kernel by being false.
            value = "false" if kernel.config_key.startswith("no_") else "true"
            unavailable.append(f"{kernel.config_key}={value}")
    return KernelResolution(transformer_fields=fields, unavailable=tuple(unavailable))
