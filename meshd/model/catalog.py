"""Every model meshd fetches by name, from either source, as one list (``meshd model list`` / ``advise``).

Two kinds: the curated Hub models (``qwen3:8b`` …; ``meshd.model.hub_models``) and the package-index
catalog (``qwen2.5-coder-1.5b-instruct`` …; ``meshd.model.store``), the offline path. Each row
carries its file size and its published Home Assistant command success, and whether this
device already holds it. Nothing here reaches a network: sizes of Hub models not yet pulled
are the published ones (the Hub's own figure is used when pulling).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from meshd.model import hub_models, store as model_store
from meshd.model.hub_models import CommandSuccess


@dataclass(frozen=True)
class CatalogRow:
    name: str  # what `meshd model pull` and `--model` take
    source: str  # "hub Qwen/Qwen3-8B-GGUF (Q4_K_M)" or "package index (22 wheels)"
    size_bytes: int
    exact_size: bool  # False: the published approximate size of a Hub file not pulled here
    success: CommandSuccess | None
    pulled: bool
    note: str = ""


def rows(models_dir: Path | None = None) -> list[CatalogRow]:
    """The curated Hub models, then the package-index catalog, best command success first within each."""
    d = models_dir or model_store.models_dir()
    hub = []
    for m in hub_models.CURATED.values():
        files = hub_models.local_files(d, m.ref)
        size = sum(p.stat().st_size for p in files)
        hub.append(CatalogRow(m.name, f"hub {m.repo} ({m.ref.quant})", size or m.approx_size, bool(files),
                              m.success, bool(files), m.note))
    index = [CatalogRow(m.name, f"package index ({len(m.wheels)} wheels)", m.size, True,
                        hub_models.success_for(m.name), model_store.is_named_pulled(m.name), m.advice)
             for m in model_store.CATALOG.values()]
    key = lambda r: -(r.success.percent if r.success else -1.0)  # noqa: E731
    return sorted(hub, key=key) + sorted(index, key=key)


def pulled_hub_files(models_dir: Path | None = None) -> list[dict]:
    """GGUFs pulled from the Hub (any repository), one entry per model (a split set once)."""
    from decoding.loader.gguf_split import parse_name

    root = (models_dir or model_store.models_dir()) / "hub"
    out = []
    if not root.is_dir():
        return out
    for repo in sorted(p for p in root.iterdir() if p.is_dir()):
        owner_repo = repo.name.replace("--", "/", 1)
        for f in sorted(repo.rglob("*.gguf")):
            split = parse_name(f.name)
            if split is not None and split.no != 1:
                continue
            parts = [f] if split is None else sorted(f.parent.glob(f"{split.stem}-*-of-{split.count:05d}.gguf"))
            rel = str(f.relative_to(repo))
            fig = hub_models.success_for(f.name)
            out.append({"name": f"hf:{owner_repo}/{rel}", "path": str(f), "parts": len(parts),
                        "size_bytes": sum(p.stat().st_size for p in parts),
                        "command_success": None if fig is None else {"percent": fig.percent, "model": fig.model,
                                                                     "source": fig.source}})
    return out


__all__ = ["CatalogRow", "rows", "pulled_hub_files"]
