"""The CPU kernels a trace meets that torch's fake tensors and FLOP counter do not describe as the ranks run them:
the fused attention kernel's FLOPs (FlopCounterMode has no formula for the CPU's) and the grouped matmul of
mixture-of-experts FFNs (its FLOPs, and its output's shape on fake tensors)."""

from __future__ import annotations

import torch
from torch.utils._python_dispatch import TorchDispatchMode

aten = torch.ops.aten


def attention_flops(q_shape, k_shape, v_shape) -> int:
    """q·kᵀ and p·v over the whole square, every query head (grouped keys and values are broadcast to them)."""
    b, h, s_q, d = q_shape
    s_k, d_v = k_shape[-2], v_shape[-1]
    return 2 * b * h * s_q * s_k * (d + d_v)


def _cpu_flash_flops(q_shape, k_shape, v_shape, *args, **kwargs) -> int:
    return attention_flops(q_shape, k_shape, v_shape)


def _cpu_flash_backward_flops(grad_shape, q_shape, k_shape, v_shape, *args, **kwargs) -> int:
    return 2 * attention_flops(q_shape, k_shape, v_shape)  # dv, dp, dq and dk: four matmuls of the same size


def _grouped_mm_flops(a_shape, b_shape, *args, out_shape=None, **kwargs) -> int:
    """A grouped matmul (mixture-of-experts FFNs): 2·M·K·N over all its groups together, whatever the split."""
    if len(a_shape) == 3 and len(b_shape) == 3:
        return 2 * a_shape[0] * a_shape[1] * a_shape[2] * b_shape[2]
    return 2 * a_shape[0] * a_shape[1] * b_shape[-1]


FLOP_FORMULAS = {
    aten._scaled_dot_product_flash_attention_for_cpu: _cpu_flash_flops,
    aten._scaled_dot_product_flash_attention_for_cpu_backward: _cpu_flash_backward_flops,
    aten._grouped_mm: _grouped_mm_flops,
}
"""The CPU's fused attention kernels, which FlopCounterMode has no formula for: counted as their math (q·kᵀ and
p·v over the whole square, and twice that backward), as it counts the GPU's flash and efficient kernels."""


class GroupedShapes(TorchDispatchMode):
    """torch's grouped matmul on fake tensors: its output's shape, not its meta function, which accepts bf16 only
    where the CPU kernel (what the ranks run, transformers' default for experts) takes fp32 too."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is aten._grouped_mm.default:
            a, b = args[0], args[1]
            offs = (kwargs or {}).get("offs", args[2] if len(args) > 2 else None)
            if a.dim() == 2 and b.dim() == 3:
                shape = (a.shape[0], b.shape[2])
            elif a.dim() == 2 and b.dim() == 2:  # a weight's gradient: one (K, N) per group
                shape = (offs.shape[0], a.shape[0], b.shape[1])
            else:
                shape = (a.shape[0], a.shape[1], b.shape[-1])
            return torch.empty(shape, dtype=(kwargs or {}).get("out_dtype") or a.dtype, device=a.device)
        return func(*args, **(kwargs or {}))
