"""The pieces of one Llama block: its weights, RMSNorm and rotate-half RoPE.

The block itself (attention, then the SwiGLU MLP, each with a residual) is
``StageModel._layer``; these are the parts the Medusa trainer and the
profiler's stage views reuse.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from decoding.linear import Weight, nbytes


@dataclass
class LayerWeights:
    attn_norm: torch.Tensor
    qkv: Weight  # fused [q; k; v] rows: one matmul instead of three
    qkv_bias: torch.Tensor | None  # Qwen2's q/k/v biases, fused the same way
    o: Weight
    mlp_norm: torch.Tensor
    gate_up: Weight  # fused [gate; up]
    down: Weight

    def nbytes(self) -> int:
        return sum(nbytes(w) for w in (self.attn_norm, self.qkv, self.qkv_bias, self.o, self.mlp_norm,
                                        self.gate_up, self.down))

    def norm_heads(self, q: torch.Tensor, k: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
        """q [n, heads, head_dim] and k [n, kv_heads, head_dim] as the block hands them to RoPE.

        A Llama block leaves them as projected; a family whose block normalises
        them (Qwen3's per-head RMSNorm) subclasses these weights. The weights, not
        the stage, say so, so that a stage view built over another stage's layers
        (the profiler's) computes the same block.
        """
        return q, k


def rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return w * xf.to(x.dtype)


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half RoPE on [heads, n, head_dim] with cos/sin [n, head_dim]."""
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    return x * cos + torch.cat((-x2, x1), dim=-1) * sin
