"""Multiplying by a weight, whatever form it is held in: a dense tensor or packed 4-bit groups.

The forward of a stage calls :func:`linear` and never asks how a weight is
stored; the numeric mode (``decoding.numerics``) decided that at load time.
"""

from __future__ import annotations

from typing import Union

import torch
from decoding.dense import dense_linear
from decoding.quant.packed import ConcatLinear, PackedLinear

#: What a stage holds for a matrix it multiplies by.
Weight = Union[torch.Tensor, PackedLinear, ConcatLinear]

__all__ = ["ConcatLinear", "PackedLinear", "Weight", "dense_linear", "linear", "nbytes"]


def linear(x: torch.Tensor, w: Weight, b: torch.Tensor | None = None,
           dense: "torch.Tensor | bool | None" = None) -> torch.Tensor:
    """``x @ w.T + b`` for a dense or a packed ``w``. ``dense`` (packed ``w`` only): which rows take the
    widened-matrix path (a bool per row, or one for all; None: decided by the row count)."""
    if isinstance(w, torch.Tensor):
        return dense_linear(x, w, b)
    return w(x, b, dense)


def nbytes(w: Weight | None) -> int:
    """Bytes a weight occupies where it lives (0 for None)."""
    if w is None:
        return 0
    if isinstance(w, torch.Tensor):
        return w.numel() * w.element_size()
    return w.nbytes
