"""Files of small trained heads (Medusa drafting heads, early-exit heads): written atomically, read safely.

A heads file holds plain tensors, ints, strings and lists, and is read with
``torch.load(weights_only=True)``: a file from elsewhere can never run code. A
sha256 pin (``meshd.model.heads``) guards a shipped one — a damaged install or a file
swapped after training is refused before it is even unpickled.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch

from decoding.errors import DrafterError
from decoding.loader.files import sha256_of


def write_heads_file(path, state: dict[str, Any]) -> str:
    """Write ``state`` atomically; returns the file's sha256 (pin it where the file ships)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".partial")
    torch.save(state, tmp)
    os.replace(tmp, path)
    return sha256_of(path)


def read_heads_file(path, sha256: str | None, what: str) -> tuple[Path, Any]:
    """The unpickled contents of a ``what`` file (e.g. "Medusa heads"), checked against ``sha256`` if given;
    ``DrafterError`` says why it cannot be used."""
    path = Path(path)
    if not path.is_file():
        raise DrafterError(f"{what} file not found: {path}")
    if sha256 is not None:
        digest = sha256_of(path)
        if digest != sha256.lower():
            raise DrafterError(f"{path}: sha256 mismatch (file {digest}, expected {sha256.lower()}); "
                               f"the {what} file is damaged or not the one that was shipped")
    try:
        return path, torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:  # noqa: BLE001 - unpickling errors come in many types; all mean "not a heads file"
        raise DrafterError(f"{path}: not a readable {what} file ({type(exc).__name__}: {exc})") from exc


__all__ = ["read_heads_file", "write_heads_file"]
