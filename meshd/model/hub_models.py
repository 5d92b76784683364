"""Models from the Hugging Face Hub by name: ``hf:OWNER/REPO[:QUANT|/FILE.gguf]`` and a short curated list.

Ollama's users type ``ollama pull qwen3:8b``; ours type ``meshd model pull qwen3:8b``. This
module only names things (no network, nothing imported that reaches one): which repository
and files a reference means, where a pulled copy lives under the model cache, and what the
curated models are known for. ``meshd.model.hub_pull`` fetches; ``meshd.model.store`` resolves a
reference to the local copy when a daemon starts.

The command-success figures are Home Assistant's own published evaluation of local models
(the ``home-assistant-datasets`` *assist-mini* set), except where ``figure_source`` says they
are our benchmark's (``bench/ha_commands.py``).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from decoding.loader.gguf_split import parse_name
from meshd.errors import MeshdError

HF_PREFIX = "hf:"
DEFAULT_QUANT = "Q4_K_M"
HA_EVAL = "Home Assistant assist-mini"  # home-assistant-datasets, the published local-model evaluation
OUR_BENCH = "meshd bench/ha_commands.py"


class BadModelRef(MeshdError):
    """A model reference that names no repository or file we can use."""


@dataclass(frozen=True)
class HubRef:
    """What one ``hf:`` reference asks for: a repository and either a quant tag or one file."""

    repo: str  # OWNER/REPO
    quant: str = ""  # a tag the file name contains (case-insensitive), e.g. Q4_K_M
    file: str = ""  # an exact file in the repository (a split set's any part)

    def __str__(self) -> str:
        tail = f"/{self.file}" if self.file else f":{self.quant}" if self.quant else ""
        return f"{HF_PREFIX}{self.repo}{tail}"


@dataclass(frozen=True)
class CommandSuccess:
    """A published share of Home Assistant commands a model got right, and whose figure it is."""

    percent: float
    model: str  # the model the figure was measured on (it may be a sibling of the file we pull)
    source: str = HA_EVAL


@dataclass(frozen=True)
class HubModel:
    """A curated model: Ollama-style name, the official GGUF repository and its Q4_K_M file."""

    name: str
    repo: str
    approx_size: int  # bytes of the Q4_K_M file(s) as published (the Hub's own figure is used when pulling)
    success: CommandSuccess | None
    note: str = ""

    @property
    def ref(self) -> HubRef:
        return HubRef(self.repo, quant=DEFAULT_QUANT)


CURATED: dict[str, HubModel] = {m.name: m for m in (
    HubModel("qwen3:4b", "Qwen/Qwen3-4B-GGUF", 2_500_000_000,
             CommandSuccess(86.7, "Qwen3-4B-Instruct"),
             note="the figure is for the Instruct (non-thinking) variant"),
    HubModel("qwen3:8b", "Qwen/Qwen3-8B-GGUF", 5_030_000_000, CommandSuccess(93.4, "Qwen3-8B")),
    HubModel("qwen2.5:7b", "Qwen/Qwen2.5-7B-Instruct-GGUF", 4_680_000_000,
             CommandSuccess(88.3, "Qwen2.5-7B"), note="published as a 2-part split GGUF"),
    HubModel("llama3.2:3b", "bartowski/Llama-3.2-3B-Instruct-GGUF", 2_020_000_000,
             CommandSuccess(82.0, "Llama-3.2-3B")),
)}

# Published figures for models by their family name, for `meshd model list`/`advise` and the README.
PUBLISHED: tuple[CommandSuccess, ...] = (
    CommandSuccess(93.4, "Qwen3-8B"),
    CommandSuccess(88.3, "Qwen2.5-7B"),
    CommandSuccess(86.7, "Qwen3-4B-Instruct"),
    CommandSuccess(82.0, "Llama-3.2-3B"),
    CommandSuccess(70.9, "Qwen2.5-3B"),
    CommandSuccess(60.2, "Qwen3-1.7B"),
    CommandSuccess(48.0, "Qwen2.5-Coder-1.5B", OUR_BENCH),
    CommandSuccess(24.5, "Qwen2.5-0.5B"),
)

_REPO = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*/[A-Za-z0-9][A-Za-z0-9_.-]*$")
_QUANT = re.compile(r"^[A-Za-z0-9_.-]+$")


def is_hub_ref(text: str | None) -> bool:
    """Does ``text`` name a Hub model (an ``hf:`` reference or a curated name)?"""
    return bool(text) and (str(text).startswith(HF_PREFIX) or str(text) in CURATED)


def parse_ref(text: str) -> HubRef:
    """``hf:OWNER/REPO``, ``hf:OWNER/REPO:QUANT``, ``hf:OWNER/REPO/FILE.gguf`` or a curated name.

    A bare repository means its Q4_K_M file(s), as for the curated names.
    """
    if text in CURATED:
        return CURATED[text].ref
    if not text.startswith(HF_PREFIX):
        raise BadModelRef(f"{text!r} is not a Hub model (use hf:OWNER/REPO[:QUANT|/FILE.gguf] or one of "
                          f"{', '.join(CURATED)})")
    body = text[len(HF_PREFIX):]
    owner, _, rest = body.partition("/")
    repo_name, sep, tail = rest.partition("/")
    if sep:  # hf:OWNER/REPO/FILE.gguf (the file may sit in a folder)
        ref = HubRef(f"{owner}/{repo_name}", file=tail)
        if not tail.endswith(".gguf") or ".." in tail.split("/"):
            raise BadModelRef(f"{text}: the file must be a .gguf file in the repository")
    else:
        repo_name, _, quant = repo_name.partition(":")
        ref = HubRef(f"{owner}/{repo_name}", quant=quant or DEFAULT_QUANT)
        if not _QUANT.match(ref.quant):
            raise BadModelRef(f"{text}: {ref.quant!r} is not a quant tag (e.g. Q4_K_M)")
    if not _REPO.match(ref.repo):
        raise BadModelRef(f"{text}: {ref.repo!r} is not OWNER/REPO")
    return ref


def pick_files(ref: HubRef, files: list[str]) -> list[str]:
    """The repository files ``ref`` means: one GGUF, or every part of one split set, in order.

    ``files``: the repository's file names. A quant tag must pick exactly one model (a
    single file or one split set); several candidates are listed in the error.
    """
    ggufs = [f for f in files if f.endswith(".gguf")]
    if ref.file:
        if ref.file not in ggufs:
            raise BadModelRef(f"{ref}: the repository has no file {ref.file}")
        wanted = [ref.file]
    else:
        tag = ref.quant.lower()
        wanted = [f for f in ggufs if _has_tag(f, tag) and "mmproj" not in f.lower()]
        if not wanted:
            raise BadModelRef(f"{ref}: no .gguf file in {ref.repo} has {ref.quant} in its name "
                              f"(it has: {', '.join(sorted(ggufs)) or 'none'})")
    sets = {_set_key(f) for f in wanted}
    if len(sets) > 1:
        raise BadModelRef(f"{ref}: {ref.quant or ref.file} matches several models in {ref.repo}: "
                          f"{', '.join(sorted(wanted))}; name one with hf:{ref.repo}/FILE.gguf")
    (key,) = sets
    members = sorted(f for f in ggufs if _set_key(f) == key)
    split = parse_name(Path(members[0]).name)
    if split is not None and split.count > 1 and len(members) != split.count:
        raise BadModelRef(f"{ref}: the repository holds {len(members)} of the {split.count} parts of "
                          f"{key}")
    return members


def _has_tag(name: str, tag: str) -> bool:
    """``tag`` in the file name as a whole word of it (Q4_K does not pick Q4_K_M)."""
    low = Path(name).name.lower()
    return re.search(rf"(?<![a-z0-9]){re.escape(tag)}(?![a-z0-9_])", low) is not None


def _set_key(name: str) -> str:
    """A split part's set (folder and stem), or the file itself."""
    split = parse_name(Path(name).name)
    if split is None or split.count == 1:
        return name
    return str(Path(name).parent / split.stem)


