"""Open a local model — GGUF file or Hugging Face directory — as a ModelSource."""

from __future__ import annotations

import os
from pathlib import Path

from decoding.errors import ModelLoadError
from decoding.loader.source import ModelSource

GGUF_MAGIC = b"GGUF"


def open_model(path: str | os.PathLike | None = None) -> ModelSource:
    """``None`` means the embedded default model from the local cache."""
    from meshd.model_store import resolve_model

    p = Path(resolve_model(path))
    if p.is_dir():
        from decoding.loader.hf_source import HFDirSource

        return HFDirSource(p)
    if not p.is_file():
        raise ModelLoadError(f"{p}: not a file or directory")
    with open(p, "rb") as f:
        magic = f.read(4)
    if magic == GGUF_MAGIC:
        from decoding.loader.gguf_source import GGUFSource

        return GGUFSource(p)
    raise ModelLoadError(
        f"{p}: unrecognised model format (expected a GGUF file or a Hugging Face directory; "
        f"file starts with {magic!r})")


__all__ = ["open_model", "ModelSource"]
