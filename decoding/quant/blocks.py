"""Weights held as the GGUF file holds them, multiplied by the integer kernels (``decoding.quant.native``).

The ``gguf`` numeric mode: a matrix is a view of the memory-mapped file (its blocks at their own bit
width, never widened), activations stay float32 between products and are quantised to int8 per row
for each product, as llama.cpp does. Loading maps the file instead of reading it, so a stage is ready
in about the time it takes to read its layers' pages, and its resident memory is those pages.

A row's result depends on that row alone (the kernels' contract), so a prompt computed in one pass, a
verify round and a batch of sequences give each row the bits a lone decode step gives it, and the rows
are still computed together: one pass over the weights for all of them.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from decoding.quant import native

#: Work (weight rows x activation rows) below which a product is not split between threads.
_SPLIT_FROM = 1 << 14


@dataclass(frozen=True)
class BlockPart:
    """One GGUF matrix: its rows of blocks as mapped, and where each stored row's output goes."""

    type_name: str
    blocks: np.ndarray  # uint8 [rows, bytes per row]: a view of the file
    cols: int
    colmap: np.ndarray | None = None  # int64 [rows]: output column of each stored row (None: in order)

    @property
    def rows(self) -> int:
        return int(self.blocks.shape[0])

    def stored(self, ids: np.ndarray) -> np.ndarray:
        """The stored rows that hold output rows ``ids``."""
        return ids if self.colmap is None else np.argsort(self.colmap)[ids]

    def take_rows(self, ids: np.ndarray) -> "BlockPart":
        """Output rows ``ids`` (their blocks copied), stored in that order."""
        return BlockPart(self.type_name, np.ascontiguousarray(self.blocks[self.stored(np.asarray(ids, np.int64))]),
                         self.cols)

    def take_columns(self, start: int, stop: int) -> "BlockPart":
        """Inputs ``[start, stop)`` of every row (their blocks copied): whole blocks only, so each output's
        partial sum is the full product's sum over those blocks."""
        per = native.library().meshd_block_elems(native.TYPE_IDS[self.type_name])
        if start % per or stop % per or not 0 <= start < stop <= self.cols:
            raise ValueError(f"{self.type_name} inputs [{start}, {stop}) of {self.cols} are not whole {per}-wide blocks")
        width = self.blocks.shape[1] // (self.cols // per)
        cut = self.blocks[:, start // per * width: stop // per * width]
        return BlockPart(self.type_name, np.ascontiguousarray(cut), stop - start, self.colmap)

    def dequantize(self) -> torch.Tensor:
        """float32 [rows, cols] in output order (tests and tools; the mode itself never widens)."""
        import gguf

        w = np.asarray(gguf.quants.dequantize(np.asarray(self.blocks), gguf.GGMLQuantizationType[self.type_name]),
                       dtype=np.float32).reshape(self.rows, self.cols)
        if self.colmap is not None:
            out = np.empty_like(w)
            out[self.colmap] = w
            w = out
        return torch.from_numpy(np.ascontiguousarray(w))


def supported(type_name: str) -> bool:
    return type_name in native.TYPE_IDS


class BlockLinear:
    """``x @ w.T`` (float32 ``x``) for ``w`` the row-wise concatenation of GGUF matrices (fused q/k/v,
    gate/up), each multiplied on its own blocks into its columns of one output."""

    def __init__(self, parts: list[BlockPart]):
        if not parts or len({p.cols for p in parts}) != 1:
            raise ValueError("a block weight needs parts of one input width")
        for p in parts:
            if not supported(p.type_name):
                raise ValueError(f"the integer kernels do not multiply {p.type_name}")
            if p.cols % native.ACT_BLOCK[p.type_name]:
                raise ValueError(f"{p.type_name} rows of {p.cols} columns are not whole blocks")
        self.parts = list(parts)
        self.in_features = parts[0].cols
        self.out_features = sum(p.rows for p in parts)
        self._fused = native.FusedMatrices([(p.type_name, p.blocks, p.colmap) for p in parts], self.in_features)

    @property
    def shape(self) -> tuple[int, int]:
        return (self.out_features, self.in_features)

    @property
    def dtype(self) -> torch.dtype:
        """The dtype of the activations it multiplies (and of its results)."""
        return torch.float32

    @property
    def device(self) -> torch.device:
        return torch.device("cpu")

    @property
    def nbytes(self) -> int:
        """Bytes of the file it reads (mapped, so resident only once touched)."""
        return sum(p.blocks.nbytes for p in self.parts)

    @property
    def spec(self) -> native.MatrixSpec:
        """The matrices as the step kernels take them (``native/decode_step.cpp``)."""
        return self._fused.spec

    @property
    def types(self) -> tuple[str, ...]:
        return tuple(p.type_name for p in self.parts)

    def __call__(self, x: torch.Tensor, bias: torch.Tensor | None = None, dense=None) -> torch.Tensor:
        """``dense`` is accepted for the packed weights' signature and ignored: every row count is one path."""
        if x.dtype != torch.float32:
            raise TypeError(f"block weights multiply float32 activations, got {x.dtype}")
        if x.dim() != 2:
            y = self(x.reshape(-1, x.shape[-1]), bias)
            return y.view(*x.shape[:-1], y.shape[-1])
        if x.shape[1] != self.in_features or x.device.type != "cpu":
            raise ValueError(f"{self!r} multiplies CPU rows of {self.in_features}, got {tuple(x.shape)} on {x.device}")
        x = x.detach().contiguous()
        m = x.shape[0]
        out = torch.empty(m, self.out_features)
        threads = torch.get_num_threads() if m * self.out_features >= _SPLIT_FROM else 1
        self._fused.run(x.data_ptr(), m, self.in_features, out.data_ptr(), self.out_features, threads)
        return out if bias is None else out.add_(bias)
    def only(self, ids: torch.Tensor) -> "BlockLinear":
        """The matrix of output rows ``ids`` only (their blocks copied): ``only(ids)(x)`` is ``self(x)[:, ids]``,
        bit for bit, since a row's result depends on its own blocks and the activations alone. An LM head
        under a grammar multiplies just the tokens the grammar allows; a tensor-parallel member, its share
        of every matrix's rows."""
        ids = ids.reshape(-1).cpu().numpy().astype(np.int64) if isinstance(ids, torch.Tensor) else np.asarray(ids, np.int64)
        parts, start = [], 0
        for part in self.parts:
            mine = ids[(ids >= start) & (ids < start + part.rows)]
            if mine.size:
                parts.append(part.take_rows(mine - start))
            start += part.rows
        if sum(p.rows for p in parts) != ids.size or (len(self.parts) > 1 and (np.diff(ids) <= 0).any()):
            raise ValueError("rows of a fused matrix are selected in order, each once")
        return BlockLinear(parts)

    def columns(self, start: int, stop: int) -> "BlockLinear":
        """Inputs ``[start, stop)`` of every row: a tensor-parallel member's share of a matrix split by input."""
        return BlockLinear([p.take_columns(start, stop) for p in self.parts])

    def lookup(self, ids: torch.Tensor) -> torch.Tensor:
        """float32 rows ``ids`` of the matrix (a token embedding): only those rows are widened."""
        import gguf

        if len(self.parts) != 1:
            raise ValueError("rows are looked up in a single matrix")
        part = self.parts[0]
        ids = ids.reshape(-1).cpu().numpy()
        if part.colmap is not None:
            ids = np.argsort(part.colmap)[ids]
        rows = np.asarray(part.blocks[ids])
        values = gguf.quants.dequantize(rows, gguf.GGMLQuantizationType[part.type_name])
        return torch.from_numpy(np.asarray(values, dtype=np.float32).reshape(len(ids), part.cols).copy())

    def dequantize(self) -> torch.Tensor:
        return torch.cat([p.dequantize() for p in self.parts])

    def __repr__(self) -> str:
        return f"BlockLinear({self.out_features}x{self.in_features}, {'+'.join(self.types)})"
