"""A Qwen3 layer's weights: a Llama layer's, and the RMSNorms its queries and keys get per head."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from decoding.linear import nbytes
from decoding.models.llama.layers import LayerWeights, rms_norm


@dataclass
class Qwen3LayerWeights(LayerWeights):
    q_norm: torch.Tensor  # [head_dim], shared by every query head
    k_norm: torch.Tensor  # [head_dim], shared by every key head
    #: tensors every head uses alike: a tensor-parallel member keeps them whole
    shared_by_heads = ("q_norm", "k_norm")

    def nbytes(self) -> int:
        return super().nbytes() + nbytes(self.q_norm) + nbytes(self.k_norm)

    def norm_heads(self, q: torch.Tensor, k: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
        """Each head's query and key RMS-normalised over its head_dim, before RoPE (as transformers' Qwen3)."""
        return rms_norm(q, self.q_norm, eps), rms_norm(k, self.k_norm, eps)
