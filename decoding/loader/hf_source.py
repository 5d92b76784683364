"""Hugging Face model directories: config.json + safetensors (+ tokenizer files).

safetensors are memory-mapped and read tensor by tensor, so a stage loads only
its layer range.
"""

from __future__ import annotations

import hashlib
import json
from functools import cached_property
from pathlib import Path

import torch

from decoding.config import SUPPORTED_ARCHS, ModelConfig
from decoding.errors import ModelLoadError, UnsupportedArchitecture
from decoding.loader.source import ModelSource

_LAYER_MAP = {
    "input_layernorm.weight": "attn_norm", "self_attn.q_proj.weight": "q",
    "self_attn.k_proj.weight": "k", "self_attn.v_proj.weight": "v",
    "self_attn.o_proj.weight": "o", "post_attention_layernorm.weight": "mlp_norm",
    "mlp.gate_proj.weight": "gate", "mlp.up_proj.weight": "up", "mlp.down_proj.weight": "down",
    "self_attn.q_proj.bias": "q_bias", "self_attn.k_proj.bias": "k_bias",
    "self_attn.v_proj.bias": "v_bias",
}
_GLOBAL_MAP = {"model.embed_tokens.weight": "embed", "model.norm.weight": "final_norm",
               "lm_head.weight": "lm_head"}
_ARCH_BY_MODEL_TYPE = {"llama": "llama", "mistral": "mistral", "qwen2": "qwen2"}


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
        from safetensors import safe_open

        for f in files:
            try:
                with safe_open(str(f), framework="pt") as sf:
                    for key in sf.keys():
                        canon = self._canonical(key)
                        if canon:
                            self._where[canon] = (f, key)
            except Exception as exc:
                raise ModelLoadError(f"{f}: corrupt safetensors file ({exc})") from exc
        self._handles: dict[Path, object] = {}

    @staticmethod
    def _canonical(key: str) -> str | None:
        if key in _GLOBAL_MAP:
            return _GLOBAL_MAP[key]
        parts = key.split(".", 3)
        if len(parts) == 4 and parts[0] == "model" and parts[1] == "layers":
            base = _LAYER_MAP.get(parts[3])
            return f"layers.{parts[2]}.{base}" if base else None
        return None

    @cached_property
    def config(self) -> ModelConfig:
        r = self._raw
        mt = r.get("model_type", "?")
        arch = _ARCH_BY_MODEL_TYPE.get(mt)
        if arch not in SUPPORTED_ARCHS:
            raise UnsupportedArchitecture(
                f"{self.path}: model_type {mt!r} is not supported (supported: {', '.join(SUPPORTED_ARCHS)})")
        n_heads = int(r["num_attention_heads"])
        hidden = int(r["hidden_size"])
        eos = r.get("eos_token_id")
        gen = self.path / "generation_config.json"
        if gen.is_file():
            eos = json.loads(gen.read_text()).get("eos_token_id", eos)
        eos_ids = tuple(eos) if isinstance(eos, list) else ((eos,) if eos is not None else ())
        sliding = r.get("sliding_window") if r.get("use_sliding_window", arch == "mistral") else None
        return ModelConfig(
            arch=arch, vocab_size=int(r["vocab_size"]), hidden_size=hidden,
            intermediate_size=int(r["intermediate_size"]), num_layers=int(r["num_hidden_layers"]),
            num_heads=n_heads, num_kv_heads=int(r.get("num_key_value_heads") or n_heads),
            head_dim=int(r.get("head_dim") or hidden // n_heads),
            rope_theta=float(r.get("rope_theta", (r.get("rope_parameters") or {}).get("rope_theta", 10000.0))),
            rope_scaling=r.get("rope_scaling"),
            rms_eps=float(r.get("rms_norm_eps", 1e-5)),
            max_position=int(r.get("max_position_embeddings", 2048)),
            tie_embeddings=bool(r.get("tie_word_embeddings", False)) or "lm_head" not in self._where,
            attention_bias=bool(r.get("attention_bias", arch == "qwen2")) and "layers.0.q_bias" in self._where,
            sliding_window=int(sliding) if sliding else None,
            bos_id=r.get("bos_token_id"), eos_ids=eos_ids,
        )

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
