"""A decoder layer's element-wise steps for the gguf mode, one kernel call each (``native/row_ops.cpp``).

The gguf mode's stage computes in float32 between its integer matrix products; at one core a
decode step's small torch operations (RMSNorm's five, RoPE's six per tensor) cost
more than a tenth of the step. Each row here depends only on its own input row, so a row computes
the same bits alone, batched or in a prompt chunk.
"""

from __future__ import annotations

import torch

from decoding.quant import native


_lib = None


def _kernels():
    global _lib
    if _lib is None:
        _lib = native.library()
    return _lib


def _f32(t: torch.Tensor, what: str) -> None:
    if t.dtype != torch.float32 or t.device.type != "cpu":
        raise TypeError(f"{what}: the gguf mode's row steps take float32 CPU tensors, got {t.dtype} on {t.device}")


def rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    """``w * x / sqrt(mean(x^2) + eps)`` per row of a 2-D ``x`` (rows may be strided)."""
    _f32(x, "rms_norm")
    if x.dim() != 2 or x.stride(1) != 1:
        x = x.reshape(-1, x.shape[-1]).contiguous()
    w = w.contiguous()
    out = torch.empty(x.shape[0], x.shape[1])
    _kernels().meshd_rms_norm(x.data_ptr(), x.stride(0), w.data_ptr(), out.data_ptr(), x.shape[1],
                                    x.shape[0], x.shape[1], eps)
    return out


def rope_(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half RoPE in place on ``x`` [n, heads, head_dim] (a view into a wider row is fine);
    ``cos``/``sin`` [n, head_dim]. Returns ``x``."""
    _f32(x, "rope")
    n, heads, hd = x.shape
    if x.stride(2) != 1:
        raise ValueError("rope_ needs each head's elements contiguous")
    cos, sin = cos.contiguous(), sin.contiguous()
    _kernels().meshd_rope(x.data_ptr(), n, heads, hd, x.stride(0), x.stride(1), cos.data_ptr(),
                                sin.data_ptr())
    return x
