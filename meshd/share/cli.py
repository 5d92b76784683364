"""What ``meshd model list`` and ``meshd model gc`` show and do with the models fetched from the home.

Fetched models live in the daemon's state dir (``models/<sha256>/``), whole or
partial; a daemon that runs one says so in its status (``sharing.sha256``), and
that one is never collected.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from meshd.share.store import ModelCache
from meshd.state import RUNTIME_FILE


def state_dir(explicit: str | None) -> Path:
    from meshd.config import load_config

    if explicit:
        return Path(explicit).expanduser()
    return load_config(None, os.environ).resolved_state_dir()


def cache_of(state: Path) -> ModelCache:
    return ModelCache(state / "models")


def shared_models(state: Path) -> list[dict[str, Any]]:
    return [e.describe() for e in cache_of(state).entries()]


def in_use(state: Path) -> tuple[set[str], str]:
    """(sha256s the running daemon of this state dir uses, how we know)."""
    from meshd.client import MeshdClient
    from meshd.errors import MeshdError

    try:
        runtime = json.loads((state / RUNTIME_FILE).read_text())
    except (OSError, ValueError):
        return set(), "no daemon runs on this state dir"
    try:
        status = MeshdClient(runtime.get("socket"), timeout=5.0).status()
    except (MeshdError, OSError) as exc:
        return set(), f"its daemon did not answer ({exc}); treating nothing as in use"
    sha = (status.get("sharing") or {}).get("sha256")
    return ({sha} if sha else set()), "the running daemon's model"


def describe_line(m: dict[str, Any]) -> str:
    held, size = m["held_bytes"], m["size_bytes"]
    if m["complete"]:
        what = "whole file, sha256 verified"
    else:
        layers = ",".join(f"{a}-{b - 1}" for a, b in m["layers"]) or "none"
        extra = f" + {', '.join(m['tensors'])}" if m["tensors"] else ""
        what = f"partial: layers {layers}{extra} (pieces verified)"
    return (f"{m['name']:<48} {held / 1e6:8.1f} / {size / 1e6:.1f} MB ({held / size:.0%}) "
            f"{what}, {m['disk_bytes'] / 1e6:.1f} MB on disk  {m['path']}")


def gc(state: Path, dry_run: bool = False) -> dict[str, Any]:
    keep, why = in_use(state)
    cache = cache_of(state)
    removed, kept, freed = [], [], 0
    for e in cache.entries():
        sha = e.manifest.sha256
        if sha in keep:
            kept.append({"name": e.manifest.name, "sha256": sha, "reason": why})
            continue
        removed.append({"name": e.manifest.name, "sha256": sha, "held_bytes": e.held_bytes()})
        if not dry_run:
            freed += cache.remove(sha)
    return {"removed": removed, "kept": kept, "freed_bytes": freed, "dry_run": dry_run, "in_use": why}

