"""``meshd model pull hf:…``: fetch GGUF files from the Hugging Face Hub, resumably, sha256-checked.

Only this module talks to the Hub, and only when a user runs a pull: nothing here runs at
import or when a daemon starts (``meshd.model.hub_models.local_files`` finds what a pull left).

How one pull goes, with ``huggingface_hub`` doing the talking:

1. The repository's metadata at its current commit (``model_info(files_metadata=True)``):
   its files, and for each LFS file its size and sha256.
2. ``meshd.model.hub_models.pick_files`` turns the reference into files: one GGUF or every
   part of a split set.
3. Each file is fetched from that same commit into ``<models>/hub/OWNER--REPO/FILE.incomplete``
   with ``huggingface_hub``'s ``http_get`` (its progress bar, its retries with a Range
   request after a dropped connection). The partial file stays on disk when a pull fails,
   so the next pull resumes it rather than starting again.
4. The whole file's sha256 must equal the Hub's; only then is it renamed into place and
   recorded as verified. A mismatch deletes the partial file: a bad download is never
   kept as the model.

``HF_ENDPOINT`` (a mirror, or a stand-in in tests) and ``HF_TOKEN`` (gated or private
repositories) are read when the pull runs. A Hub that cannot be reached is one line.
"""

from __future__ import annotations

import fcntl
import json
import os
import sys
from dataclasses import dataclass
from pathlib import Path

from meshd.errors import MeshdError
from meshd.model.hub_models import HubRef, parse_ref, pick_files, repo_dir
from meshd.log import get_logger

log = get_logger("meshd.model.hub_pull")

VERIFIED = ".verified.json"  # in each repository's folder: file -> {sha256, size, mtime_ns}


class HubUnavailable(MeshdError):
    """The Hub could not be reached, or refused what was asked (one line for the user)."""


class HashMismatch(MeshdError):
    """A downloaded file's sha256 differs from the Hub's: it was deleted, not kept."""


@dataclass(frozen=True)
class HubFile:
    name: str  # path in the repository
    size: int
    sha256: str


@dataclass(frozen=True)
class Pulled:
    ref: HubRef
    commit: str
    paths: tuple[Path, ...]  # first part first
    size: int
    fetched: int  # files downloaded by this pull (0: all were already cached)

    @property
    def path(self) -> Path:
        return self.paths[0]


def endpoint() -> str | None:
    """The Hub endpoint the user set (``HF_ENDPOINT``), else None: huggingface_hub's own default."""
    return os.environ.get("HF_ENDPOINT", "").rstrip("/") or None


def pull(text: str, models_dir: Path, quiet: bool = False) -> Pulled:
    """Fetch what ``text`` (``hf:…`` or a curated name) names into ``models_dir``; see the module doc."""
    ref = parse_ref(text)
    commit, files = _repository(ref)
    chosen = pick_files(ref, [f.name for f in files])
    by_name = {f.name: f for f in files}
    d = repo_dir(models_dir, ref.repo)
    paths, fetched = [], 0
    for name in chosen:
        f = by_name[name]
        dest = d / name
        if not _verified(dest, f):
            _download(ref, commit, f, dest, quiet)
            fetched += 1
        paths.append(dest)
    log.info("hub_pulled", ref=str(ref), commit=commit, files=chosen, fetched=fetched)
    return Pulled(ref, commit, tuple(paths), sum(by_name[n].size for n in chosen), fetched)


# -- the Hub's metadata ---------------------------------------------------------------
def _repository(ref: HubRef) -> tuple[str, list[HubFile]]:
    """The repository's current commit and its LFS files with their sizes and sha256s."""
    from huggingface_hub import HfApi

    where = endpoint() or "the Hugging Face Hub"
    try:
        info = HfApi(endpoint=endpoint()).model_info(ref.repo, files_metadata=True)
    except Exception as exc:  # noqa: BLE001 -- every failure becomes one line naming its kind
        raise _one_line(exc, ref, where) from None
    files = []
    for s in info.siblings or []:
        if s.lfs is not None and s.rfilename.endswith(".gguf"):
            files.append(HubFile(s.rfilename, int(s.lfs.size), str(s.lfs.sha256).lower()))
    if not info.sha:
        raise HubUnavailable(f"{ref}: {where} gave no commit for {ref.repo}")
    return str(info.sha), files


