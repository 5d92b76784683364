"""Weights that stay 4-bit in memory: torch's int4 kernel for a few rows, a widened copy for many.

A decode step, a speculative verify round or a batch of a few sequences reads
every weight once for a handful of rows: there the bytes read are the cost, and
``_weight_int4pack_mm_for_cpu`` (bfloat16 activations, a bfloat16 scale and
offset per 32 inputs) reads a quarter of what bfloat16 weights would. Its result
for a row does not depend on how many rows came with it, so a batched or
speculative step computes exactly what a lone decode step would.

A prompt chunk of many rows is bound by arithmetic instead, where that kernel is
slower than the AMX bfloat16 matrix multiply: above :data:`DENSE_FROM_ROWS` rows
the matrix is widened into the stage's one scratch buffer (its size: the largest
matrix of the stage, in bfloat16) and multiplied densely. Both regimes are
row-count independent within themselves; the threshold was measured on this
machine class (``bench/peers.py`` prints the crossover).
"""

from __future__ import annotations

import threading

import torch

from decoding.dense import dense_linear
from decoding.quant.groups import GROUP, Int4Groups

_ROW_TILE = 64  # the CPU layout interleaves blocks of 64 output rows; pad to it
_SLAB_ELEMENTS = 1 << 20  # float32 elements widened at once in dequantize
DENSE_FROM_ROWS = 64  # rows at and above which widening the matrix beats the int4 kernel (measured)


def _pack_cpu(codes: torch.Tensor) -> torch.Tensor:
    return torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes.to(torch.int32).contiguous(), 1)


