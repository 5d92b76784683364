"""A token embedding kept as the file stores it: a lookup widens only the rows it is asked for.

The embedding is the largest matrix a first stage holds (Qwen2.5-1.5B: 152k x
1536) and each step reads one row of it per token, so widening it all to
bfloat16 would cost several times its file bytes for nothing.
"""

from __future__ import annotations

import numpy as np
import torch


class QuantRows:
    def __init__(self, type_name: str, raw: torch.Tensor, cols: int, dtype: torch.dtype):
        self.type_name, self.raw, self.cols, self.dtype = type_name, raw, cols, dtype

    @property
    def shape(self) -> tuple[int, int]:
        return (int(self.raw.shape[0]), self.cols)

    @property
    def device(self) -> torch.device:
        return self.raw.device

    @property
    def nbytes(self) -> int:
        return self.raw.numel()

    def lookup(self, ids: torch.Tensor) -> torch.Tensor:
        """[n, cols] rows for token ids [n], in the stage's dtype."""
        import gguf

        rows = self.raw[ids.reshape(-1)].numpy()
        qtype = gguf.GGMLQuantizationType[self.type_name]
        values = np.asarray(gguf.quants.dequantize(rows, qtype), dtype=np.float32).reshape(-1, self.cols)
        return torch.from_numpy(values).to(self.dtype)
