"""File helpers of the loader: content hashing, shared with whoever caches models.

Where caches live is the caller's decision: ``open_model(path, cache_dir=...)``
takes the directory (``meshd.model.store`` passes one under ``$MESHD_HOME``).
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path


def sha256_of(path: str | os.PathLike) -> str:
    """Hex SHA-256 of a file's content, read in 1 MiB blocks."""
    return sha256_of_files([path])


def sha256_of_files(paths) -> str:
    """Hex SHA-256 of several files' contents, concatenated in order.

    A split GGUF set is one model: its hash covers every part, so a changed or
    reordered part changes it (and one part's hash is that file's ``sha256_of``).
    """
    h = hashlib.sha256()
    for path in paths:
        with open(Path(path), "rb") as f:
            for block in iter(lambda: f.read(1 << 20), b""):
                h.update(block)
    return h.hexdigest()


__all__ = ["sha256_of", "sha256_of_files"]
