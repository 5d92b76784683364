"""Model code per architecture, in the manner of Petals' ``models/<arch>/``, and the registry that picks it.

A family folder holds everything that knows its architecture: the flags
(tied embeddings, q/k/v biases, RoPE theta and scaling, llama.cpp's q/k
permutation), the tensor names of each file format, the loader (dense or
packed) and the forward. Everything else in ``decoding`` is generic: the file
readers (``decoding.loader``) ask this registry which family reads a file,
and the scheduler, KV cache, attention and packed matrices never ask at all.
"""

from __future__ import annotations

from types import ModuleType

import torch

from decoding.models import llama, qwen3

#: Every family folder, each naming the architectures it runs.
FAMILIES: tuple[ModuleType, ...] = (llama, qwen3)

_BY_GGUF_ARCH: dict[str, ModuleType] = {arch: fam for fam in FAMILIES for arch in fam.GGUF_ARCHS}
_BY_HF_MODEL_TYPE: dict[str, tuple[str, ModuleType]] = {
    model_type: (arch, fam) for fam in FAMILIES for model_type, arch in fam.HF_MODEL_TYPES.items()}

#: Architecture names (GGUF ``general.architecture``) a stage can run.
SUPPORTED_ARCHS = tuple(_BY_GGUF_ARCH)

#: The stage type every family builds: Llama's, or a subclass of it (Qwen3's adds its head norms).
StageModel = llama.StageModel


def family(arch: str) -> ModuleType | None:
    """The family package that runs ``arch`` (a GGUF architecture or a config's ``arch``), None if none."""
    return _BY_GGUF_ARCH.get(arch)


def hf_family(model_type: str) -> tuple[str, ModuleType] | None:
    """(architecture, family) for a Hugging Face ``model_type``, None if no family runs it."""
    return _BY_HF_MODEL_TYPE.get(model_type)


def load_stage(source, first: int, end: int, dtype: torch.dtype = torch.float32,
               device: torch.device | str | None = None, packed: str | bool = ""):
    """Decoder layers ``[first, end)`` of ``source``, built by its architecture's family."""
    return family(source.config.arch).StageModel.from_source(source, first, end, dtype, device, packed)


__all__ = ["FAMILIES", "SUPPORTED_ARCHS", "StageModel", "family", "hf_family", "load_stage"]
