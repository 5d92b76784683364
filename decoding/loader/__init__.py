"""Open a local model — GGUF file or Hugging Face directory — as a ModelSource."""

from __future__ import annotations

import os
from pathlib import Path

from decoding.errors import ModelLoadError
from decoding.loader.source import ModelSource

GGUF_MAGIC = b"GGUF"


def open_model(path: str | os.PathLike, *, cache_dir: str | os.PathLike | None = None) -> ModelSource:
    """Open the model at ``path`` (a GGUF file or a Hugging Face directory).

    The loader only opens paths: which model is "the default" and where it is
    cached is the application's business (``meshd.model.store.open_model``
    resolves it, then calls this). ``cache_dir`` is where a GGUF's converted
    tokenizer and content hash are kept between runs; without one they are
    recomputed each time the model is opened.
    """
    if path is None or str(path) == "":
        raise ModelLoadError("no model path given (resolve the default model before opening it)")
    p = Path(path).expanduser()
    if p.is_dir():
        from decoding.loader.hf_source import HFDirSource

        return HFDirSource(p)
    if not p.is_file():
        raise ModelLoadError(f"{p}: not a file or directory")
    with open(p, "rb") as f:
        magic = f.read(4)
    if magic == GGUF_MAGIC:
        from decoding.loader.gguf_source import GGUFSource

        return GGUFSource(p, cache_root=Path(cache_dir) if cache_dir is not None else None)
    raise ModelLoadError(
        f"{p}: unrecognised model format (expected a GGUF file or a Hugging Face directory; "
        f"file starts with {magic!r})")


__all__ = ["open_model", "ModelSource"]
