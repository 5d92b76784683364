"""GGUF models (llama.cpp format): memory-mapped, dequantised per tensor on demand.

What the tensors are called, how the config is read from the metadata and
which q/k rows llama.cpp permuted belong to the architecture's family
(``decoding.models``); this module only reads the file.
"""

from __future__ import annotations

import hashlib
import json
from functools import cached_property
from pathlib import Path

import numpy as np
import torch

from decoding import models
from decoding.config import ModelConfig
from decoding.errors import ModelLoadError, UnsupportedArchitecture
from decoding.loader.files import sha256_of_files
from decoding.loader.gguf_file import GGUFFile
from decoding.loader.gguf_split import check_parts, part_paths
from decoding.loader.source import ModelSource
from decoding.log import get_logger



TOKENIZER_CACHE_VERSION = 2  # 2: the stop set includes end-of-turn/-message tokens (a cached 1 lacks them)

# Tokens that end a turn although the file's eos names another: Llama 3.x ends a chat turn with <|eot_id|>
# and a tool call with <|eom_id|> (its generation config stops at both, and llama.cpp finds them by text).
END_OF_GENERATION_TEXTS = ("<|eot_id|>", "<|eom_id|>")


def end_of_generation(eos_ids: tuple[int, ...], field, vocab: dict[str, int]) -> tuple[int, ...]:
    """The stop set: the file's eos, its end-of-turn and end-of-message ids where it records them
    (``tokenizer.ggml.eot_token_id`` / ``eom_token_id``), and the end tokens its vocabulary names."""
    ids = list(eos_ids)
    extra = [field("tokenizer.ggml.eot_token_id"), field("tokenizer.ggml.eom_token_id")]
    extra += [vocab.get(text) for text in END_OF_GENERATION_TEXTS]
    for i in extra:
        if i is not None and int(i) not in ids:
            ids.append(int(i))
    return tuple(ids)

