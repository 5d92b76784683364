"""Device profile files in a folder (a state dir's, the shipped ones): read, told apart by model and by mode.

Apart from the state directory because profiles are read from more than one place
(``meshd.mesh.home_plan`` reads the shipped folder too), and a profile only guides plans: an
unreadable file is passed over, never an error.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any


def read_profiles(directory: Path, newest_first: bool = False) -> Iterator[tuple[Path, dict[str, Any]]]:
    """The readable profile files in ``directory`` (by name, or newest first), parsed; the
    unreadable ones (half-copied, not JSON) are passed over, since a profile only guides plans."""
    if not directory.is_dir():
        return
    files = sorted(directory.glob("*.json"))
    if newest_first:
        files.sort(key=lambda p: p.stat().st_mtime, reverse=True)
    for path in files:
        try:
            data = json.loads(path.read_text())
        except (OSError, ValueError):
            continue
        if isinstance(data, dict):
            yield path, data


def profile_model(data: dict[str, Any]) -> str | None:
    """The identity of the model a profile (as a plain dict) was measured on."""
    return (data.get("model") or {}).get("identity")


#: A mode without a profile of its own is planned with the nearest one's: the gguf mode holds about the
#: file's bytes, as packed does (float32 holds four to eight times them).
NEAREST_MODE = {"gguf": "packed", "packed4": "packed"}


def prefer_mode(items: list, weights: str, profile_of):
    """The first of ``items`` whose profile (``profile_of(item)``) was measured in ``weights``, else in
    the nearest mode (:data:`NEAREST_MODE`), else the first float32 one (profiles before modes had
    names), else the first; None for none."""
    for want in (weights, NEAREST_MODE.get(weights, ""), "float32"):
        hit = next((it for it in items if want and profile_of(it).get("dtype") == want), None)
        if hit is not None:
            return hit
    return items[0] if items else None
