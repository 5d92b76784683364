"""A decoder layer's element-wise steps for the gguf mode, one kernel call each (``native/row_ops.cpp``).

The gguf mode's stage computes in float32 between its integer matrix products; at one core a
decode step's small torch operations (RMSNorm's five, RoPE's six per tensor) cost
more than a tenth of the step. Each row here depends only on its own input row, so a row computes
the same bits alone, batched or in a prompt chunk.
"""

from __future__ import annotations

import ctypes

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


def swiglu(gate_up: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` of rows ``gate_up`` [n, 2 * intermediate] (gate first): the gated MLP's
    activation, [n, intermediate], the same function a decode step applies inside its one call."""
    _f32(gate_up, "swiglu")
    if gate_up.dim() != 2 or gate_up.stride(1) != 1:
        gate_up = gate_up.reshape(-1, gate_up.shape[-1]).contiguous()
    n, width = gate_up.shape
    if width % 2:
        raise ValueError(f"swiglu needs gate and up side by side, got a width of {width}")
    out = torch.empty(n, width // 2)
    _kernels().meshd_swiglu(gate_up.data_ptr(), gate_up.stride(0), n, width // 2, out.data_ptr(), width // 2)
    return out


def segments_spec(segments) -> tuple[native.SegmentSpec, list]:
    """``segments`` [(keys, values)], each [kv_heads, length, head_dim] with a position every head_dim floats
    (a cache buffer's view), as the C struct; also what must stay alive while it is used."""
    keep, ks, vs, lengths, strides = [], [], [], [], []
    for k, v in segments:
        if k.dtype != torch.float32 or v.dtype != torch.float32:
            raise TypeError("the gguf mode's attention reads float32 keys and values")
        hd = k.shape[-1]
        if k.stride(2) != 1 or k.stride(1) != hd or v.stride() != k.stride():
            k, v = k.contiguous(), v.contiguous()
        keep += [k, v]
        ks.append(k.data_ptr())
        vs.append(v.data_ptr())
        lengths.append(k.shape[1])
        strides.append(k.stride(0))
    n = len(ks)
    arrays = ((ctypes.c_void_p * n)(*ks), (ctypes.c_void_p * n)(*vs), (ctypes.c_int64 * n)(*lengths),
              (ctypes.c_int64 * n)(*strides))
    spec = native.SegmentSpec(n, *(ctypes.cast(a, ctypes.c_void_p) for a in arrays))
    return spec, keep + list(arrays)


def row_attention(q: torch.Tensor, segments, scale: float) -> torch.Tensor:
    """One query row per head, ``q`` [heads, 1, head_dim], over ``segments``' keys in order: [heads, 1, head_dim].

    Every lone row of the gguf mode attends here (a decode step, a verify round's rows, a prompt's last
    partial block), in a fixed order of its own: the same bits in any of them and at any thread count.
    A forked sequence's segments are read in place, never joined."""
    _f32(q, "row_attention")
    heads, _, hd = q.shape
    kv_heads = segments[0][0].shape[0]
    if heads % kv_heads:
        raise ValueError(f"row_attention needs whole groups of query heads, got {heads} over {kv_heads}")
    q = q.reshape(heads, hd).contiguous()
    out = torch.empty(heads, 1, hd)
    spec, keep = segments_spec(segments)
    _kernels().meshd_row_attention(q.data_ptr(), heads, kv_heads, hd, scale, ctypes.byref(spec), out.data_ptr(),
                                   torch.get_num_threads())
    del keep
    return out