def repo_dir(models_dir: Path, repo: str) -> Path:
    """Where a repository's pulled files live under the model cache."""
    return Path(models_dir) / "hub" / repo.replace("/", "--")


def local_files(models_dir: Path, ref: HubRef) -> list[Path]:
    """The pulled (verified) copy of what ``ref`` names, first part first; [] when not pulled.

    Offline: only what an earlier pull left, so a daemon starts without reaching the Hub.
    """
    d = repo_dir(models_dir, ref.repo)
    if not d.is_dir():
        return []
    names = [str(p.relative_to(d)) for p in d.rglob("*.gguf") if p.is_file()]
    try:
        return [d / f for f in pick_files(ref, names)]
    except BadModelRef:
        return []


def success_for(model_name: str) -> CommandSuccess | None:
    """The published command success of the model a file or catalog name is (by family and size)."""
    low = model_name.lower().replace("_", "-")
    for fig in sorted(PUBLISHED, key=lambda f: -len(f.model)):
        want = fig.model.lower().replace("-instruct", "")
        if want in low and ("coder" in low) == ("coder" in want):
            return fig
    return None


__all__ = ["HubRef", "HubModel", "CommandSuccess", "CURATED", "PUBLISHED", "BadModelRef", "is_hub_ref",
           "parse_ref", "pick_files", "repo_dir", "local_files", "success_for", "DEFAULT_QUANT"]
