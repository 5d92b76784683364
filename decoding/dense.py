"""The dense matrix multiply of every stage: oneDNN's inference linear where torch has it."""

from __future__ import annotations

import torch
import torch.nn.functional as F


# On a CPU, torch's default GEMM is slow exactly where a stage lives: a handful of
# rows against a large weight (decode steps, verify rounds, batched steps of a few
# sequences). It re-reads or repacks the weights for small row counts (M = 2-3
# cost 2-3x M = 1). oneDNN's inference linear streams them once. Measured on this
# machine (torch 2.13 CPU, one thread, the embedded model's four projections over
# 30 layers, ms): M=1 36.4 -> 31.9, M=2 63.7 -> 42.6, M=3 85.9 -> 49.0,
# M=4 50.9 -> 46.5, M=8 58.0 -> 55.2; the 49152x576 LM head M=1..4:
# 12.5/17.7/17.7/21.3 -> 9.8/10.6/11.6/14.4 (the first row already padded 2-3 rows to 4).
def _onednn_linear():
    """The op and the dtypes it computes on this CPU: oneDNN has no bfloat16 inner product on a CPU
    without AVX-512 (an AVX2 mini PC), and says so only by raising when first asked."""
    op = getattr(getattr(torch.ops, "mkldnn", None), "_linear_pointwise", None)
    if op is None or not torch.backends.mkldnn.is_available():
        return None, frozenset()
    works = set()
    for dtype in (torch.float32, torch.bfloat16):
        try:
            x, w, b = torch.ones(3, 8, dtype=dtype), torch.ones(5, 8, dtype=dtype), torch.zeros(5, dtype=dtype)
            if torch.equal(op(x, w, b, "none", [], ""), F.linear(x, w, b)):
                works.add(dtype)
        except (RuntimeError, NotImplementedError):
            pass
    return (op if works else None), frozenset(works)


_ONEDNN, _ONEDNN_DTYPES = _onednn_linear()


def dense_linear(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear``, through oneDNN on CPU (2-D inputs of a dtype it computes here) where this torch has it."""
    if (_ONEDNN is not None and x.dim() == 2 and x.device.type == "cpu" and x.dtype == w.dtype
            and x.dtype in _ONEDNN_DTYPES and w.is_contiguous()):
        return _ONEDNN(x, w, b, "none", [], "")
    return F.linear(x, w, b)