def _one_line(exc: Exception, ref: HubRef, where: str) -> MeshdError:
    from huggingface_hub import errors

    if isinstance(exc, errors.GatedRepoError):
        return HubUnavailable(f"{ref}: {ref.repo} is gated: accept its terms on the Hub and set HF_TOKEN")
    if isinstance(exc, errors.RepositoryNotFoundError):
        return HubUnavailable(f"{ref}: no repository {ref.repo} on {where} (private ones need HF_TOKEN)")
    if isinstance(exc, errors.RevisionNotFoundError):
        return HubUnavailable(f"{ref}: {ref.repo} has no such revision on {where}")
    if isinstance(exc, errors.HfHubHTTPError):
        status = getattr(getattr(exc, "response", None), "status_code", "?")
        return HubUnavailable(f"{ref}: {where} answered HTTP {status} for {ref.repo}")
    reason = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    return HubUnavailable(f"{ref}: cannot reach {where} ({reason})")


# -- one file -------------------------------------------------------------------------
def _download(ref: HubRef, commit: str, f: HubFile, dest: Path, quiet: bool) -> None:
    from huggingface_hub import hf_hub_url
    from huggingface_hub.file_download import http_get
    from huggingface_hub.utils import build_hf_headers

    dest.parent.mkdir(parents=True, exist_ok=True)
    partial = dest.with_name(dest.name + ".incomplete")
    url = hf_hub_url(ref.repo, f.name, revision=commit, endpoint=endpoint())
    with open(partial, "ab") as out:
        try:  # two pulls appending to one partial file would only make a file that fails its hash
            fcntl.flock(out, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            raise HubUnavailable(f"{ref}: another pull of {f.name} is running") from None
        have = out.tell()
        if have > f.size:  # not this file's beginning: start over
            out.truncate(0)
            have = 0
        if have:
            log.info("hub_pull_resumed", file=f.name, have=have, size=f.size)
        try:
            http_get(url, out, resume_size=have, headers=build_hf_headers(), expected_size=f.size,
                     displayed_filename=Path(f.name).name, tqdm_class=_silent_bar if quiet else _bar)
        except Exception as exc:  # noqa: BLE001 -- kept for the next pull to resume; one line
            out.flush()
            kept = out.tell()
            reason = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            raise HubUnavailable(f"{ref}: download of {f.name} stopped at {kept} of {f.size} bytes ({reason}); "
                                 f"run the same pull again to resume") from None
    from decoding.loader.files import sha256_of

    if not quiet and f.size >= 1 << 30:  # a few GB take a while to hash: say what the wait is
        print(f"checking {Path(f.name).name} against the Hub's sha256 ...", file=sys.stderr, flush=True)
    got = sha256_of(partial)
    if got != f.sha256:
        partial.unlink(missing_ok=True)
        raise HashMismatch(f"{ref}: {f.name} does not match the Hub's sha256 (got {got[:16]}…, "
                           f"expected {f.sha256[:16]}…); the download was deleted")
    os.replace(partial, dest)
    _record(dest, f)


def _verified(dest: Path, f: HubFile) -> bool:
    """``dest`` is this exact file, hashed when it was written (and untouched since)."""
    try:
        rec = json.loads((dest.parent / VERIFIED).read_text()).get(dest.name)
        st = dest.stat()
    except (OSError, ValueError):
        return False
    return bool(rec) and rec.get("sha256") == f.sha256 and st.st_size == f.size == rec.get("size") \
        and rec.get("mtime_ns") == st.st_mtime_ns


def _record(dest: Path, f: HubFile) -> None:
    from meshd.state import atomic_write

    path = dest.parent / VERIFIED
    try:
        doc = json.loads(path.read_text())
    except (OSError, ValueError):
        doc = {}
    doc[dest.name] = {"sha256": f.sha256, "size": f.size, "mtime_ns": dest.stat().st_mtime_ns}
    atomic_write(path, json.dumps(doc, indent=1, sort_keys=True).encode(), mode=0o644)


def _bar(**kwargs):
    """``tqdm_class`` for the download bar: huggingface_hub calls a non-class with the bar's keywords.
    Our own, so it does not depend on how logging is set up: on stderr, shown on a terminal only."""
    from tqdm import tqdm

    return tqdm(file=sys.stderr, disable=None, **kwargs)


def _silent_bar(**kwargs):
    """``tqdm_class`` for --quiet."""
    from tqdm import tqdm

    return tqdm(disable=True, **kwargs)


__all__ = ["pull", "Pulled", "HubUnavailable", "HashMismatch", "endpoint"]