def _unpack_cpu(packed: torch.Tensor, rows: int, cols: int, block: int | None = None) -> torch.Tensor:
    """The codes [rows, cols] of ``_convert_weight_to_int4pack_for_cpu``'s layout.

    The kernel packs blocks of ``block`` output rows, one byte per input column for each pair of rows
    ``block / 2`` apart (low nibble first). The block is 64 rows on AVX-512 CPUs and 32 on AVX2 ones;
    which one this CPU uses is found once at import (:data:`_BLOCK`): a matrix widened or an
    embedding looked up with the other layout is garbage, not an error.
    """
    block = block or _BLOCK
    v = packed.view(rows // block, cols, block // 2)
    halves = torch.stack([v & 0x0F, v >> 4], 1)  # [row blocks, low/high half of the block, cols, block / 2]
    return halves.permute(0, 1, 3, 2).reshape(rows, cols)


def _kernel_status() -> tuple[bool, int, str]:
    """(int4 kernel works, the row block of its layout — 0 if neither known one —, why not)."""
    try:
        gen = torch.Generator().manual_seed(0)
        codes = torch.randint(0, 16, (128, 64), generator=gen, dtype=torch.int32)
        packed = _pack_cpu(codes)
        sz = torch.ones(2, 128, 2, dtype=torch.bfloat16)
        sz[..., 1] = 0
        x = torch.eye(64, dtype=torch.bfloat16)[:3]
        y = torch.ops.aten._weight_int4pack_mm_for_cpu(x, packed, GROUP, sz)
        if not torch.equal(y.float(), (codes[:, :3].T - 8).float()):
            return False, 0, "int4 kernel disagrees with its documented formula"
    except (RuntimeError, AttributeError, NotImplementedError) as exc:
        return False, 0, f"int4 kernel unavailable ({exc})"
    for block in (64, 32):  # AVX-512, AVX2
        if torch.equal(_unpack_cpu(packed, 128, 64, block).int(), codes):
            return True, block, ""
    return False, 0, "int4 kernel packs in a layout meshd cannot read back (embeddings and prefill need it)"


INT4_OK, _BLOCK, INT4_UNAVAILABLE = _kernel_status()  # no known layout: INT4_OK is False


class Scratch:
    """One bfloat16 buffer a stage widens its packed matrices into, one matrix at a time.

    Grown to the largest matrix it is asked for and never beyond, so a stage's
    memory is its packed weights plus this one matrix. Each stage owns its own
    (several in-process stages may run in different threads); the lock makes a
    misuse wait rather than corrupt.
    """

    def __init__(self):
        self._buf: torch.Tensor | None = None
        self.lock = threading.Lock()

    def take(self, numel: int) -> torch.Tensor:
        if self._buf is None or self._buf.numel() < numel:
            self._buf = None
            self._buf = torch.empty(numel, dtype=torch.bfloat16)
        return self._buf[:numel]

    @property
    def nbytes(self) -> int:
        return 0 if self._buf is None else self._buf.numel() * 2


class PackedLinear:
    """A weight [out, in] held as one 4-bit plane, or two for 8-bit codes (``decoding.quant.groups``);
    ``self(x)`` is ``x @ w.T`` for bfloat16 ``x``."""

    def __init__(self, planes: "Int4Groups | list[Int4Groups] | tuple[Int4Groups, ...]",
                 scratch: Scratch | None = None):
        if not INT4_OK:
            raise RuntimeError(INT4_UNAVAILABLE)
        planes = [planes] if isinstance(planes, Int4Groups) else list(planes)
        out, inp = planes[0].shape
        if inp % GROUP:
            raise ValueError(f"packed weights need inputs in multiples of {GROUP}, got {inp}")
        if any(p.shape != (out, inp) for p in planes):
            raise ValueError("every plane of a packed weight has the weight's shape")
        pad = (-out) % _ROW_TILE
        self.out_features, self.in_features, self._rows = out, inp, out + pad
        self._planes = []  # (packed codes, [in / 32, rows, 2] scale-and-offset): the kernel's layout
        for p in planes:
            codes, scale, offset = p.codes, p.scale, p.offset
            if pad:
                codes = torch.cat([codes, torch.full((pad, inp), 8, dtype=codes.dtype)])
                scale = torch.cat([scale, torch.zeros(pad, scale.shape[1])])
                offset = torch.cat([offset, torch.zeros(pad, offset.shape[1])])
            self._planes.append((_pack_cpu(codes), torch.stack([scale.T, offset.T], -1).to(torch.bfloat16).contiguous()))
        self.scratch = scratch if scratch is not None else Scratch()

    @property
    def bits(self) -> int:
        return 4 * len(self._planes)

    @property
    def shape(self) -> tuple[int, int]:
        return (self.out_features, self.in_features)

    @property
    def dtype(self) -> torch.dtype:
        """The dtype of the activations it multiplies (and of its results)."""
        return torch.bfloat16

    @property
    def device(self) -> torch.device:
        return self._planes[0][0].device

    @property
    def nbytes(self) -> int:
        return sum(p.numel() * p.element_size() + so.numel() * 2 for p, so in self._planes)

    def dequantize(self, out: torch.Tensor | None = None) -> torch.Tensor:
        """The bfloat16 weights [out, in] this layer multiplies by (into ``out`` when given).

        Widened a slab of row tiles at a time (the planes summed in float32, rounded
        once), so the float32 temporaries stay a few MB whatever the matrix.
        """
        rows, cols = self._rows, self.in_features
        if out is None:
            out = torch.empty(self.out_features, cols, dtype=torch.bfloat16)
        step = max(_ROW_TILE, (_SLAB_ELEMENTS // cols) // _ROW_TILE * _ROW_TILE)
        for start in range(0, self.out_features, step):
            end = min(start + step, rows)
            keep = min(end, self.out_features) - start
            out[start:start + keep].copy_(self._widen(start, end)[:keep])
        return out

    def _widen(self, start: int, end: int) -> torch.Tensor:
        """float32 weights of rows ``[start, end)`` (multiples of the row tile), planes summed."""
        rows, cols = self._rows, self.in_features
        w = None
        for packed, so in self._planes:
            tiles = packed.view(rows // _ROW_TILE, -1)[start // _ROW_TILE:end // _ROW_TILE]
            codes = _unpack_cpu(tiles, end - start, cols).view(end - start, cols // GROUP, GROUP)
            scale = so[:, start:end, 0].T.float().unsqueeze(-1)
            offset = so[:, start:end, 1].T.float().unsqueeze(-1)
            part = codes.float().sub_(8.0).mul_(scale).add_(offset)
            w = part if w is None else w.add_(part)
        return w.view(end - start, cols)

    def lookup(self, ids: torch.Tensor) -> torch.Tensor:
        """Rows ``ids`` of the weight, bfloat16 [n, in]: a tied LM head serves as the token embedding
        too, so a device holding both ends keeps the matrix once, as the file does."""
        ids = ids.reshape(-1)
        tiles, where = torch.unique(ids // _ROW_TILE, return_inverse=True)
        widened = torch.stack([self._widen(int(t) * _ROW_TILE, (int(t) + 1) * _ROW_TILE) for t in tiles])
        return widened[where, ids % _ROW_TILE].to(torch.bfloat16)

    def __call__(self, x: torch.Tensor, bias: torch.Tensor | None = None,
                 dense: "torch.Tensor | bool | None" = None) -> torch.Tensor:
        """``dense``: which rows take the widened-matrix path — a bool per row, one bool for all, or
        None to decide by the row count (at least DENSE_FROM_ROWS). A row's result depends only on
        the path it takes, never on the rows beside it (each path is row-count independent there)."""
        if x.dtype != torch.bfloat16:
            raise TypeError(f"packed weights multiply bfloat16 activations, got {x.dtype}")
        if x.dim() != 2:  # [..., in] (Medusa heads: [positions, heads, hidden]) as rows
            y = self(x.reshape(-1, x.shape[-1]), bias, dense)
            return y.view(*x.shape[:-1], y.shape[-1])
        if dense is None:
            dense = x.shape[0] >= DENSE_FROM_ROWS
        if isinstance(dense, torch.Tensor):
            count = int(dense.sum())
            if count in (0, x.shape[0]):
                dense = bool(count)
        if isinstance(dense, bool):
            y = self._widened(x) if dense else self._kernel(x)
        else:
            y = torch.empty(x.shape[0], self.out_features, dtype=torch.bfloat16)
            y[dense] = self._widened(x[dense])
            y[~dense] = self._kernel(x[~dense])
        return y if bias is None else y + bias

    def _kernel(self, x: torch.Tensor) -> torch.Tensor:
        parts = [torch.ops.aten._weight_int4pack_mm_for_cpu(x, p, GROUP, so) for p, so in self._planes]
        y = parts[0] if len(parts) == 1 else (parts[0].float() + parts[1].float()).to(torch.bfloat16)
        return y if self._rows == self.out_features else y[:, : self.out_features]

    def _widened(self, x: torch.Tensor) -> torch.Tensor:
        """The widened matrix times ``x``, DENSE_FROM_ROWS rows per product: oneDNN splits long
        reductions (the down projections' 4,864-8,960 inputs) differently for different row counts,
        so only a fixed row count gives a row the same bits in a 64-row chunk and in a 512-row one."""
        with self.scratch.lock:
            w = self.dequantize(out=self.scratch.take(self.out_features * self.in_features).view(self.out_features, -1))
            if x.shape[0] <= DENSE_FROM_ROWS:
                return dense_linear(x, w)
            return torch.cat([dense_linear(x[i:i + DENSE_FROM_ROWS], w) for i in range(0, x.shape[0], DENSE_FROM_ROWS)])

    def __repr__(self) -> str:
        return f"PackedLinear({self.out_features}x{self.in_features}, {self.bits}-bit)"


class ConcatLinear:
    """Packed weights of different widths side by side: ``[q; k; v]`` where ``v`` is 8-bit and ``q``, ``k``
    4-bit (Qwen2.5's Q4_K_M files) — one product each, outputs joined, instead of widening all to 8 bits."""

    def __init__(self, parts: list[PackedLinear]):
        self.parts = parts
        self.out_features = sum(p.out_features for p in parts)
        self.in_features = parts[0].in_features

    shape = PackedLinear.shape
    dtype = PackedLinear.dtype

    @property
    def device(self) -> torch.device:
        return self.parts[0].device

    @property
    def nbytes(self) -> int:
        return sum(p.nbytes for p in self.parts)

    def __call__(self, x: torch.Tensor, bias: torch.Tensor | None = None, dense=None) -> torch.Tensor:
        y = torch.cat([p(x, None, dense) for p in self.parts], dim=-1)
        return y if bias is None else y + bias

    def __repr__(self) -> str:
        return f"ConcatLinear({', '.join(map(repr, self.parts))})"
