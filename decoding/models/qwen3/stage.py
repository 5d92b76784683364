"""A Qwen3 stage: the Llama family's stage and loader, each layer then given its head norms.

The forward is Llama's: its block asks each layer's weights to normalise the
query and key heads (``LayerWeights.norm_heads``), which Qwen3's layers do. The
loader is Llama's too (dense or packed, biases absent from the file and so
off); the norms, [head_dim] each, are read afterwards and held in the stage's
dtype on its device in every numeric mode, like the other norms.
"""

from __future__ import annotations

from dataclasses import fields

import torch

from decoding.models import llama
from decoding.models.llama.loader import load_stage
from decoding.models.qwen3.layers import Qwen3LayerWeights


class StageModel(llama.StageModel):
    @classmethod
    def from_source(cls, source, first: int, end: int, dtype: torch.dtype = torch.float32,
                    device: torch.device | str | None = None, packed: str | bool = "") -> "StageModel":
        """Load ``[first, end)`` from ``source`` (see ``decoding.models.llama.loader.load_stage``)."""
        stage = load_stage(cls, source, first, end, dtype, device, packed)
        stage.layers = [with_head_norms(lw, source, i, stage.device, dtype)
                        for i, lw in zip(range(first, end), stage.layers)]
        return stage


def with_head_norms(lw: llama.LayerWeights, source, index: int, device: torch.device,
                    dtype: torch.dtype) -> Qwen3LayerWeights:
    """Layer ``index``'s weights ``lw`` with its query and key head norms read from ``source``."""
    def read(name: str) -> torch.Tensor:
        return source.read_tensor(f"layers.{index}.{name}").to(device=device, dtype=dtype).contiguous()

    return Qwen3LayerWeights(**{f.name: getattr(lw, f.name) for f in fields(lw)},
                             q_norm=read("q_norm"), k_norm=read("k_norm"))
