"""What every model format must provide: a config, named tensors on demand, a tokenizer.

Stages ask only for the tensors of their layer range, so a device holding layers
[10, 20) never materialises the others (memory per stage ~ its share of the model).
Tensors are asked for by canonical name; the architecture's family says what
they are (``decoding.models.llama.names``) and builds the stage.
"""

from __future__ import annotations

import abc
from functools import cached_property
from pathlib import Path

import torch

from decoding.config import ModelConfig

class ModelSource(abc.ABC):
    """A model on local disk. Subclasses read one file format."""

    path: Path

    @property
    @abc.abstractmethod
    def config(self) -> ModelConfig: ...

    @abc.abstractmethod
    def read_tensor(self, name: str) -> torch.Tensor:
        """One canonical tensor as float32 (dequantised if needed)."""

    def has_tensor(self, name: str) -> bool:
        return True

    @abc.abstractmethod
    def rope_freq_factors(self) -> torch.Tensor | None:
        """Per-dimension RoPE frequency divisors shipped with the weights (llama3 GGUF), if any."""

    @abc.abstractmethod
    def _load_tokenizer(self): ...

    @property
    @abc.abstractmethod
    def identity(self) -> str:
        """A stable id of these exact weights (for profiles and plan agreement)."""

    @cached_property
    def tokenizer(self):
        return self._load_tokenizer()

    def load_stage(self, first: int, end: int, dtype: torch.dtype = torch.float32,
                   device: torch.device | str | None = None, packed: str | bool = ""):
        """Decoder layers ``[first, end)`` (+ embedding when ``first == 0``, head when ``end`` is the last),
        in ``dtype`` on ``device`` (default: the CPU); ``packed``: the packing of its matrices ("packed", "packed4"; ``decoding.device.PACKINGS``)."""
        from decoding.models import load_stage

        return load_stage(self, first, end, dtype, device, packed)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.path})"
