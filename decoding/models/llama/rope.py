"""RoPE inverse frequencies with the scaling schemes Llama-family checkpoints use.

Kept apart from the forward so that every loader agrees on one definition and a
checkpoint with an unknown scaling scheme is refused instead of silently wrong.
"""

from __future__ import annotations

import math

import torch

from decoding.errors import UnsupportedArchitecture


def inv_frequencies(head_dim: int, theta: float, scaling: dict | None,
                    freq_factors: torch.Tensor | None = None) -> tuple[torch.Tensor, float]:
    """Return (inv_freq [head_dim/2], attention_scaling) in float32, on the host (stages move it to their device)."""
    inv = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64, device="cpu") / head_dim))
    attn_scale = 1.0
    if freq_factors is not None:
        inv = inv / freq_factors.to(torch.float64)
    elif scaling:
        kind = scaling.get("rope_type") or scaling.get("type")
        if kind in (None, "default"):
            pass
        elif kind == "linear":
            inv = inv / float(scaling["factor"])
        elif kind == "llama3":
            inv = _llama3(inv, scaling)
        else:
            raise UnsupportedArchitecture(
                f"RoPE scaling type {kind!r} is not supported (supported: default, linear, llama3)")
    return inv.to(torch.float32), attn_scale


def _llama3(inv: torch.Tensor, s: dict) -> torch.Tensor:
    factor = float(s["factor"])
    low = float(s.get("low_freq_factor", 1.0))
    high = float(s.get("high_freq_factor", 4.0))
    old_ctx = float(s.get("original_max_position_embeddings", 8192))
    low_wavelen, high_wavelen = old_ctx / low, old_ctx / high
    wavelen = 2 * math.pi / inv
    scaled = torch.where(wavelen > low_wavelen, inv / factor, inv)
    smooth = (old_ctx / wavelen - low) / (high - low)
    mid = (1 - smooth) * scaled / factor + smooth * scaled
    is_mid = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return torch.where(is_mid, mid, scaled)
