"""Hugging Face model directories: config.json + safetensors (+ tokenizer files).

safetensors are memory-mapped and read tensor by tensor, so a stage loads only
its layer range. What the keys are called and how config.json reads belong to
the architecture's family (``decoding.models``); this module only reads files.
"""

from __future__ import annotations

import hashlib
import json
from functools import cached_property
from pathlib import Path

import torch

from decoding import models
from decoding.config import ModelConfig
from decoding.errors import ModelLoadError, UnsupportedArchitecture
from decoding.loader.source import ModelSource


class HFDirSource(ModelSource):
    def __init__(self, path: Path):
        self.path = Path(path)
        cfg_file = self.path / "config.json"
        if not cfg_file.is_file():
            raise ModelLoadError(f"{self.path}: not a Hugging Face model directory (no config.json)")
        try:
            self._raw = json.loads(cfg_file.read_text())
        except json.JSONDecodeError as exc:
            raise ModelLoadError(f"{cfg_file}: invalid JSON ({exc})") from exc
        files = sorted(self.path.glob("*.safetensors"))
        if not files:
            raise ModelLoadError(f"{self.path}: no *.safetensors weights (PyTorch .bin is not supported)")
        self._where: dict[str, tuple[Path, str]] = {}
        # No family for the model type: no tensors are indexed, and .config says why.
        self._arch, self._family = models.hf_family(self._raw.get("model_type", "?")) or (None, None)
        from safetensors import safe_open

        for f in files:
            try:
                with safe_open(str(f), framework="pt") as sf:
                    for key in sf.keys():
                        canon = self._family.hf_canonical(key) if self._family is not None else None
                        if canon:
                            self._where[canon] = (f, key)
            except Exception as exc:
                raise ModelLoadError(f"{f}: corrupt safetensors file ({exc})") from exc
        self._handles: dict[Path, object] = {}

    @cached_property
    def config(self) -> ModelConfig:
        if self._family is None:
            raise UnsupportedArchitecture(
                f"{self.path}: model_type {self._raw.get('model_type', '?')!r} is not supported "
                f"(supported: {', '.join(models.SUPPORTED_ARCHS)})")
        return self._family.config_from_hf(self._arch, self._raw, self._where, self.path)

    def has_tensor(self, name: str) -> bool:
        return name in self._where

    def read_tensor(self, name: str) -> torch.Tensor:
        from safetensors import safe_open

        if name not in self._where:
            raise ModelLoadError(f"{self.path}: tensor {name!r} missing")
        f, key = self._where[name]
        with safe_open(str(f), framework="pt") as sf:
            return sf.get_tensor(key).to(torch.float32)

    def rope_freq_factors(self):
        return None

    @cached_property
    def identity(self) -> str:
        h = hashlib.sha256()
        for f in sorted(self.path.glob("*.safetensors")) + [self.path / "config.json"]:
            st = f.stat()
            h.update(f"{f.name}:{st.st_size}".encode())
            with open(f, "rb") as fh:  # header + first MiB: cheap and content-bound
                h.update(fh.read(1 << 20))
        return f"{self.path.name}@{h.hexdigest()[:16]}"

    def _load_tokenizer(self):
        from decoding.loader.tokenizer import Tokenizer, TokenizerMeta

        tj = self.path / "tokenizer.json"
        if not tj.is_file():
            raise ModelLoadError(f"{self.path}: no tokenizer.json (a fast tokenizer file is required)")
        tc_file = self.path / "tokenizer_config.json"
        tc = json.loads(tc_file.read_text()) if tc_file.is_file() else {}
        template = tc.get("chat_template")
        tmpl_file = self.path / "chat_template.jinja"
        if template is None and tmpl_file.is_file():
            template = tmpl_file.read_text()
        if isinstance(template, list):  # named templates: take the default one
            template = next((t["template"] for t in template if t.get("name") == "default"), None)

        def tok_str(v):
            return v.get("content") if isinstance(v, dict) else v

        cfg = self.config
        meta = TokenizerMeta(
            chat_template=template, bos_id=cfg.bos_id, eos_ids=cfg.eos_ids,
            add_bos=bool(tc.get("add_bos_token", False)),
            bos_token=tok_str(tc.get("bos_token")), eos_token=tok_str(tc.get("eos_token")),
        )
        return Tokenizer(tj, meta)
