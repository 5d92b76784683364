"""GGUF tensors as 4-bit groups: ``w = (q - 8) * scale + offset`` for every 32 inputs of a row.

That is the form torch's int4 kernels take, and the 4-bit GGUF formats map onto
it without touching a code: Q4_0 is ``d * (q - 8)``, Q4_1 ``d * q + m`` and
Q4_K ``d * sc * q - dmin * m`` per 32-weight sub-block. Only the scale and the
offset change representation (the kernel keeps them in bfloat16), which is the
whole of the packed mode's distance from these weights in float32.

Wider formats fit as *two* such planes: an 8-bit code ``c = 16 h + l`` is a
high plane of codes ``h`` (scale ``16 s``) plus a low plane of codes ``l``
(scale ``s``), so Q8_0 and Q5_0 keep every code too (:func:`from_gguf_eight_bit`)
and cost 1.125 bytes a weight instead of bfloat16's 2. Q6_K (a scale per 16
weights) and float tensors become 8-bit groups by rounding (:func:`requantize_8bit`),
far finer than their own steps. Rounding them to 4 bits (:func:`requantize`)
halves the bytes again at a real cost in quality: a stated choice of the
numeric mode, never silent.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

GROUP = 32  # inputs per scale/offset: the block size of Q4_0/Q4_1 and of Q4_K's sub-blocks

#: GGUF tensor types whose weights are 4-bit codes already (repacked without loss of a code).
FOUR_BIT_TYPES = ("Q4_0", "Q4_1", "Q4_K")
#: GGUF types whose codes fit 8 bits with a scale per 32 weights (two planes, every code kept).
EIGHT_BIT_TYPES = ("Q8_0", "Q5_0")


@dataclass(frozen=True)
class Int4Groups:
    """A [rows, cols] matrix as codes in [0, 16) and a float32 scale/offset per (row, group of 32 cols)."""

    codes: torch.Tensor  # uint8 [rows, cols]
    scale: torch.Tensor  # float32 [rows, cols // GROUP]
    offset: torch.Tensor  # float32 [rows, cols // GROUP]; the value of code 8

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.codes.shape)

    def dequantize(self) -> torch.Tensor:
        """The float32 weights these groups stand for."""
        rows, cols = self.shape
        q = self.codes.view(rows, cols // GROUP, GROUP).float() - 8.0
        return (q * self.scale.unsqueeze(-1) + self.offset.unsqueeze(-1)).view(rows, cols)

    def permute_rows(self, order: np.ndarray) -> "Int4Groups":
        idx = torch.from_numpy(np.ascontiguousarray(order))
        return Int4Groups(self.codes[idx], self.scale[idx], self.offset[idx])

    @staticmethod
    def concat(parts: "list[Int4Groups]") -> "Int4Groups":
        """Row-wise concatenation (fused q/k/v or gate/up projections)."""
        return Int4Groups(torch.cat([p.codes for p in parts]), torch.cat([p.scale for p in parts]),
                          torch.cat([p.offset for p in parts]))


def _nibbles(qs: np.ndarray) -> np.ndarray:
    """[blocks, chunks, 16|32 bytes] -> codes [blocks, chunks, 2, bytes]: low nibbles first, then high."""
    return np.stack([qs & 0x0F, qs >> 4], axis=-2)


def from_gguf_blocks(type_name: str, blocks: np.ndarray, shape: tuple[int, int]) -> Int4Groups:
    """Codes, scales and offsets of a 4-bit GGUF tensor (``blocks``: its raw bytes, one row of blocks per row)."""
    import gguf

    rows, cols = shape
    raw = np.ascontiguousarray(blocks, dtype=np.uint8).reshape(-1)
    if type_name in ("Q4_0", "Q4_1"):
        head = 2 if type_name == "Q4_0" else 4
        b = raw.reshape(-1, head + 16)
        d = b[:, 0:2].copy().view(np.float16).astype(np.float32)[:, 0]
        codes = _nibbles(b[:, head:]).reshape(-1, GROUP)  # 16 low nibbles, then 16 high: element order
        if type_name == "Q4_0":  # d * (q - 8)
            scale, offset = d, np.zeros_like(d)
        else:  # d * q + m  ==  (q - 8) * d + (m + 8 d)
            m = b[:, 2:4].copy().view(np.float16).astype(np.float32)[:, 0]
            scale, offset = d, m + 8.0 * d
    elif type_name == "Q4_K":
        b = raw.reshape(-1, 144)  # d, dmin (f16), 12 bytes of 6-bit scales and mins, 128 bytes of codes
        d = b[:, 0:2].copy().view(np.float16).astype(np.float32)
        dmin = b[:, 2:4].copy().view(np.float16).astype(np.float32)
        sc, mn = gguf.quants.Q4_K.get_scale_min(b[:, 4:16])
        codes = _nibbles(b[:, 16:].reshape(-1, 4, 32)).reshape(-1, GROUP)  # 8 sub-blocks of 32, in order
        scale = (d * sc.astype(np.float32)).reshape(-1)  # d * sc * q - dmin * m
        offset = 8.0 * scale - (dmin * mn.astype(np.float32)).reshape(-1)
    else:
        raise ValueError(f"{type_name} is not a 4-bit GGUF type ({', '.join(FOUR_BIT_TYPES)})")
    groups = cols // GROUP
    return Int4Groups(torch.from_numpy(codes.reshape(rows, cols).astype(np.uint8)),
                      torch.from_numpy(scale.reshape(rows, groups).astype(np.float32)),
                      torch.from_numpy(offset.reshape(rows, groups).astype(np.float32)))


def eight_bit_planes(codes: torch.Tensor, scale: torch.Tensor, offset: torch.Tensor) -> tuple[Int4Groups, Int4Groups]:
    """``w = (c - 128) * scale + offset`` for codes ``c`` in [0, 256) as a high and a low 4-bit plane.

    ``c = 16 h + l``: the high plane is ``16 s (h - 8) + offset``, the low plane ``s (l - 8) + 8 s``;
    they sum to the weight exactly, and no new rounding enters when they are stored (``16 s`` and
    ``8 s`` are as exact as ``s`` in any binary format; ``offset`` is kept as it was).
    """
    c = codes.to(torch.int32)
    hi = Int4Groups((c >> 4).to(torch.uint8), scale * 16.0, offset)
    lo = Int4Groups((c & 0x0F).to(torch.uint8), scale, 8.0 * scale)
    return hi, lo


def from_gguf_eight_bit(type_name: str, blocks: np.ndarray, shape: tuple[int, int]) -> tuple[Int4Groups, Int4Groups]:
    """The two planes of a Q8_0 or Q5_0 tensor, every code kept (see :func:`eight_bit_planes`)."""
    rows, cols = shape
    raw = np.ascontiguousarray(blocks, dtype=np.uint8).reshape(-1)
    if type_name == "Q8_0":  # d * q, q an int8
        b = raw.reshape(-1, 34)
        d = b[:, 0:2].copy().view(np.float16).astype(np.float32)[:, 0]
        codes = b[:, 2:].copy().view(np.int8).astype(np.int32) + 128
    elif type_name == "Q5_0":  # d * (q - 16), q 5 bits: low nibbles as Q4_0, the fifth bits in a u32
        b = raw.reshape(-1, 22)
        d = b[:, 0:2].copy().view(np.float16).astype(np.float32)[:, 0]
        high = b[:, 2:6].copy().view(np.uint32)[:, 0:1] >> np.arange(32, dtype=np.uint32)
        low = _nibbles(b[:, 6:].reshape(-1, 1, 16)).reshape(-1, GROUP)
        codes = (low | ((high & 1).astype(np.uint8) << 4)).astype(np.int32) + 112  # (q + 112) - 128 = q - 16
    else:
        raise ValueError(f"{type_name} is not one of {', '.join(EIGHT_BIT_TYPES)}")
    groups = cols // GROUP
    scale = torch.from_numpy(d.reshape(rows, groups).astype(np.float32))
    return eight_bit_planes(torch.from_numpy(codes.reshape(rows, cols)), scale, torch.zeros_like(scale))


def requantize_8bit(w: torch.Tensor, *, storage: torch.dtype = torch.bfloat16) -> tuple[Int4Groups, Int4Groups]:
    """Round-to-nearest asymmetric 8-bit groups of 32 as two 4-bit planes (Q6_K, F16, F32 matrices)."""
    rows, cols = w.shape
    g = w.float().reshape(rows, cols // GROUP, GROUP)
    lo, hi = g.amin(-1), g.amax(-1)
    offset = ((lo + hi) / 2).to(storage).float()  # ~ the value of code 128, as it will be stored
    # the step that reaches both ends from the *stored* offset (bfloat16 moves it by up to |offset| / 256)
    scale = torch.maximum((hi - offset) / 127.0, (offset - lo) / 128.0)
    scale = _round_up(scale, storage)
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    codes = torch.round((g - offset.unsqueeze(-1)) / scale.unsqueeze(-1) + 128.0).clamp_(0, 255)
    return eight_bit_planes(codes.to(torch.int32).reshape(rows, cols), scale, offset)


def _round_up(x: torch.Tensor, storage: torch.dtype) -> torch.Tensor:
    """``x`` in ``storage``, rounded towards +inf (a step that must not shrink)."""
    r = x.to(storage)
    up = torch.nextafter(r, torch.full_like(r, float("inf")))
    return torch.where(r.float() < x, up, r).float()


def requantize(w: torch.Tensor, *, storage: torch.dtype = torch.bfloat16) -> Int4Groups:
    """Round-to-nearest asymmetric 4-bit groups of a float matrix [rows, cols], cols a multiple of 32.

    The scale and offset are rounded to ``storage`` (the kernel's format) *before*
    the codes are chosen, so each code is the nearest for the scale that will
    actually be used.
    """
    rows, cols = w.shape
    g = w.float().reshape(rows, cols // GROUP, GROUP)
    lo, hi = g.amin(-1), g.amax(-1)
    scale = ((hi - lo) / 15.0).to(storage).float()
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    offset = (lo + 8.0 * scale).to(storage).float()
    codes = torch.round((g - offset.unsqueeze(-1)) / scale.unsqueeze(-1) + 8.0).clamp_(0, 15)
    return Int4Groups(codes.to(torch.uint8).reshape(rows, cols), scale, offset)
