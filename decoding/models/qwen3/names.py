"""Qwen3's tensor names: the Llama family's, plus each layer's query and key head norms.

Canonical names ``layers.{i}.q_norm`` and ``layers.{i}.k_norm`` ([head_dim]
each); GGUF spells them ``blk.{i}.attn_q_norm.weight`` / ``attn_k_norm``,
Hugging Face ``model.layers.{i}.self_attn.q_norm.weight`` / ``k_norm``.
"""

from __future__ import annotations

from decoding.models import llama

_GGUF_HEAD_NORMS = {"attn_q_norm": "q_norm", "attn_k_norm": "k_norm"}
_HF_HEAD_NORMS = {"self_attn.q_norm.weight": "q_norm", "self_attn.k_norm.weight": "k_norm"}


def gguf_canonical(name: str) -> str | None:
    """The canonical name of a GGUF tensor (``blk.3.attn_q_norm.weight`` -> ``layers.3.q_norm``), None if unused."""
    parts = name.split(".")
    if len(parts) == 4 and parts[0] == "blk" and parts[3] == "weight" and parts[2] in _GGUF_HEAD_NORMS:
        return f"layers.{parts[1]}.{_GGUF_HEAD_NORMS[parts[2]]}"
    return llama.gguf_canonical(name)


def hf_canonical(key: str) -> str | None:
    """The canonical name of a safetensors key (``model.layers.3.self_attn.k_norm.weight`` -> ``layers.3.k_norm``)."""
    parts = key.split(".", 3)
    if len(parts) == 4 and parts[0] == "model" and parts[1] == "layers" and parts[3] in _HF_HEAD_NORMS:
        return f"layers.{parts[2]}.{_HF_HEAD_NORMS[parts[3]]}"
    return llama.hf_canonical(key)