class GGUFSource(ModelSource):
    def __init__(self, path: Path, cache_root: Path | None = None):
        # A split set (NAME-0000i-of-0000N.gguf) is one model: metadata from its first part,
        # tensors from all of them (decoding.loader.gguf_split).
        self.parts = part_paths(Path(path))
        self.path = self.parts[0]
        #: Each part's parsed header and mapped tensors, in order (the share modules read their layout).
        self.gguf_files: tuple[GGUFFile, ...] = tuple(GGUFFile(p) for p in self.parts)
        check_parts(self.parts, self.gguf_files)
        self._cache_root = cache_root
        # No family for the architecture: no tensors are indexed, and .config says why.
        self._family = models.family(self.arch)
        self._tensors = {}
        if self._family is not None:
            self._index_tensors()

    def release_pages(self) -> None:
        """This process's read pages of every part handed back (``GGUFFile.release_pages``)."""
        for f in self.gguf_files:
            f.release_pages()

    def _index_tensors(self) -> None:
        for t in (t for f in self.gguf_files for t in f.tensors):
            canon = self._family.gguf_canonical(t.name)
            if canon:
                self._tensors[canon] = t
        missing = [n for n in ("embed", "final_norm") if n not in self._tensors]
        if missing:
            raise ModelLoadError(f"{self.path}: GGUF lacks tensors {missing}")

    # -- metadata -----------------------------------------------------------
    def field(self, key: str, default=None):
        """One metadata value of the file (``default`` when the file does not carry it, or carries it as
        an array too long to keep: the vocabulary's tokens, types and merges)."""
        return self.gguf_files[0].field(key, default)

    @property
    def file_type(self) -> int | None:
        """GGUF's ``general.file_type``: the file's dominant quantisation (None: not recorded)."""
        v = self.field("general.file_type")
        return None if v is None else int(v)

    @cached_property
    def arch(self) -> str:
        return str(self.field("general.architecture", "?"))

    @cached_property
    def config(self) -> ModelConfig:
        arch = self.arch
        if self._family is None:
            raise UnsupportedArchitecture(
                f"{self.path}: architecture {arch!r} is not supported "
                f"(supported: {', '.join(models.SUPPORTED_ARCHS)})")
        return self._family.config_from_gguf(arch, self.field, self._tensors,
                                             self._tensors["embed"].shape[1])

    # -- tensors --------------------------------------------------------------
    def has_tensor(self, name: str) -> bool:
        return name in self._tensors

    def read_tensor(self, name: str) -> torch.Tensor:
        import gguf

        t = self._tensors.get(name)
        if t is None:
            raise ModelLoadError(f"{self.path}: tensor {name!r} missing")
        try:
            arr = gguf.quants.dequantize(t.data, t.tensor_type)
        except Exception as exc:
            raise ModelLoadError(f"{self.path}: cannot dequantise {t.name} ({t.tensor_type.name}): {exc}") from exc
        arr = np.asarray(arr, dtype=np.float32).reshape([int(d) for d in reversed(t.shape)])
        heads = self._family.gguf_heads_permuted(self.config, name)
        if heads is not None:
            arr = self._family.unpermute_rows(arr, heads)
        return torch.from_numpy(np.array(arr, dtype=np.float32, copy=True))  # writable, owned

    def tensor_type(self, name: str) -> str | None:
        """The GGUF storage type of a canonical tensor ("Q4_K", "Q6_K", "F32"...), None if absent."""
        t = self._tensors.get(name)
        return None if t is None else t.tensor_type.name

    def read_int4_groups(self, name: str):
        """A 4-bit tensor's own codes, scales and offsets (``decoding.quant.groups``), rows un-permuted
        like :meth:`read_tensor`'s; None when the tensor is not stored in a 4-bit format."""
        from decoding.quant.groups import FOUR_BIT_TYPES, from_gguf_blocks

        t = self._tensors.get(name)
        if t is None or t.tensor_type.name not in FOUR_BIT_TYPES or len(t.shape) != 2:
            return None
        cols, rows = (int(d) for d in t.shape)
        return self._unpermuted(name, from_gguf_blocks(t.tensor_type.name, np.asarray(t.data), (rows, cols)), rows)

    def read_int8_planes(self, name: str):
        """A Q8_0/Q5_0 tensor's own codes as two 4-bit planes (``decoding.quant.groups``), rows
        un-permuted like :meth:`read_tensor`'s; None for other types."""
        from decoding.quant.groups import EIGHT_BIT_TYPES, from_gguf_eight_bit

        t = self._tensors.get(name)
        if t is None or t.tensor_type.name not in EIGHT_BIT_TYPES or len(t.shape) != 2:
            return None
        cols, rows = (int(d) for d in t.shape)
        planes = from_gguf_eight_bit(t.tensor_type.name, np.asarray(t.data), (rows, cols))
        return tuple(self._unpermuted(name, p, rows) for p in planes)

    def _unpermuted(self, name: str, groups, rows: int):
        heads = self._family.gguf_heads_permuted(self.config, name)
        if heads is not None:
            return groups.permute_rows(self._family.unpermute_rows(np.arange(rows), heads))
        return groups

    def read_blocks(self, name: str):
        """A matrix as the file stores it, for the integer kernels (``decoding.quant.blocks.BlockPart``):
        a view of the mapped file, not a copy; rows llama.cpp permuted are put back through the part's
        output columns. None when the kernels do not multiply its type (a float or a rarer quant)."""
        from decoding.quant.blocks import BlockPart, supported

        t = self._tensors.get(name)
        if t is None or len(t.shape) != 2 or not supported(t.tensor_type.name):
            return None
        cols, rows = (int(d) for d in t.shape)
        blocks = np.asarray(t.data).view(np.uint8).reshape(rows, -1)
        heads = self._family.gguf_heads_permuted(self.config, name)
        colmap = None
        if heads is not None:  # stored row order[i] is row i: its output goes to column i
            order = np.asarray(self._family.unpermute_rows(np.arange(rows), heads))
            colmap = np.empty(rows, np.int64)
            colmap[order] = np.arange(rows, dtype=np.int64)
        return BlockPart(t.tensor_type.name, blocks, cols, colmap)

    def read_row_blocks(self, name: str):
        """A matrix's rows as stored (``(type name, uint8 [rows, bytes per row], cols)``), for lookups
        that dequantise only the rows they need (the token embedding)."""
        t = self._tensors.get(name)
        if t is None or len(t.shape) != 2:
            raise ModelLoadError(f"{self.path}: no matrix {name!r}")
        cols, rows = (int(d) for d in t.shape)
        raw = np.ascontiguousarray(np.asarray(t.data).view(np.uint8)).reshape(rows, -1)
        return t.tensor_type.name, torch.from_numpy(raw.copy()), cols

    def rope_freq_factors(self):
        return self.read_tensor("rope_freqs") if "rope_freqs" in self._tensors else None

    # -- identity and tokenizer ---------------------------------------------
    @cached_property
    def identity(self) -> str:
        cache = self._cache_dir()
        if cache is None:
            return f"{self.path.name}@{sha256_of_files(self.parts)[:16]}"
        index = cache / "identity.json"
        key = [x for p in self.parts for st in [p.stat()] for x in (str(p.resolve()), st.st_size, st.st_mtime_ns)]
        if index.is_file():
            cached = json.loads(index.read_text())
            if cached.get("key") == key:
                return cached["identity"]
        ident = f"{self.path.name}@{sha256_of_files(self.parts)[:16]}"
        index.parent.mkdir(parents=True, exist_ok=True)
        index.write_text(json.dumps({"key": key, "identity": ident}))
        return ident

    def _cache_dir(self) -> Path | None:
        """This file's directory under the caller's cache root (None: no cache)."""
        if self._cache_root is None:
            return None
        stamp = ";".join(f"{p.resolve()}:{st.st_size}:{st.st_mtime_ns}" for p in self.parts for st in [p.stat()])
        stamp += f";tokenizer-cache-{TOKENIZER_CACHE_VERSION}"
        tag = hashlib.sha256(stamp.encode()).hexdigest()[:16]
        return self._cache_root / f"{self.path.stem}-{tag}"

    def _load_tokenizer(self):
        from decoding.loader.tokenizer import load_cache

        cache = self._cache_dir()
        if cache is None:  # no cache: convert into a scratch directory, load, forget
            import tempfile

            with tempfile.TemporaryDirectory(prefix="decoding-tokenizer-") as tmp:
                return self._convert_tokenizer(Path(tmp))
        tok = load_cache(cache)
        if tok is not None:
            return tok
        return self._convert_tokenizer(cache)

    def _convert_tokenizer(self, cache: Path):
        from decoding.loader.tokenizer import TokenizerMeta, load_cache, save_cache

        cfg = self.config  # an architecture we cannot run fails here, before a slow conversion
        get_logger("loader").info("tokenizer_convert", model=str(self.path), cache=str(cache))
        try:
            from transformers import AutoTokenizer

            hf = AutoTokenizer.from_pretrained(str(self.path.parent), gguf_file=self.path.name)
        except Exception as exc:
            raise ModelLoadError(f"{self.path}: cannot build a tokenizer from GGUF metadata ({exc})") from exc
        add_bos = bool(self.field("tokenizer.ggml.add_bos_token", False))
        meta = TokenizerMeta(
            chat_template=self.field("tokenizer.chat_template"), bos_id=cfg.bos_id,
            eos_ids=end_of_generation(cfg.eos_ids, self.field, hf.get_vocab()), add_bos=add_bos,
            bos_token=hf.bos_token, eos_token=hf.eos_token,
        )
        save_cache(cache, hf.backend_tokenizer, meta)
        return load_cache(cache)
