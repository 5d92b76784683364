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


def as_mode(data: dict[str, Any] | None, weights: str) -> dict[str, Any] | None:
    """A profile measured in another numeric mode, planned as ``weights``: its layer times are kept
    (the nearest guess there is until the device measures itself), its KV cache and activations are
    sized for ``weights`` (a gguf stage's cache is float32, twice a packed one's), and it says so in
    ``planned_as``. The profile as it is when it already is of ``weights`` (or no mode is asked)."""
    from partition.profile import DTYPE_BYTES

    if not data or not weights or data.get("dtype") == weights or weights not in DTYPE_BYTES:
        return data
    measured = str(data.get("dtype") or "float32")
    ratio = DTYPE_BYTES[weights] / DTYPE_BYTES.get(measured, 4)
    out = dict(data, dtype=weights, planned_as={"measured_in": measured, "kv_and_activations_x": ratio})
    out["kv_bytes_per_token_per_layer"] = int(round(data.get("kv_bytes_per_token_per_layer", 0) * ratio))
    return out
